"""Table 2: peak memory per rank and throughput (TGS, tokens per GPU per second) of AdamW, SGD and LOMO
under DeepSpeed ZeRO-3, across model sizes and rank counts.

    python3 -m experiments.table2 --cpu                                   # 2 ranks, random-init ~46M/~72M LLaMA, fp32
    python3 -m experiments.table2 --model-path 7b=/m/llama-7b --model-path 13b=/m/llama-13b ...   # GPU
    python3 -m experiments.table2 --model-root /m          # GPU: /m/llama-{7b,13b,30b,65b} (those present)

Each measured configuration is one multi-rank launch of this file as a worker
(`python -m torch.distributed.run --nproc_per_node N table2.py --worker ...`); with --cpu all the
configurations of one rank count share a launch (start-up costs more than the steps there).
Both modes use activation checkpointing (the paper's Table 2 fits LLaMA-7B with LOMO in 13.61 GB on one
GPU at sequence 1024, which needs it). GPU mode follows the paper: sequence 1024, batch 1, fp16 by default (--dtype),
the paper's GPU count for every row (LOMO 7B on 1 GPU, 13B on 2, 30B on 4, 65B on 8; AdamW and SGD
on 8), weights loaded partitioned (HfDeepSpeedConfig + from_pretrained: zero.Init). Rows the paper
reports as out of memory are predicted by lomo_ds.planning.planner and skipped unless --try-oom.

Memory: on a GPU `torch.cuda.max_memory_allocated` after the engine is built (the paper's "peak
allocated"); on a CPU the engines' tensor accounting (lomo_ds/methods: params + grads +
optimizer states + activations). The figure is the largest over the ranks.
TGS: common.measure_tgs: warm-up steps excluded, median of the timed steps, every step
ended by a barrier (the slowest rank's time); tokens = batch x seq per rank.
LOMO runs one backward pass per step (no norm clipping: the paper's value-clipping mode) unless
--lomo-clip-norm, or fp16, whose dynamic loss scale needs the first pass's overflow check (use
--dtype bf16 for one pass on GPUs); AdamW / SGD use DeepSpeed's own path with gradient_clipping 1.0.

Writes experiments/results/table2{,_cpu}.{csv,md,png} with the paper's figures beside ours, and
prints LOMO/AdamW and LOMO/SGD peak-memory ratios and the LOMO/SGD step-time ratio.
"""
from __future__ import annotations

import argparse
import csv
import gc
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks import common
from benchmarks.common import GIB, LLAMA_PARAMS_B, MIB
from lomo_ds.planning.planner import ModelSpec
from lomo_ds.runtime.device import accelerator_device

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

METHODS = ("adamw", "sgd", "lomo")

# Random-init LLaMA shapes for --cpu, picked with the planner (lomo_ds.planning.planner.estimate) so that
# model states dominate the accounted peak: a small vocabulary (2048) keeps the largest parameter
# (and with it LOMO's gradient bucket and ZeRO-3's gathered working set) ~1.3M elements, and
# activation checkpointing keeps activations to a few MiB at seq 128. fp32, because bf16 matmuls
# on this CPU run ~15x slower than fp32 ones (measured: 3.5 vs 56 GFLOP/s on one core).
CPU_SIZES = {
    "46m": ModelSpec("46m", hidden=512, layers=14, intermediate=1376, vocab=2048, heads=8),
    "72m": ModelSpec("72m", hidden=640, layers=14, intermediate=1728, vocab=2048, heads=10),
}
# The paper's Table 2 (8x RTX 3090, seq 1024, batch 1, ZeRO-3): (GPUs, memory GB, TGS).
PAPER_T2 = {
    ("7b", "adamw"): (8, 15.76, 67.37), ("7b", "sgd"): (8, 9.49, 69.66), ("7b", "lomo"): (1, 13.61, 769.92),
    ("13b", "sgd"): (8, 15.74, 32.51), ("13b", "lomo"): (2, 15.92, 66.19),
    ("30b", "lomo"): (4, 19.78, 11.61), ("65b", "lomo"): (8, 19.18, 4.93),
}
# Rows the paper reports as out of memory on 8 GPUs.
PAPER_OOM = {("13b", "adamw"), ("30b", "adamw"), ("65b", "adamw"), ("30b", "sgd"), ("65b", "sgd")}
GPU_SIZES = ("7b", "13b", "30b", "65b")


def paper_layout() -> list[tuple[str, str, int]]:
    """(size, method, GPUs) in the paper's row order, the out-of-memory rows on 8 GPUs."""
    rows = []
    for size in GPU_SIZES:
        for method in METHODS:
            if (size, method) in PAPER_T2:
                rows.append((size, method, PAPER_T2[(size, method)][0]))
            elif (size, method) in PAPER_OOM:
                rows.append((size, method, 8))
    return rows


# ----------------------------------------------------------------------------- configuration
def lomo_cfg(a, clip_norm: bool) -> dict:
    # The CPU bucket, 500k shard elements, is DeepSpeed's reduce_bucket_size (1M) at 2 ranks.
    return common.lomo_section(500_000 if a.cpu else 25_000_000, clip_norm)


def planner_estimate(size: str, method: str, world: int, a) -> float | None:
    """The planner's accounted bytes per rank for this row (None if it cannot say)."""
    try:
        from lomo_ds.planning import planner

        spec = CPU_SIZES.get(size) or planner.LLAMA[size]
        run = planner.run_spec(**dict(planner.run_overrides_from_ds(common.ds_config(a.cpu, a.dtype, a.batch)),
                                      seq=a.seq, batch=a.batch, checkpointing=a.ac, dtype=a.dtype,
                                      attn="eager" if a.cpu else "sdpa",  # the attention run_job builds
                                      lomo_bucket=lomo_cfg(a, False)["bucket_size"]))
        est = planner.estimate(spec, method, world, run)
        return est.accounted if a.cpu else est.total
    except Exception:  # the planner is a guide here, never a reason to fail
        return None


# ----------------------------------------------------------------------------- the worker
def make_engine(job: dict, a):
    method = job["method"]
    cfg = common.ds_config(a.cpu, a.dtype, a.batch)
    if job.get("path"):
        model = common.pretrained_llama(job["path"], a.dtype, cfg)
    else:
        model = common.random_llama(CPU_SIZES[job["size"]], a.seq, a.dtype, attn="eager" if a.cpu else "sdpa")
    n_params = common.count_params(model)
    eng = common.build_method_engine(model, cfg, "lomo" if method.startswith("lomo") else method,
                                     lomo_cfg(a, method == "lomo_clip" or a.lomo_clip_norm), a.ac)
    return eng, n_params, model.config.vocab_size


def run_group(jobs: list[dict], a) -> list[dict]:
    """Jobs of one model size on this launch's ranks, all engines alive at once.

    Timing: `a.rounds` rounds, each running common.measure_tgs for `a.steps` steps on
    every engine in turn (the first round after `a.warmup` warm-up steps), so a change in the
    machine's background load hits every method alike; the step time is the median of all timed
    steps. Memory: then one more step per engine with the accounting on (its sampling costs time,
    so it is kept out of the timed steps). With one job (GPU mode) this is a plain measure_tgs.
    """
    import torch

    built = []
    for job in jobs:
        eng, n_params, vocab = make_engine(job, a)
        batches = common.random_batches(vocab, a.batch, a.seq, 4, seed=100 + eng.rank, device=accelerator_device())
        built.append((job, eng, n_params, batches))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times: dict[int, list[float]] = {i: [] for i in range(len(built))}
    t0 = time.perf_counter()
    for rnd in range(a.rounds):
        for i, (_job, eng, _, batches) in enumerate(built):
            # rotate the order each round: no method always runs first (or right after another's memory)
            batches = batches[rnd % len(batches):] + batches[:rnd % len(batches)]
            res = common.measure_tgs(eng, batches, warmup=a.warmup if rnd == 0 else 0, steps=a.steps)
            times[i] += res["all_times_s"]
    out = []
    for i, (job, eng, n_params, batches) in enumerate(built):
        eng.enable_memory_tracking()
        eng.train_step(batches[0])
        mem = eng.memory_breakdown()
        cuda_peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
        peak = float(cuda_peak if cuda_peak is not None else mem["total"])
        vals = torch.tensor([peak, float(mem["peak_rss"]), *[float(mem[k]) for k in
                             ("params", "grads", "optimizer_states", "activations", "total")]], dtype=torch.float64)
        if eng.world > 1:
            vals = vals.to(accelerator_device())
            torch.distributed.all_reduce(vals, op=torch.distributed.ReduceOp.MAX, group=eng.group)
            vals = vals.cpu()
        step = statistics.median(times[i])
        tokens = a.batch * a.seq
        out.append({"size": job["size"], "method": job["method"], "world": eng.world, "n_params": n_params,
                    "seq": a.seq, "batch": a.batch, "dtype": a.dtype, "peak_bytes": vals[0].item(),
                    "peak_rss": vals[1].item(),
                    "memory_source": "cuda_max_memory_allocated" if cuda_peak is not None else "accounting",
                    **dict(zip(("params", "grads", "optimizer_states", "activations", "accounted_total"),
                               (v.item() for v in vals[2:]), strict=True)),
                    "step_time_s": step, "tgs": tokens / step, "all_times_s": times[i],
                    "seconds": time.perf_counter() - t0})
    rank = built[0][1].rank
    del built
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out if rank == 0 else []


def worker(a) -> int:
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    jobs = json.loads(a.jobs)
    groups: dict[str, list[dict]] = {}
    for job in jobs:
        groups.setdefault(job["size"], []).append(job)
    for group in groups.values():
        try:
            rows = run_group(group, a)
        except torch.OutOfMemoryError as e:  # the rows are recorded as out of memory
            rows = [{"size": j["size"], "method": j["method"], "oom": True, "error": str(e)[:300]} for j in group]
            gc.collect()
            torch.cuda.empty_cache()
        for r in rows:
            common.print_result(r)
    return 0


# ----------------------------------------------------------------------------- the launcher
def launch(jobs: list[dict], nproc: int, a, timeout: float) -> list[dict]:
    t0 = time.time()
    try:
        proc = common.run_ranks("experiments.table2", nproc, ["--worker", "--jobs", json.dumps(jobs), *passthrough(a)],
                                cpu=a.cpu, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        print(f"launch of {[j['method'] + '@' + j['size'] for j in jobs]} on {nproc} rank(s) timed out after "
              f"{timeout:.0f} s\n{(e.stderr or b'')[-2000:]}", file=sys.stderr)
        return []
    rows = common.results_of(proc.stdout)
    if proc.returncode != 0:
        oom = "out of memory" in (proc.stderr + proc.stdout).lower()
        print(f"launch on {nproc} rank(s) {'ran OUT OF MEMORY' if oom else 'FAILED'} (rc {proc.returncode}) after "
              f"{time.time() - t0:.0f} s\n{proc.stderr[-4000:]}", file=sys.stderr)
        done = {(r["size"], r["method"]) for r in rows}
        if oom:
            rows += [{"size": j["size"], "method": j["method"], "world": nproc, "oom": True}
                     for j in jobs if (j["size"], j["method"]) not in done]
    for r in rows:
        r.setdefault("world", nproc)
    return rows


def passthrough(a) -> list[str]:
    out = ["--seq", str(a.seq), "--batch", str(a.batch), "--dtype", a.dtype, "--warmup", str(a.warmup),
           "--steps", str(a.steps), "--rounds", str(a.rounds)]
    if a.cpu:
        out.append("--cpu")
    if a.ac:
        out.append("--ac")
    if a.lomo_clip_norm:
        out.append("--lomo-clip-norm")
    return out


def row_key(r: dict) -> tuple:
    sizes = list(CPU_SIZES) + list(GPU_SIZES)
    return (sizes.index(r["size"]) if r["size"] in sizes else 99,
            (list(METHODS) + ["lomo_clip"]).index(r["method"]), r.get("world", 0))


def write_outputs(rows: list[dict], a, tag: str) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    base = os.path.join(RESULTS, f"table2{tag}")
    unit, uname = (MIB, "MiB") if a.cpu else (GIB, "GiB")
    rows = sorted(rows, key=row_key)
    with open(base + ".csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "optimizer", "ranks", "n_params", f"memory_{uname}", "memory_source", f"planner_{uname}",
                    "tgs", "step_time_s", "params", "grads", "optimizer_states", "activations", "peak_rss_MiB",
                    "paper_gpus", "paper_memory_GB", "paper_tgs"])
        for r in rows:
            p = PAPER_T2.get((r["size"], r["method"]), ("", "", ""))
            if r.get("oom"):
                w.writerow([r["size"], r["method"], r.get("world", ""), "", "OOM", r.get("memory_source", ""), "",
                            "", "", "", "", "", "", "", *p])
                continue
            plan = r.get("planner_bytes")
            w.writerow([r["size"], r["method"], r["world"], r["n_params"], f"{r['peak_bytes'] / unit:.2f}",
                        r["memory_source"], f"{plan / unit:.2f}" if plan else "", f"{r['tgs']:.2f}",
                        f"{r['step_time_s']:.4f}", *[f"{r[k] / unit:.2f}" for k in
                                                     ("params", "grads", "optimizer_states", "activations")],
                        f"{r['peak_rss'] / MIB:.0f}", *p])
    text = markdown(rows, a)
    with open(base + ".md", "w") as f:
        f.write(text)
    print(text)
    try:
        plot(rows, base + ".png", a)
    except Exception as e:  # a missing matplotlib must not lose the table
        print(f"plot not written: {e}", file=sys.stderr)
    return text


def markdown(rows: list[dict], a) -> str:
    """The paper's layout (model | optimizer | GPUs | memory | TGS), ours first, the paper's in brackets."""
    unit, uname = (MIB, "MiB") if a.cpu else (GIB, "GiB")
    rows = sorted(rows, key=row_key)
    if a.cpu:
        head = (f"# Table 2 (CPU): random-init LLaMA, seq {a.seq}, batch {a.batch}, {a.dtype}, ZeRO-3, "
                f"AC {'on' if a.ac else 'off'}")
        note = (f"Memory: peak per rank in {uname} (tensor accounting, lomo_ds/methods; the planner's "
                f"prediction beside it). TGS: tokens per rank per second, median of {a.steps * a.rounds} steps after "
                f"{a.warmup} warm-up, the methods taking turns step by step. The paper's figures (LLaMA-7B..65B on "
                "RTX 3090s, GB) are below for the layout.")
    else:
        head = f"# Table 2: LLaMA, seq {a.seq}, batch {a.batch}, {a.dtype}, ZeRO-3, AC {'on' if a.ac else 'off'}"
        note = (f"Memory: peak allocated per GPU ({uname}, torch.cuda.max_memory_allocated). TGS: tokens per GPU "
                f"per second, median of {a.steps * a.rounds} steps after {a.warmup} warm-up. The paper's in "
                "brackets (GB, TGS).")
    lines = [head, "", note, "",
             "| model | optimizer | GPUs | memory | TGS | step time s | planner |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        p = PAPER_T2.get((r["size"], r["method"]))
        name = f"{r['size']} ({r['n_params'] / 1e6:.1f}M)" if a.cpu and "n_params" in r else r["size"]
        if r.get("oom"):
            paper = " [OOM]" if (r["size"], r["method"]) in PAPER_OOM else (f" [{p[1]:.2f}]" if p else "")
            why = "OOM (planner)" if r.get("predicted") else "OOM"
            lines.append(f"| {name} | {label(r['method'])} | {r.get('world', '')} | {why}{paper} | - | - | - |")
            continue
        mem = f"{r['peak_bytes'] / unit:.2f}" + (f" [{p[1]:.2f}]" if p and not a.cpu else "")
        tgs = f"{r['tgs']:.2f}" + (f" [{p[2]:.2f}]" if p and not a.cpu else "")
        gpus = f"{r['world']}" + (f" [{p[0]}]" if p and not a.cpu and p[0] != r["world"] else "")
        plan = r.get("planner_bytes")
        lines.append(f"| {name} | {label(r['method'])} | {gpus} | {mem} | {tgs} | {r['step_time_s']:.3f} | "
                     f"{plan / unit:.2f} |" if plan else
                     f"| {name} | {label(r['method'])} | {gpus} | {mem} | {tgs} | {r['step_time_s']:.3f} | - |")
    if a.cpu:
        lines += ["", "The paper's Table 2 (8x RTX 3090, seq 1024, batch 1):", "",
                  "| model | optimizer | GPUs | memory GB | TGS |", "|---|---|---|---|---|"]
        for size, method, gpus in paper_layout():
            p = PAPER_T2.get((size, method))
            lines.append(f"| {size} | {label(method)} | {gpus} | {p[1]:.2f} | {p[2]:.2f} |" if p else
                         f"| {size} | {label(method)} | {gpus} | OOM | - |")
    lines += ["", *ratio_lines(rows)]
    return "\n".join(lines) + "\n"


def label(method: str) -> str:
    names = {"adamw": "AdamW", "sgd": "SGD", "lomo": "LOMO", "lomo_clip": "LOMO (norm clip, 2 passes)"}
    return names.get(method, method)


def ratios(rows: list[dict]) -> list[dict]:
    """Per (size, ranks) where AdamW / SGD / LOMO all ran: the headline ratios."""
    by = {(r["size"], r["method"], r.get("world")): r for r in rows if not r.get("oom")}
    out = []
    for (size, method, world), lomo in sorted(by.items(), key=lambda kv: row_key(kv[1])):
        if method != "lomo":
            continue
        ad, sg = by.get((size, "adamw", world)), by.get((size, "sgd", world))
        out.append({"size": size, "world": world,
                    "mem_lomo_over_adamw": lomo["peak_bytes"] / ad["peak_bytes"] if ad else None,
                    "mem_lomo_over_sgd": lomo["peak_bytes"] / sg["peak_bytes"] if sg else None,
                    "time_lomo_over_sgd": lomo["step_time_s"] / sg["step_time_s"] if sg else None,
                    "time_lomo_over_adamw": lomo["step_time_s"] / ad["step_time_s"] if ad else None})
    return out


def ratio_lines(rows: list[dict]) -> list[str]:
    lines = []
    for q in ratios(rows):
        parts = []
        for key, name in (("mem_lomo_over_adamw", "LOMO peak / AdamW peak"),
                          ("mem_lomo_over_sgd", "LOMO peak / SGD peak"),
                          ("time_lomo_over_sgd", "LOMO step time / SGD step time"),
                          ("time_lomo_over_adamw", "LOMO step time / AdamW step time")):
            if q[key] is not None:
                parts.append(f"{name} = {q[key]:.3f}")
        if parts:
            lines.append(f"{q['size']}, {q['world']} rank(s): " + "; ".join(parts))
    return lines


def plot(rows: list[dict], path: str, a) -> None:
    plt = common.pyplot()

    unit, uname = (MIB, "MiB") if a.cpu else (GIB, "GiB")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"adamw": "#C44E52", "sgd": "#DD8452", "lomo": "#4C72B0", "lomo_clip": "#8172B2"}
    ok = [r for r in rows if not r.get("oom")]
    for method in sorted({r["method"] for r in ok}, key=lambda m: (list(METHODS) + ["lomo_clip"]).index(m)):
        for world in sorted({r["world"] for r in ok if r["method"] == method}):
            pts = sorted((r["n_params"] / (1e6 if a.cpu else 1e9), r) for r in ok
                         if r["method"] == method and r["world"] == world)
            xs = [x for x, _ in pts]
            axes[0].plot(xs, [r["tgs"] for _, r in pts], "o-", color=colors.get(method),
                         label=f"{label(method)}, {world} rank(s)")
            axes[1].plot(xs, [r["peak_bytes"] / unit for _, r in pts], "o-", color=colors.get(method),
                         label=f"{label(method)}, {world} rank(s)")
    if not a.cpu:
        for method in METHODS:
            pts = [(PAPER_T2[(s, method)], s) for s in GPU_SIZES if (s, method) in PAPER_T2]
            if pts:
                xs = [LLAMA_PARAMS_B[s] for _, s in pts]
                for ax, col in ((axes[0], 2), (axes[1], 1)):
                    ax.plot(xs, [p[col] for p, _ in pts], "x--", color=colors[method], alpha=0.6,
                            label=f"paper {label(method)}")
    xl = "parameters (M)" if a.cpu else "parameters (B)"
    axes[0].set(xlabel=xl, ylabel="TGS (tokens / rank / s)", title="Throughput vs model size")
    axes[1].set(xlabel=xl, ylabel=f"peak memory per rank ({uname})", title="Memory vs model size")
    if not a.cpu:
        axes[0].set_yscale("log")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    model = "CPU, random-init LLaMA" if a.cpu else "LLaMA"
    common.save_figure(fig, path, f"Table 2: {model}, seq {a.seq}, batch {a.batch}, {a.dtype}")


# ----------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="2 ranks, random-init ~46M/~72M LLaMA, fp32, on the CPU")
    ap.add_argument("--model-path", action="append", metavar="[SIZE=]PATH",
                    help="LLaMA HF folder (GPU mode); repeat for several sizes, e.g. 13b=/m/llama-13b")
    ap.add_argument("--model-root", default=None, help="folder holding llama-7b, llama-13b, ... (GPU mode)")
    ap.add_argument("--sizes", default=None, help="comma list; default: 46m,72m (--cpu) or every size given")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma list of adamw,sgd,lomo,lomo_clip")
    ap.add_argument("--ranks", default=None,
                    help="comma list of rank counts (--cpu, default 2); GPU default: the paper's count per row")
    ap.add_argument("--gpus", type=int, default=None, help="GPU mode: run every row on this many GPUs instead")
    ap.add_argument("--try-oom", action="store_true", help="GPU mode: also run the rows the paper reports as OOM")
    ap.add_argument("--seq", type=int, default=None, help="default 1024 (GPU), 128 (--cpu)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default=None,
                    help="default fp16 (GPU, the paper's), fp32 (--cpu: bf16 matmuls are ~15x slower on this CPU)")
    ap.add_argument("--ac", action="store_true", default=None,
                    help="activation checkpointing (default on, as the paper's Table 2)")
    ap.add_argument("--no-ac", dest="ac", action="store_false")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps excluded (default 2 GPU, 1 CPU)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per round (default 5 GPU, 1 CPU)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="rounds of timed steps, the methods of one launch taking turns (default 1 GPU, 4 CPU)")
    ap.add_argument("--lomo-clip-norm", action="store_true",
                    help="LOMO with norm clipping 1.0 (two backward passes) instead of one pass")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per launch")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--jobs", default=None, help=argparse.SUPPRESS)
    return ap


def finish_args(a, ap) -> None:
    a.seq = a.seq or (128 if a.cpu else 1024)
    a.dtype = a.dtype or ("fp32" if a.cpu else "fp16")
    if a.ac is None:
        a.ac = True
    a.warmup = a.warmup if a.warmup is not None else (1 if a.cpu else 2)
    a.steps = a.steps or (1 if a.cpu else 5)
    a.rounds = a.rounds or (4 if a.cpu else 1)


def main(argv=None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    finish_args(a, ap)
    if a.worker:
        return worker(a)
    if not a.cpu and not (a.model_path or a.model_root):
        ap.error("give --cpu, or --model-path / --model-root (GPU)")
    methods = [m for m in a.methods.split(",") if m]
    rows: list[dict] = []
    t_all = time.time()
    if a.cpu:
        sizes = (a.sizes or ",".join(CPU_SIZES)).split(",")
        for nproc in [int(x) for x in (a.ranks or "2").split(",")]:
            jobs = [{"size": s, "method": m} for s in sizes for m in methods]
            got = launch(jobs, nproc, a, a.timeout or 900)
            for r in got:
                print(f"{r['size']:4s} {r['method']:9s} {nproc} ranks: "
                      + ("OOM" if r.get("oom") else
                         f"peak {r['peak_bytes'] / MIB:8.1f} MiB, step {r['step_time_s']:.3f} s, "
                         f"TGS {r['tgs']:.1f}, steps {[round(t, 3) for t in r['all_times_s']]}"), flush=True)
            rows += got
    else:
        import torch

        from lomo_ds.planning import planner

        paths = planner.llama_model_paths(a.model_path, a.model_root)
        sizes = a.sizes.split(",") if a.sizes else [s for s in GPU_SIZES if s in paths]
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        for size, method, gpus in paper_layout():
            if size not in sizes or size not in paths or method not in methods:
                continue
            gpus = a.gpus or gpus
            if gpus > have:
                print(f"{size} {method}: needs {gpus} GPUs, {have} visible; skipped", file=sys.stderr)
                continue
            if (size, method) in PAPER_OOM and not a.try_oom:
                rows.append({"size": size, "method": method, "world": gpus, "oom": True, "predicted": True})
                continue
            got = launch([{"size": size, "method": method, "path": paths[size]}], gpus, a, a.timeout or 3600)
            for r in got:
                print(f"{size} {method} {gpus} GPUs: " + ("OOM" if r.get("oom") else
                      f"peak {r['peak_bytes'] / GIB:.2f} GiB, TGS {r['tgs']:.2f}"), flush=True)
            rows += got
        if "lomo_clip" in methods:
            for size in sizes:
                if size in paths and (size, "lomo") in PAPER_T2:
                    rows += launch([{"size": size, "method": "lomo_clip", "path": paths[size]}],
                                   a.gpus or PAPER_T2[(size, "lomo")][0], a, a.timeout or 3600)
    for r in rows:
        if not r.get("oom"):
            r["planner_bytes"] = planner_estimate(r["size"], "lomo" if r["method"] == "lomo_clip" else r["method"],
                                                  r["world"], a)
    if not any(not r.get("oom") for r in rows):
        print("no configuration ran", file=sys.stderr)
        return 1
    write_outputs(rows, a, "_cpu" if a.cpu else "")
    with open(os.path.join(RESULTS, f"table2{'_cpu' if a.cpu else ''}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"total {time.time() - t_all:.0f} s")
    return check(rows, a)


def check(rows: list[dict], a) -> int:
    """The acceptance figures: LOMO/AdamW <= 0.2, LOMO/SGD <= 0.5 (peak memory), LOMO/SGD step time <= 1."""
    bad = []
    for q in ratios(rows):
        if q["mem_lomo_over_adamw"] is not None and q["mem_lomo_over_adamw"] > 0.2:
            bad.append(f"{q['size']}/{q['world']}: LOMO/AdamW memory {q['mem_lomo_over_adamw']:.3f} > 0.2")
        if q["mem_lomo_over_sgd"] is not None and q["mem_lomo_over_sgd"] > 0.5:
            bad.append(f"{q['size']}/{q['world']}: LOMO/SGD memory {q['mem_lomo_over_sgd']:.3f} > 0.5")
        if q["time_lomo_over_sgd"] is not None and q["time_lomo_over_sgd"] > 1.0:
            bad.append(f"{q['size']}/{q['world']}: LOMO/SGD step time {q['time_lomo_over_sgd']:.3f} > 1.0")
    for b in bad:
        print("CHECK FAILED: " + b, file=sys.stderr)
    return 0 if (not bad or not a.cpu) else 3


if __name__ == "__main__":
    sys.exit(main())
