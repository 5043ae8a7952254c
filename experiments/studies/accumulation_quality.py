"""Gradient accumulation's effect on quality: a demo's recipe at K = 1 and K = 4 micro-batches per
step, at equal optimizer steps, over 3 seeds, on a task with headroom.

    python -m experiments.studies.accumulation_quality     # make demo-chat's recipe, K 1 and 4, seeds 42-44
    python -m experiments.studies.accumulation_quality --recipe default --task spelling --steps 35

Recipes: `chat` (default) is `make demo-chat`'s (ds_configs/cpu_chat.json, 20 steps), scored by the
exact match of greedy replies to all 100 validation prompts: it takes the built-in model from 0 to
70-77% (docs/results.md), so both directions have room. `default` is `make demo`'s
(ds_configs/cpu_default.json, 35 steps) on a classification task (--task), scored on --eval-samples
validation examples; the built-in task is saturated there (on the retired NumCompare task, 35 steps
of it stayed at chance for K = 1 and K = 4 alike, seed 42: 49.0 and 49.4%).

Resumable: each (K, seed) run is the training program in a folder of its own under --out, recorded
as experiments/table3.py records its runs; a finished run with the same overrides is not run again,
so an interrupted sweep continues where it stopped (a run cut short starts over). After every run it
writes results.md: the score per seed, mean and minimum over the seeds that finished, for each K.
At K = 4 a step sees 4 times the examples, so equal steps cost 4 times the forward and backward work.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from experiments import table3

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# recipe: (its config, the summary.json field scored, the demo's step count)
RECIPES = {"chat": (os.path.join(ROOT, "ds_configs", "cpu_chat.json"), "final_exact_match", 20),
           "default": (os.path.join(ROOT, "ds_configs", "cpu_default.json"), "final_accuracy", 35)}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", choices=list(RECIPES), default="chat")
    ap.add_argument("--task", default="spelling", help="data.task of the default recipe")
    ap.add_argument("--accumulation", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44])
    ap.add_argument("--optimizer", choices=("sgd", "adalomo"), default="sgd",
                    help="lomo.optimizer: the update rule, named so that the config's default does not decide it")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps of every run (default: the demo's)")
    ap.add_argument("--eval-samples", type=int, default=None,
                    help="validation examples scored per run (default: all 100 prompts for chat, 500 otherwise)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(ROOT, "experiments", "studies", "results", "accumulation_quality"))
    ap.add_argument("--timeout", type=float, default=4 * 3600, help="seconds one run may take")
    args = ap.parse_args(argv)
    args.config, args.metric, demo_steps = RECIPES[args.recipe]
    args.steps = args.steps or demo_steps
    args.eval_samples = args.eval_samples or (100 if args.recipe == "chat" else 500)
    return args


def overrides(args, k: int, seed: int, out_dir: str) -> dict:
    """The demo's config with the seed, the step count and K (DeepSpeed's key, as a user sets it)."""
    # Every validation example there is (a 2-point difference is then a few examples, not one), and
    # no zero-shot evaluation: the model before training is the same for every run. Epochs are not
    # what ends a run (K = 4 needs more than one of the chat task's), max_steps is.
    o = {"train.seed": seed, "train.max_steps": args.steps, "train.epochs": 100,
         "gradient_accumulation_steps": k, "data.eval_samples": args.eval_samples, "train.zero_shot_eval": False,
         "output.dir": out_dir, "output.export_hf": False, "lomo.optimizer": args.optimizer}
    if args.recipe == "chat":
        o["eval.generate_samples"] = args.eval_samples
    else:
        o["data.task"] = args.task
    return o


def train(args, k: int, seed: int) -> dict:
    """One run of the training program, or the recorded result of the same run (the sweep resumes)."""
    out_dir = os.path.join(args.out, f"k{k}_seed{seed}")
    o = overrides(args, k, seed, out_dir)
    done = table3.finished_run(out_dir, args.config, o)
    if done is not None:
        return done
    res = table3.run_train(table3.train_program(args.config, o), args.nproc, True, out_dir, args.timeout)
    table3.record_run(out_dir, args.config, o, res)
    return res


def report(args, results: dict) -> str:
    with open(args.config) as f:
        micro = json.load(f)["train_micro_batch_size_per_gpu"]
    task = "builtin_chat" if args.recipe == "chat" else args.task
    lines = [f"# Gradient accumulation at equal optimizer steps: task {task}, {args.steps} steps, the recipe of "
             f"{os.path.relpath(args.config, ROOT)}, {args.nproc} ranks, {args.metric} on {args.eval_samples} "
             "validation examples", "",
             f"| K | global batch | runs | {args.metric} % mean | min | per seed | minutes |",
             "|---|---|---|---|---|---|---|"]
    for k in args.accumulation:
        done = {seed: r for seed, r in results.get(k, {}).items() if r.get(args.metric) is not None}
        acc = [100 * r[args.metric] for r in done.values()]
        cells = " ".join(f"{seed}: {100 * r[args.metric]:.1f}" for seed, r in done.items())
        stat = f"{statistics.mean(acc):.1f} | {min(acc):.1f}" if acc else "- | -"
        minutes = " ".join(f"{r['minutes']:.0f}" for r in done.values())
        lines.append(f"| {k} | {micro * args.nproc * k} | {len(acc)} | {stat} | {cells} | {minutes} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    results: dict = {}
    for seed in args.seeds:  # seed-major: a partial sweep has both K for the seeds it finished
        for k in args.accumulation:
            results.setdefault(k, {})[seed] = train(args, k, seed)
            table = report(args, results)
            with open(os.path.join(args.out, "results.md"), "w") as f:
                f.write(table)
            print(table, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
