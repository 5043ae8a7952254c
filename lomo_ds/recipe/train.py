"""Fine-tune a causal language model with LOMO (or a baseline method) on DeepSpeed ZeRO-3.

    deepspeed --num_gpus 8 launch/train.py --config ds_configs/llama65b.json
    deepspeed --num_gpus 2 -m lomo_ds.cli train --config ds_configs/cpu_default.json   # = lomo-ds train
    lomo-ds train --config ds_configs/llama7b.json --dry-run                             # config + memory plan

One file describes the run (DeepSpeed's keys, the "lomo" section, model, tokenizer, data, train,
eval, output); common fields have flags, any field has --set key=value.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from lomo_ds.config.lomo import ConfigError
from lomo_ds.config.run import METHODS, load_run_config, parse_override_args


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap.add_argument("--config", required=True, help="run config JSON (see ds_configs/)")
    ap.add_argument("--lr", type=float, help="lomo.lr")
    ap.add_argument("--task", help="data.task")
    ap.add_argument("--model", help="model.path")
    ap.add_argument("--method", help=f"train.method ({', '.join(METHODS)})")
    ap.add_argument("--output-dir", help="output.dir")
    ap.add_argument("--epochs", type=int, help="train.epochs")
    ap.add_argument("--max-steps", type=int, help="train.max_steps")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override any field, e.g. --set lomo.clip_grad_norm=1.0 (value parsed as JSON)")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in output.dir")
    ap.add_argument("--dry-run", action="store_true", help="print the resolved config and predicted memory, then exit")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # the deepspeed launcher's
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    return add_arguments(ap).parse_args(argv)


def overrides_from(args) -> dict:
    flags = {"lomo.lr": args.lr, "data.task": args.task, "model.path": args.model, "train.method": args.method,
             "output.dir": args.output_dir, "train.epochs": args.epochs, "train.max_steps": args.max_steps}
    out = {k: v for k, v in flags.items() if v is not None}
    out.update(parse_override_args(args.set))
    return out


def dry_run(cfg) -> None:
    """The resolved config, then the memory planner's per-GPU prediction for it."""
    from lomo_ds.planning import planner

    print(json.dumps(cfg.to_dict(), indent=2))
    world = int(os.environ.get("WORLD_SIZE", "0")) or None  # the launcher's rank count, if launched
    try:
        p = planner.plan_for_run(cfg, world)
    except ValueError as e:
        print(f"memory plan: not available ({e})")
        return
    print(planner.format_plan(p))
    if world:
        print(f"this launch ({world} ranks): LOMO needs {p.estimates[('lomo', world)].total / planner.GIB:.2f} GiB per GPU")


def check_runtime(cfg) -> None:
    """Errors only the machine can tell, still before any model is allocated."""
    from deepspeed.accelerator import get_accelerator

    if cfg.ds.get("fp16", {}).get("enabled") and get_accelerator().device_name() == "cpu":
        raise ConfigError(f"{cfg.source_path}: fp16.enabled: DeepSpeed refuses fp16 on a CPU; use bf16 or fp32 here")


def show_what_matters(rank: int) -> None:
    """Rank 0 prints progress, results, and each library warning once; the other ranks print only
    errors (every rank would otherwise repeat the same DeepSpeed/torch/transformers messages).
    Called before DeepSpeed is imported: it logs from its first import on."""
    import logging
    import warnings

    if rank == 0:
        warnings.simplefilter("once")
        return
    warnings.simplefilter("ignore")
    # DeepSpeed resets its logger's level when it creates it; a filter stays.
    logging.getLogger("DeepSpeed").addFilter(lambda record: record.levelno >= logging.ERROR)
    logging.getLogger("torch").setLevel(logging.ERROR)
    import functools

    import datasets
    import tqdm
    import transformers

    # Libraries draw their own bars (transformers' loading and GGUF conversion, datasets' maps): off
    # by default here, as the TQDM_DISABLE variable would do had tqdm not been imported already.
    tqdm.tqdm.__init__ = functools.partialmethod(tqdm.tqdm.__init__, disable=True)
    transformers.utils.logging.set_verbosity_error()
    datasets.utils.logging.set_verbosity_error()


def planned_steps(cfg, n_train: int, world: int) -> tuple[int, int]:
    """(steps per epoch, steps in the whole run)."""
    from lomo_ds.data.loading import steps_per_epoch

    per_epoch = steps_per_epoch(max(1, n_train), world, cfg.micro_batch)
    total = cfg.train.epochs * per_epoch
    if cfg.train.max_steps is not None:
        total = min(total, cfg.train.max_steps)
    return per_epoch, 0 if cfg.train.method == "zero_shot" else total


def main(argv=None) -> int:
    return run(parse_args(argv))


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_run_config(args.config, overrides_from(args))
        if args.dry_run:
            dry_run(cfg)
            return 0
        show_what_matters(int(os.environ.get("RANK", "0")))  # the launcher's rank, before any library speaks
        check_runtime(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2

    # Heavy imports only once the config is known to be good.
    import torch
    from tqdm import tqdm

    from lomo_ds.storage import checkpoint
    from lomo_ds.data.loading import DataError, batches_for_step, build_datasets, collate, epoch_order, pad_id_of, position_of_step
    from lomo_ds.runtime.dist import init_distributed
    from lomo_ds.evaluation.scoring import evaluate, evaluate_loss
    from lomo_ds.planning.memory import cuda_peak_bytes, process_peak_rss_bytes
    from lomo_ds.methods import build_engine
    from lomo_ds.recipe.metrics import Metrics
    from lomo_ds.storage.models import load_model, load_tokenizer

    torch.manual_seed(cfg.train.seed)
    init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    barrier = torch.distributed.barrier

    def say(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    # ---- data (before the model: a malformed file fails fast and cheap)
    tokenizer = load_tokenizer(cfg, rank, barrier)
    try:
        data = build_datasets(cfg, tokenizer)
    except DataError as e:
        print(f"data error: {e}", file=sys.stderr)
        return 2
    pad_id = pad_id_of(tokenizer)
    steps_per_epoch, total_steps = planned_steps(cfg, len(data.train), world)
    say(f"data: {json.dumps(data.stats)}; {steps_per_epoch} steps/epoch, {total_steps} steps in all")

    # ---- model and engine
    engine = build_engine(cfg, load_model(cfg, cfg.ds), total_steps)
    if not engine.supports_resume and (args.resume or cfg.output.checkpoint_every):
        say(f"train.method={cfg.train.method}: nothing to checkpoint or resume")
    start_step = 0
    if args.resume and engine.supports_resume:
        ckpt = checkpoint.latest_checkpoint(cfg.output.dir)
        if ckpt is None:
            say(f"resume: no checkpoint in {cfg.output.dir}; starting from scratch")
        else:
            start_step = checkpoint.load_checkpoint(ckpt, engine)["step"]
            say(f"resumed from {ckpt} at step {start_step}")
    metrics = Metrics(cfg.output.dir, cfg.output.metrics_file, rank, append=args.resume,
                      tensorboard=cfg.output.tensorboard)

    def save() -> None:
        checkpoint.save_checkpoint(cfg.output.dir, engine, {"config": cfg.to_dict()}, cfg.output.keep_last, barrier)

    def run_eval(tag: str, step: int) -> dict:
        def forward_logits(batch):
            return engine.eval_forward(batch).logits

        t0 = time.perf_counter()
        if data.eval:
            res = evaluate(forward_logits, data.eval, pad_id, cfg.eval.batch_size, rank, world, progress=rank == 0)
        elif data.eval_lm:
            res = evaluate_loss(forward_logits, data.eval_lm, pad_id, cfg.eval.batch_size, rank, world,
                                progress=rank == 0)
        else:
            return {}
        res = {f"eval/{k}": v for k, v in res.items()}
        metrics.log({"step": step, "phase": tag, **res, "eval_seconds": time.perf_counter() - t0})
        shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items() if "accuracy" in k or "loss" in k}
        say(f"[{tag}] step {step}: {shown}")
        return res

    results = {}
    if cfg.train.zero_shot_eval and start_step == 0:
        results["zero_shot"] = run_eval("zero_shot", 0)

    # ---- the training loop
    progress = tqdm(total=total_steps, initial=start_step, disable=rank != 0, dynamic_ncols=True, desc="train")
    for step in range(start_step, total_steps):
        epoch, step_in_epoch = position_of_step(step, steps_per_epoch)
        order = epoch_order(len(data.train), cfg.train.seed, epoch)
        batch = collate([data.train[i] for i in batches_for_step(order, step_in_epoch, world, cfg.micro_batch, rank)],
                        pad_id)
        t0 = time.perf_counter()
        out = engine.train_step(batch)
        elapsed = time.perf_counter() - t0
        tokens = int(batch["attention_mask"].sum())
        peak_mem = cuda_peak_bytes()
        peak_mem = process_peak_rss_bytes() if peak_mem is None else peak_mem
        record = {"step": step + 1, "epoch": epoch, "loss": out["loss"], "lr": out["lr"], "grad_norm": out["grad_norm"],
                  "skipped": out["skipped"], "loss_scale": out["loss_scale"], "tokens": tokens,
                  "tgs": tokens / elapsed, "step_seconds": elapsed, "peak_mem_gb": peak_mem / 2**30}
        metrics.log(record)
        progress.update(1)
        progress.set_postfix(loss=f"{out['loss']:.4f}", lr=f"{out['lr']:.2e}", tgs=f"{record['tgs']:.0f}",
                             mem=f"{record['peak_mem_gb']:.2f}G")
        done = step + 1
        if engine.supports_resume and cfg.output.checkpoint_every and done % cfg.output.checkpoint_every == 0 \
                and done < total_steps:
            save()
        if cfg.eval.every_steps and done % cfg.eval.every_steps == 0 and done < total_steps:
            run_eval("eval", done)
    progress.close()

    # ---- the end: evaluate, checkpoint, export
    if cfg.eval.at_end and total_steps > 0:
        results["final"] = run_eval("final", total_steps)
    if engine.supports_resume and 0 < total_steps and start_step < total_steps and (
            cfg.output.checkpoint_every or cfg.output.export_hf):
        save()
    if cfg.output.export_hf and total_steps > 0:
        path = checkpoint.export_hf(engine, tokenizer, os.path.join(cfg.output.dir, "hf_model"), barrier)
        say(f"exported Hugging Face model to {path}")
    metrics.close()
    if rank == 0:
        # Which split (validation or heldout) and how many examples the accuracies are on.
        summary = {"steps": total_steps, "eval_split": cfg.eval.split, "eval_examples": data.stats["eval_size"],
                   **{f"{k}_accuracy": v.get("eval/accuracy") for k, v in results.items() if v}}
        with open(os.path.join(cfg.output.dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        zs, ft = (results.get(k, {}).get("eval/accuracy") for k in ("zero_shot", "final"))
        if zs is not None and ft is not None and not math.isnan(zs):
            # The run's result in one line: where it started, where it ended, and the gain.
            print(f"accuracy: zero-shot {zs:.3f} -> fine-tuned ({cfg.train.method}) {ft:.3f} "
                  f"({100 * (ft - zs):+.1f} points)", flush=True)
    barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
