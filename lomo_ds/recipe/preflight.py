"""The training program before its recipe: the command line, the dry run, the checks only the
machine can tell (still before any model is allocated), the ranks' logging, and how every rank
stops on a bad config (lomo_ds/recipe/train.py runs them in this order)."""
from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import time
import warnings

from tqdm import tqdm

from lomo_ds.config import leaf_module
from lomo_ds.config.errors import ConfigError
from lomo_ds.config.overrides import parse_override_args
from lomo_ds.config.run import METHODS
from lomo_ds.planning import inference, planner
from lomo_ds.planning.model_tree import hf_config, meta_model
from lomo_ds.recipe import harness_eval
from lomo_ds.runtime.layout import ParallelLayout
from lomo_ds.storage.models import model_config


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap.add_argument("--config", required=True, help="run config JSON (see ds_configs/)")
    ap.add_argument("--lr", type=float, help="lomo.lr: the LOMO methods' learning rate (the others': --set train.lr=)")
    ap.add_argument("--task", help="data.task")
    ap.add_argument("--model", help="model.path")
    ap.add_argument("--method", help=f"train.method ({', '.join(METHODS)})")
    ap.add_argument("--output-dir", help="output.dir")
    ap.add_argument("--epochs", type=int, help="train.epochs")
    ap.add_argument("--max-steps", type=int, help="train.max_steps")
    ap.add_argument("--accumulation-steps", type=int,
                    help="gradient_accumulation_steps: micro-batches per optimizer step (= train.accumulation_steps)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override any field, e.g. --set train.clip_grad_norm=1.0 (value parsed as JSON)")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in output.dir")
    ap.add_argument("--dry-run", action="store_true", help="print the resolved config and predicted memory, then exit")
    # the deepspeed launcher's
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    return add_arguments(ap).parse_args(argv)


def overrides_from(args) -> dict:
    flags = {"lomo.lr": args.lr, "data.task": args.task, "model.path": args.model, "train.method": args.method,
             "output.dir": args.output_dir, "train.epochs": args.epochs, "train.max_steps": args.max_steps,
             "gradient_accumulation_steps": args.accumulation_steps}
    out = {k: v for k, v in flags.items() if v is not None}
    out.update(parse_override_args(args.set))
    return out


def dry_run(cfg) -> None:
    """The resolved config, then the memory planner's per-GPU prediction for it."""
    print(json.dumps(cfg.to_dict(), indent=2))
    world = int(os.environ.get("WORLD_SIZE", "0")) or None  # the launcher's rank count, if launched
    try:
        p = planner.plan_for_run(cfg, world)
    except ValueError as e:
        print(f"memory plan: not available ({e})")
        return
    print(planner.format_plan(p, world))
    method = planner.method_of_run(cfg)
    if world and method is not None:
        need = p.estimates[(method, world)].total / planner.GIB
        print(f"this launch ({world} ranks): {planner.METHOD_LABELS[method]} needs {need:.2f} GiB per GPU")
    print_eval_plan(cfg, p, world)


def print_eval_plan(cfg, p, world: int | None) -> None:
    """The evaluation's and generation's memory on this launch's GPU count (else the smallest the
    run's method fits on)."""
    method = planner.method_of_run(cfg)
    if method not in planner.FUSED:
        return
    gpus = world or p.min_gpus.get(method) or max(n for _, n in p.estimates)
    print()
    print(inference.format_eval(p, inference.eval_spec_for(cfg), gpus, method))


def check_runtime(cfg) -> None:
    """Errors only the machine can tell, still before any model is allocated."""
    from deepspeed.accelerator import get_accelerator  # not at the top: show_what_matters runs first

    if cfg.precision.dtype == "fp16" and get_accelerator().device_name() == "cpu":
        raise ConfigError(f"{cfg.source_path}: fp16.enabled: DeepSpeed refuses fp16 on a CPU; use bf16 or fp32 here")
    check_fetch_unit(cfg)
    if cfg.eval.harness_tasks:
        try:
            harness_eval.check_tasks(cfg)
        except ValueError as e:
            raise ConfigError(f"{cfg.source_path or '<config>'}: eval.harness_tasks: {e}") from None


def check_fetch_unit(cfg) -> None:
    """zero_optimization.leaf_module against the model's own module classes, from its config.json
    built on the meta device (no memory), where model.path is a folder on this machine; otherwise
    the engine checks it on the loaded model (lomo_ds/config/leaf_module.py)."""
    value = (cfg.ds.get("zero_optimization") or {}).get("leaf_module")
    config_json = os.path.join(cfg.model.path, "config.json")
    if value is None or not os.path.isfile(config_json):
        return
    with open(config_json) as f:
        raw = json.load(f)
    try:
        model = meta_model(hf_config(raw, config_json))
    except (ValueError, KeyError):  # remote code, or an architecture transformers cannot build alone
        return
    try:
        leaf_module.resolve_value(value, model)
    except ConfigError as e:
        raise ConfigError(f"{cfg.source_path or '<config>'}: {e} (model.path {cfg.model.path!r})") from None


def check_sequence_parallel_model(cfg, layout: ParallelLayout) -> None:
    """The layout's requirements of the model (heads, attention), from its config alone, before any
    rank allocates it. A GGUF model not converted yet has no config to read: the engine checks the
    built model then; a model checked here is not checked again there (the same layout)."""
    if layout.sp_size == 1:
        return
    config = model_config(cfg)
    if config is not None:
        layout.check_model(config)


def show_what_matters(rank: int) -> None:
    """Rank 0 prints progress, results, and each library warning once; the other ranks print only
    errors (every rank would otherwise repeat the same DeepSpeed/torch/transformers messages).
    Called before DeepSpeed is imported: it logs from its first import on."""
    if rank == 0:
        warnings.simplefilter("once")
        return
    warnings.simplefilter("ignore")
    # DeepSpeed resets its logger's level when it creates it; a filter stays.
    logging.getLogger("DeepSpeed").addFilter(lambda record: record.levelno >= logging.ERROR)
    logging.getLogger("torch").setLevel(logging.ERROR)
    import datasets  # these two after the filters above: they log from their first import on
    import transformers

    # Libraries draw their own bars (transformers' loading and GGUF conversion, datasets' maps): off
    # by default here, as the TQDM_DISABLE variable would do had tqdm not been imported already.
    tqdm.__init__ = functools.partialmethod(tqdm.__init__, disable=True)
    transformers.utils.logging.set_verbosity_error()
    datasets.utils.logging.set_verbosity_error()


def stop_every_rank(rank: int, message: str) -> int:
    """Every rank stops; rank 0 alone says why. The others wait before exiting: a launcher kills the
    whole group as soon as one rank exits, and if a silent rank went first, rank 0 would be killed
    before its message was printed. The launcher ends the wait as soon as rank 0 has exited."""
    if rank == 0:
        print(message, file=sys.stderr, flush=True)
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        time.sleep(30)
    return 2
