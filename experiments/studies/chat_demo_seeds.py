"""`make demo-chat` on several seeds, LOMO and AdaLomo, one run at a time, resumable: a run whose
summary.json exists is not run again. Prints and writes (OUT/results.json) each run's zero-shot and
fine-tuned exact match, wall time, and the machine's load average before and after.

    python -m experiments.studies.chat_demo_seeds --out runs/chat_seeds            # LOMO then AdaLomo, seeds 42 43 44
    python -m experiments.studies.chat_demo_seeds --out runs/chat_seeds --only lomo --seeds 42

The command is the Makefile's demo-chat recipe (deepspeed, 2 ranks, ds_configs/cpu_chat.json) with
--set train.seed=SEED; AdaLomo adds --set lomo.optimizer=adalomo, which takes the config's AdaLomo
recipe (lomo.presets.adalomo: lr 0.001, the AdaLomo paper's range, as experiments/table3_hparams/cpu.yaml).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

# Each names its rule, so the config file's default (lomo.optimizer) decides neither.
OPTIMIZERS = {"lomo": ["--set", "lomo.optimizer=sgd"], "adalomo": ["--set", "lomo.optimizer=adalomo"]}


def load_average() -> float:
    return os.getloadavg()[0]


def run_one(out: str, name: str, seed: int, nproc: int) -> dict:
    run_dir = os.path.join(out, f"{name}_seed{seed}")
    summary = os.path.join(run_dir, "summary.json")
    done = os.path.join(run_dir, "demo.json")
    if os.path.exists(done):
        with open(done) as f:
            return json.load(f)
    os.makedirs(run_dir, exist_ok=True)
    cmd = ["deepspeed", "--num_gpus", str(nproc), "launch/train.py", "--config", "ds_configs/cpu_chat.json",
           "--set", f"train.seed={seed}", "--output-dir", run_dir, *OPTIMIZERS[name]]
    load_before, t0 = load_average(), time.perf_counter()
    with open(os.path.join(run_dir, "demo.log"), "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    seconds, load_after = time.perf_counter() - t0, load_average()
    if proc.returncode != 0 or not os.path.exists(summary):
        raise SystemExit(f"{name} seed {seed} failed ({proc.returncode}): see {run_dir}/demo.log")
    with open(summary) as f:
        s = json.load(f)
    result = {"optimizer": name, "seed": seed, "zero_shot_exact_match": s.get("zero_shot_exact_match"),
              "final_exact_match": s.get("final_exact_match"), "seconds": round(seconds, 1),
              "load_before": load_before, "load_after": load_after, "cpus": os.cpu_count()}
    with open(done, "w") as f:
        json.dump(result, f, indent=1)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44])
    ap.add_argument("--only", choices=list(OPTIMIZERS), default=None)
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args()
    results = []
    for name in [args.only] if args.only else list(OPTIMIZERS):
        for seed in args.seeds:
            r = run_one(args.out, name, seed, args.nproc)
            results.append(r)
            print(json.dumps(r), flush=True)
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump(results, f, indent=1)
    for name in sorted({r["optimizer"] for r in results}):
        rows = [r for r in results if r["optimizer"] == name]
        gains = [100 * (r["final_exact_match"] - r["zero_shot_exact_match"]) for r in rows]
        print(f"{name}: fine-tuned exact match mean {sum(r['final_exact_match'] for r in rows) / len(rows):.3f}, "
              f"min {min(r['final_exact_match'] for r in rows):.3f}; gain min {min(gains):+.1f} points over "
              f"{len(rows)} runs; time max {max(r['seconds'] for r in rows) / 60:.1f} min")


if __name__ == "__main__":
    main()
