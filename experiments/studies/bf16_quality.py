"""bf16 (stochastic rounding, the engine's GPU default) against fp32 on the quality benchmark's tasks,
with the recipes the project ships: AdaLomo (the sweep's best, lr 0.001 cosine) and plain LOMO (lr
0.2 cosine, ds_configs/cpu_default.json's `lomo.presets.sgd`). Each run is the quality benchmark's
stage-2 run (experiments/quality.py: same protocol, held-out split, same seeds), with `bf16.enabled`
added for the bf16 arm; a finished run (its table3_run.json) is kept, so the study resumes.

    python -m experiments.studies.bf16_quality --out runs/bf16_quality    # spelling, both rules, both dtypes
    python -m experiments.studies.bf16_quality --out runs/bf16_quality --tasks valence --only adalomo
    python -m experiments.studies.bf16_quality --out runs/bf16_quality --dtypes fp32 --seeds 42  # fp32 rerun
    python -m experiments.studies.bf16_quality --out runs/bf16_quality --dtypes bf16,int8 --zero-shot \
        --tasks valence,spelling,syllables    # each dtype's start: no training

--zero-shot evaluates each dtype's starting weights (int8: the quantized start) on the held-out split:
a one-step run of the AdaLomo recipe with `train.zero_shot_eval` on, whose zero-shot figures (the
accuracy and label_nll, the right candidate's negated mean log-probability per token) are read.
The starting weights do not depend on the seed (int8's conversion rounds to nearest): one run a task.

Prints, per rule and dtype, each seed's held-out accuracy with the mean and the minimum, and writes
OUT/results.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import yaml

from experiments import quality, table3

# The shipped recipe of each rule, as the sweep's yaml names it.
RECIPES = {
    "adalomo": {"lr": 1.0e-3, "warmup_ratio": 0.1, "clip_grad_norm": 1.0, "clip_grad_value": None,
                "schedule": "cosine"},
    "lomo": {"lr": 2.0e-1, "warmup_ratio": 0.1, "clip_grad_norm": 1.0, "clip_grad_value": None,
             "schedule": "cosine"},
}
# Added to the config file. int8: the bf16 run with 8-bit weight shards (memory.int8_shards).
DTYPES = {"fp32": {}, "bf16": {"bf16": {"enabled": True}},
          "int8": {"bf16": {"enabled": True}, "memory": {"int8_shards": True}}}


def config_for(config: str, dtype: str, out: str) -> str:
    """The sweep's config, or a copy of it in OUT with the dtype's section added (an override cannot add one)."""
    if not DTYPES[dtype]:
        return config
    with open(config) as f:
        cfg = {**json.load(f), **DTYPES[dtype]}
    path = os.path.join(os.path.abspath(out), f"config_{dtype}.json")
    os.makedirs(out, exist_ok=True)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)
    return path


def run_one(hp: dict, method: str, task: str, seed: int, dtype: str, out: str, timeout: float,
            zero_shot: bool = False) -> dict | None:
    steps = 1 if zero_shot else int(hp["shared"]["max_steps"]) * int(hp.get("step_multiple", {}).get(task, 1))
    run = quality.Run(2, method, quality.freeze(RECIPES[method]), task, seed, "heldout", steps)
    out_dir = os.path.join(out, dtype, "zero_shot" if zero_shot else "", run.name)
    nproc = int(hp.get("ranks", 2))
    config = config_for(os.path.join(quality.ROOT, hp["config"]), dtype, out)
    overrides = quality.overrides_of(run, hp, nproc, out_dir)
    if zero_shot:
        overrides["train.zero_shot_eval"] = True
    res = table3.finished_run(out_dir, config, overrides)
    if res is None or res.get("rc") != 0:
        res = table3.run_train(table3.train_program(config, overrides), nproc, True, out_dir, timeout)
        table3.record_run(out_dir, config, overrides, res)
        if res.get("rc") != 0:
            raise SystemExit(f"{out_dir}: failed (rc {res.get('rc')}), see its table3.log")
    acc = table3.accuracy_of("zero_shot" if zero_shot else method, res) if res.get("rc") == 0 else None
    nll = res.get("zero_shot_label_nll" if zero_shot else "final_label_nll")
    print(f"{'zero-shot' if zero_shot else method} {dtype} {task} seed {seed}: {acc} (label_nll {nll}; "
          f"{res.get('minutes', 0):.1f} min)", flush=True)
    return None if acc is None else {"accuracy": acc, "label_nll": nll, "minutes": res.get("minutes"),
                                     "first_loss": res.get("first_loss"), "last_loss": res.get("last_loss")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tasks", default="spelling", help="comma list of the sweep's tasks")
    ap.add_argument("--only", default="adalomo,lomo", help="comma list of rules")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--seeds", default=None, help="comma list (default the sweep's three)")
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--zero-shot", action="store_true", help="evaluate each dtype's start, no training")
    a = ap.parse_args()
    with open(quality.HPARAMS) as f:
        hp = yaml.safe_load(f)
    seeds = [int(x) for x in a.seeds.split(",")] if a.seeds else hp["shared"]["seeds"]
    if a.zero_shot:
        a.only, seeds = "adalomo", seeds[:1]
    results = os.path.join(a.out, "results.json")
    table: dict = {}
    for method in a.only.split(","):
        for dtype in a.dtypes.split(","):
            for task in a.tasks.split(","):
                for seed in seeds:
                    r = run_one(hp, method, task, seed, dtype, a.out, a.timeout, a.zero_shot)
                    table.setdefault(f"{'zero_shot' if a.zero_shot else method} {dtype} {task}", {})[seed] = r
    # Earlier invocations' rows are kept: each call adds or replaces its own.
    everything = {}
    if os.path.exists(results):
        with open(results) as f:
            everything = json.load(f)
    with open(results, "w") as f:
        json.dump({**everything, **{k: {str(s): r for s, r in v.items()} for k, v in table.items()}}, f, indent=1)
    for key, per_seed in table.items():
        accs = [r["accuracy"] for r in per_seed.values() if r is not None]
        if accs:
            print(f"{key}: mean {statistics.mean(accs):.1f} min {min(accs):.1f} "
                  f"({', '.join(f'{x:.1f}' for x in accs)}; {len(accs)}/{len(per_seed)} runs)")


if __name__ == "__main__":
    main()
