"""The GRPO example at equal steps: LOMO and AdaLomo (LomoGRPOTrainer) against TRL's own
GRPOTrainer with AdamW under DeepSpeed ZeRO-3, over seeds. Each run is examples/grpo_lomo.py on 2
CPU ranks; its held-out reward (greedy replies to the chat task's validation prompts, scored by the
example's verifiable reward) before and after training is read from its RESULT line. Prints, per
optimizer, the mean and the minimum over the seeds of the held-out reward after training, beside the
starting model's.

    python -m experiments.studies.grpo_seeds                                  # 3 seeds x 3 optimizers
    python -m experiments.studies.grpo_seeds --steps 8 --seeds 42 43 --optims lomo adamw
"""
from __future__ import annotations

import argparse
import json
import os
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(optim: str, seed: int, a) -> dict:
    from devkit.launch_local import run_local

    out = os.path.join(a.output_dir, f"{optim}_seed{seed}")
    argv = ["examples/grpo_lomo.py", "--optim", optim, "--seed", str(seed), "--max-steps", str(a.steps),
            "--eval-prompts", str(a.eval_prompts), "--max-completion", str(a.max_completion),
            "--output-dir", out]
    if optim in a.lr:
        argv += ["--lr", str(a.lr[optim])]
    t0 = time.perf_counter()
    proc = run_local(argv, 2, timeout=a.timeout, cwd=ROOT, env={"OMP_NUM_THREADS": "1"})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{optim} seed {seed} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return {**json.loads(lines[-1][len("RESULT "):]), "seconds": round(time.perf_counter() - t0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optims", nargs="+", default=["lomo", "adalomo", "adamw"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[42, 43, 44])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--eval-prompts", type=int, default=30)
    ap.add_argument("--max-completion", type=int, default=12)
    ap.add_argument("--lr-lomo", type=float, default=0.05)
    ap.add_argument("--lr-adalomo", type=float, default=0.001)
    ap.add_argument("--lr-adamw", type=float, default=1e-5)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--output-dir", default="runs/grpo_seeds")
    a = ap.parse_args()
    a.lr = {"lomo": a.lr_lomo, "adalomo": a.lr_adalomo, "adamw": a.lr_adamw}
    results = []
    for seed in a.seeds:
        for optim in a.optims:
            r = run(optim, seed, a)
            results.append(r)
            before, after = r["heldout_reward"]
            print(f"{optim:8s} seed {seed}: held-out reward {before:.3f} -> {after:.3f}, "
                  f"exact match {r['exact_match'][0]:.3f} -> {r['exact_match'][1]:.3f} ({r['seconds']} s)", flush=True)
    os.makedirs(a.output_dir, exist_ok=True)
    with open(os.path.join(a.output_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"\n{a.steps} steps, {len(a.seeds)} seeds, {results[0]['prompts']} held-out prompts")
    print("| optimizer | lr | held-out reward at start | after: mean | after: min | exact match after: mean |")
    print("|---|---|---|---|---|---|")
    for optim in a.optims:
        rs = [r for r in results if r["optim"] == optim]
        after = [r["heldout_reward"][1] for r in rs]
        em = [r["exact_match"][1] for r in rs]
        print(f"| {optim} | {a.lr[optim]:g} | {rs[0]['heldout_reward'][0]:.3f} | {sum(after) / len(after):.3f} | "
              f"{min(after):.3f} | {sum(em) / len(em):.3f} |")


if __name__ == "__main__":
    main()
