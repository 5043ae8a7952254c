"""`lomo-ds eval`: lm-evaluation-harness on an exported model, and the recipe's final evaluation with it.

    lomo-ds eval --model runs/cpu_default/hf_model --tasks builtin
    lomo-ds eval --model runs/x/hf_model --tasks mytask --include my_tasks/    # a harness YAML task
    lomo-ds eval --model runs/x/hf_model --tasks builtin --config ds_configs/cpu_default.json

A lomo_ds task name (builtin, rte, valence...) is written as a harness task from the run config's data
section (--config; else the task's defaults): the same examples lomo_ds's own evaluation scores. Any
other name is a harness YAML task found under an --include folder; nothing is fetched from a hub.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

from lomo_ds.config.errors import ConfigError
from lomo_ds.config.overrides import parse_override_args
from lomo_ds.config.run import load_run_config
from lomo_ds.evaluation import harness
from lomo_ds.methods.release import release_engine
from lomo_ds.planning import inference, planner


def harness_names(tasks: list[str], cfg, out_dir: str) -> list[str]:
    """The harness's names for `tasks`, writing each lomo_ds task's harness copy under out_dir from
    cfg's data section (its data.task replaced by the task's name)."""
    names = []
    for task in tasks:
        if task in harness.scored_tasks():
            data = cfg.data.model_copy(update={"task": task}) if cfg.data.task != task else cfg.data
            names.append(harness.write_task(cfg.model_copy(update={"data": data}), out_dir))
        else:
            names.append(task)
    return names


def evaluate_model(model_dir: str, tasks: list[str], cfg, include: list[str], batch_size: int,
                   limit: int | None = None, device: str | None = None, dtype: str = "auto") -> tuple[dict, dict]:
    """({task: metrics}, the model as loaded) from the harness for an exported model folder."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory(prefix="lomo_ds_harness_") as tmp:
        names = harness_names(tasks, cfg, tmp)
        return harness.run(model_dir, names, include=include, written=tmp, batch_size=batch_size, device=device,
                           limit=limit, dtype=dtype)


# A launcher's variables: with them in its environment the harness (through accelerate) would take
# itself for one rank of the run's world and wait for the others.
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
                "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "CROSS_RANK", "CROSS_SIZE")


def evaluate_export(model_dir: str, cfg, device: str, say=print) -> dict:
    """The harness on a run's export, in a process of its own outside the run's world (the run's
    ranks stay up meanwhile), the model loaded in the run's training dtype (cfg.precision): {task:
    metrics}, each task's accuracy and the model as loaded said through `say`. Raises HarnessError
    with the harness's last words."""
    with tempfile.TemporaryDirectory(prefix="lomo_ds_harness_") as tmp:
        cmd, out, loaded = export_command(model_dir, cfg, device, tmp)
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(out):
            raise harness.HarnessError(f"lm-evaluation-harness on {model_dir} failed ({proc.returncode}): "
                                       f"{proc.stderr.strip()[-2000:]}")
        with open(out) as f, open(loaded) as g:
            results, model = json.load(f), json.load(g)
    say(f"harness: {describe_model(model)}")
    for task, m in results.items():
        say(f"harness {task}: acc {m.get('acc', float('nan')):.4f} ({m.get('n', 0)} examples)")
    return results


def export_command(model_dir: str, cfg, device: str, tmp: str) -> tuple[list[str], str, str]:
    """`lomo-ds eval` on a run's export, as evaluate_export runs it (its config written under tmp), with
    the files it writes: the results and the model as loaded."""
    config, out, loaded = (os.path.join(tmp, name) for name in ("run.json", "results.json", "model.json"))
    with open(config, "w") as f:  # the sections that pick the examples
        json.dump({"model": {"path": model_dir}, "train": {"method": "zero_shot", "seed": cfg.train.seed},
                   "data": cfg.data.model_dump(mode="json"), "eval": {"split": cfg.eval.split}}, f)
    cmd = [sys.executable, "-m", "lomo_ds.cli", "eval", "--model", model_dir,
           "--tasks", ",".join(cfg.eval.harness_tasks), "--config", config, "--out", out,
           "--batch-size", str(cfg.eval.batch_size), "--device", device, "--model-out", loaded,
           "--dtype", harness.DTYPES[cfg.precision.dtype],  # the training dtype, not fp32's twice the bytes
           *[a for folder in cfg.eval.harness_include for a in ("--include", folder)],
           *(["--limit", str(cfg.eval.harness_limit)] if cfg.eval.harness_limit else [])]
    return cmd, out, loaded


def release(engine) -> str:
    """Free what `engine` holds (lomo_ds.methods.release), before the harness loads the whole model on
    rank 0's device beside it; the line the run says."""
    freed = release_engine(engine)
    shown = ", ".join(f"{n / 2**20:.1f} MiB on {kind}" for kind, n in sorted(freed.items())) or "nothing"
    return f"harness: the engine's memory released first ({shown})"


def describe_model(model: dict) -> str:
    return f"the model loaded in {model['dtype']} on {model['device']} ({model['params']:,} parameters)"


def check_tasks(cfg) -> None:
    """Raise HarnessError unless the harness's model fits this machine's accelerator (check_memory),
    lm-eval is installed and each of cfg.eval.harness_tasks is a lomo_ds task or a harness task
    under cfg.eval.harness_include (no model is loaded)."""
    check_memory(cfg, _accelerator_bytes())
    names = [t for t in cfg.eval.harness_tasks if t not in harness.scored_tasks()]
    harness.resolve_tasks(names, list(cfg.eval.harness_include))


def _accelerator_bytes() -> int | None:
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    return None if acc.device_name() == "cpu" else int(acc.total_memory())


def check_memory(cfg, device_bytes: int | None) -> None:
    """Raise HarnessError where the planner's harness phase (lomo_ds/planning/inference.py: the whole
    model in the training dtype + lm-eval's batch) exceeds `device_bytes`, rank 0's accelerator
    memory. On a CPU (None) nothing is refused, nor where the planner cannot read the model's
    architecture here (model.path not a local folder, no model.planner_size)."""
    if device_bytes is None:
        return
    try:
        model, run = planner.model_spec_for(cfg), planner.run_spec_for(cfg)
    except (ValueError, OSError):
        return
    why = inference.harness_refusal(model, run, inference.eval_spec_for(cfg), device_bytes)
    if why:
        raise harness.HarnessError(why)


def _default_config(task: str):
    # Only the data section matters here; the method needs no update settings.
    return load_run_config({"model": {"path": "unused"}, "train": {"method": "zero_shot"},
                            "data": {"task": task if task in harness.scored_tasks() else "builtin"}},
                           check_files=False)


def run_eval(args: argparse.Namespace) -> int:
    tasks = [t for t in args.tasks.split(",") if t]
    try:
        if not tasks:
            raise harness.HarnessError("--tasks: give one or more task names, separated by commas")
        overrides = parse_override_args(args.set)
        cfg = (load_run_config(args.config, overrides, check_files=False) if args.config
               else _default_config(tasks[0]))
        results, model = evaluate_model(args.model, tasks, cfg, args.include, args.batch_size, args.limit,
                                        args.device, args.dtype)
    except (ValueError, ConfigError) as e:  # HarnessError, DataError and a bad config: one line, no traceback
        print(f"lomo-ds eval: {e}", file=sys.stderr)
        return 2
    print(describe_model(model), flush=True)
    for task, metrics in results.items():
        shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k in ("acc", "acc_norm"))
        print(f"{task}: {shown} ({metrics.get('n', 0)} examples)", flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    if args.model_out:
        with open(args.model_out, "w") as f:
            json.dump(model, f)
    return 0


def add_eval(sub) -> None:
    p = sub.add_parser("eval", help="lm-evaluation-harness on an exported model (local tasks only)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a Hugging Face model directory (a run's hf_model export)")
    p.add_argument("--tasks", required=True,
                   help=f"comma-separated: lomo_ds tasks ({', '.join(harness.scored_tasks())}) or harness "
                        f"YAML tasks under --include")
    p.add_argument("--include", action="append", default=[], metavar="DIR",
                   help="a folder of harness YAML tasks (repeatable)")
    p.add_argument("--config", default=None,
                   help="a run config: its data section picks the lomo_ds tasks' examples (default: the task's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a --config key, as for training (e.g. data.eval_samples=40)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--limit", type=int, default=None, help="at most this many examples per task")
    p.add_argument("--device", default=None, help="default: cuda where there is one, else cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", *harness.DTYPES.values()],
                   help="the model's dtype (default auto: its config.json's, an export's training dtype)")
    p.add_argument("--out", default=None, help="write the results as JSON to this file")
    p.add_argument("--model-out", default=None,
                   help="write the model as the harness loaded it (dtype, parameters, device) as JSON to this file")
    p.set_defaults(func=run_eval)
