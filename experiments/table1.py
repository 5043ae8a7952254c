"""Table 1: memory breakdown (params / gradients / optimizer states / activations / total) of AdamW,
SGD and LOMO, with and without activation checkpointing, on one rank.

    python3 -m experiments.table1 --cpu                              # random-init ~40M LLaMA, bf16, CPU
    python3 -m experiments.table1 --model-path /path/to/llama-7b     # the paper's setting (GPU)

Each configuration runs in its own process (one rank) so that nothing of one is left in the next.
Accounting: lomo_ds/methods (tensor accounting on a CPU, the CUDA allocator's peak beside it
on a GPU). Writes experiments/results/table1{,_cpu}.{csv,md,png}, with the paper's figures beside ours.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import time

from benchmarks import common
from benchmarks.common import GIB, MIB
from lomo_ds.planning.planner import ModelSpec
from lomo_ds.runtime.device import accelerator_device

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# Built-in random-init LLaMA shapes for --cpu (vocab 8192 so the embedding does not dominate).
CPU_SIZES = {
    "20m": ModelSpec("20m", hidden=384, layers=8, intermediate=1024, vocab=8192, heads=6),
    "40m": ModelSpec("40m", hidden=512, layers=10, intermediate=1376, vocab=8192, heads=8),
    "70m": ModelSpec("70m", hidden=640, layers=12, intermediate=1728, vocab=8192, heads=10),
}
# Paper Table 1 (GB): LLaMA-7B, seq 512, batch 8, one GPU.
PAPER_T1 = {
    ("adamw", False): (12.55, 12.55, 75.31, 45.61, 147.02), ("adamw", True): (12.55, 12.55, 75.31, 1.79, 102.20),
    ("sgd", False): (12.55, 12.55, 25.10, 45.61, 96.81), ("sgd", True): (12.55, 12.55, 25.10, 1.79, 51.99),
    ("lomo", False): (12.55, 0.24, 0.00, 45.61, 59.40), ("lomo", True): (12.55, 0.24, 0.00, 1.79, 14.58),
}
METHODS = ("adamw", "sgd", "lomo")
CATS = ("params", "grads", "optimizer_states", "activations", "total")


# LOMO's gradient bucket: scaled to the small models on a CPU, DeepSpeed's reduce bucket on GPUs.
# Norm clipping is left off: with reentrant activation checkpointing the engine's two-pass
# (retain_graph) backward did not finish on the CPU (reported to the engine owner).
def lomo_bucket(args) -> int:
    return 1_000_000 if args.cpu else 25_000_000


def run_one(args) -> dict:
    """One configuration in this process (one rank): two steps, then the breakdown."""
    import torch

    ds_cfg = common.ds_config(args.cpu, args.dtype, args.batch)
    if args.model_path:
        model = common.pretrained_llama(args.model_path, args.dtype, ds_cfg)
    else:
        model = common.random_llama(CPU_SIZES[args.size], args.seq, args.dtype, attn="eager" if args.cpu else "sdpa")
    n_params = common.count_params(model)
    eng = common.build_method_engine(model, ds_cfg, args.one, common.lomo_section(lomo_bucket(args)), args.ac)
    eng.enable_memory_tracking()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for b in common.random_batches(model.config.vocab_size, args.batch, args.seq, 2, seed=100 + eng.rank,
                                   device=accelerator_device()):
        out = eng.train_step(b)
    mem = eng.memory_breakdown()
    return {"method": args.one, "ac": args.ac, "n_params": n_params, "world": eng.world, "loss": out["loss"],
            "seconds": time.perf_counter() - t0, **mem}


def passthrough(args) -> list[str]:
    out = ["--seq", str(args.seq), "--batch", str(args.batch), "--dtype", args.dtype, "--size", args.size]
    if args.cpu:
        out.append("--cpu")
    if args.model_path:
        out += ["--model-path", args.model_path]
    return out


def fmt(x: float, unit: float) -> str:
    return f"{x / unit:.2f}"


def write_outputs(rows: list[dict], args, tag: str) -> None:
    os.makedirs(RESULTS, exist_ok=True)
    unit, uname = (MIB, "MiB") if args.cpu else (GIB, "GiB")
    base = os.path.join(RESULTS, f"table1{tag}")
    with open(base + ".csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["optimizer", "AC", *[f"{c}_{uname}" for c in CATS], "peak_rss_MiB", "cuda_peak_GiB",
                    *[f"paper_{c}_GB" for c in CATS]])
        for r in rows:
            w.writerow([r["method"], "yes" if r["ac"] else "no", *[fmt(r[c], unit) for c in CATS],
                        f"{r['peak_rss'] / MIB:.0f}", f"{r['cuda_peak'] / GIB:.2f}" if "cuda_peak" in r else "",
                        *PAPER_T1[(r["method"], r["ac"])]])
    model = args.model_path or f"random-init LLaMA {args.size} ({rows[0]['n_params'] / 1e6:.1f}M params)"
    lines = [f"# Table 1: memory per rank, {model}, seq {args.seq}, batch {args.batch}, {args.dtype}, one rank",
             "", f"Ours in {uname} (tensor accounting, lomo_ds/methods); the paper's (LLaMA-7B, GB) in brackets.", "",
             "| optimizer | AC | params | gradients | optimizer states | activations | total | process peak RSS MiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = PAPER_T1[(r["method"], r["ac"])]
        cells = [f"{fmt(r[c], unit)} [{p[i]:.2f}]" for i, c in enumerate(CATS)]
        ac = "yes" if r["ac"] else "no"
        lines.append(f"| {r['method']} | {ac} | {' | '.join(cells)} | {r['peak_rss'] / MIB:.0f} |")
    by = {(r["method"], r["ac"]): r for r in rows}
    lines.append("")
    for ac in (False, True):
        if all((m, ac) in by for m in METHODS):
            lo, sg, ad = (by[(m, ac)]["total"] for m in METHODS[::-1])
            pl, ps, pa = (PAPER_T1[(m, ac)][4] for m in METHODS[::-1])
            lines.append(f"AC {'on' if ac else 'off'}: LOMO/AdamW total = {lo / ad:.3f} (paper {pl / pa:.3f}); "
                         f"LOMO/SGD = {lo / sg:.3f} (paper {pl / ps:.3f})")
    text = "\n".join(lines) + "\n"
    with open(base + ".md", "w") as f:
        f.write(text)
    print(text)
    plot(rows, base + ".png", unit, uname, model)


def plot(rows, path, unit, uname, model) -> None:
    plt = common.pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"params": "#4C72B0", "grads": "#DD8452", "optimizer_states": "#55A868", "activations": "#C44E52"}
    for ax, (title, getter, _scale, un) in zip(axes, [("ours: " + model, lambda r, c: r[c] / unit, unit, uname),
                                                  ("paper: LLaMA-7B", None, 1, "GB")], strict=True):
        labels = [f"{r['method']}\n{'AC' if r['ac'] else 'no AC'}" for r in rows]
        bottom = [0.0] * len(rows)
        for i, c in enumerate(("params", "grads", "optimizer_states", "activations")):
            vals = [getter(r, c) if getter else PAPER_T1[(r["method"], r["ac"])][i] for r in rows]
            ax.bar(labels, vals, bottom=bottom, label=c, color=colors[c])
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(un)
        ax.tick_params(axis="x", labelsize=8)
    axes[0].legend(fontsize=8)
    common.save_figure(fig, path, "Memory breakdown per rank (Table 1 / Figure 2)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="random-init small LLaMA on the CPU (bf16)")
    ap.add_argument("--model-path", default=None, help="LLaMA weights (HF folder); GPU mode")
    ap.add_argument("--size", default="40m", choices=sorted(CPU_SIZES), help="built-in size for --cpu")
    ap.add_argument("--seq", type=int, default=None, help="default: 512 (GPU, the paper's), 128 (--cpu)")
    ap.add_argument("--batch", type=int, default=None, help="default: 8 (GPU, the paper's), 2 (--cpu)")
    ap.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"], help="default: fp16 (GPU), bf16 (--cpu)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ac", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not args.cpu and not args.model_path:
        ap.error("give --model-path (GPU) or --cpu")
    args.seq = args.seq or (128 if args.cpu else 512)
    args.batch = args.batch or (2 if args.cpu else 8)
    args.dtype = args.dtype or ("bf16" if args.cpu else "fp16")
    if args.one:
        common.print_result(run_one(args))
        return 0
    rows = []
    for method in args.methods.split(","):
        for ac in (False, True):
            t0 = time.time()
            # Each configuration is its own one-rank launch, so that nothing of one is left in the next.
            proc = common.run_ranks("experiments.table1", 1, ["--one", method, *passthrough(args)]
                                    + (["--ac"] if ac else []), cpu=args.cpu, timeout=3600)
            got = common.results_of(proc.stdout)
            if proc.returncode != 0 or not got:
                oom = "out of memory" in proc.stderr.lower()
                print(f"{method} AC={ac}: {'OUT OF MEMORY' if oom else 'FAILED'} (rc {proc.returncode})\n"
                      f"{proc.stderr[-3000:]}", file=sys.stderr)
                continue
            r = got[-1]
            rows.append(r)
            print(f"{method:6s} AC={'yes' if ac else 'no ':3s} total {r['total'] / MIB:9.1f} MiB  "
                  f"({time.time() - t0:.0f} s)", flush=True)
    if not rows:
        return 1
    write_outputs(rows, args, "_cpu" if args.cpu else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
