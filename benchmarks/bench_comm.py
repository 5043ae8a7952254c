"""Per-step communication and time: lomo_ds's reduce-scatter against the all-reduce approach of
the public LOMO code, and the cost of the second backward pass that norm clipping needs.

  python -m torch.distributed.run --nproc_per_node 2 -m benchmarks.bench_comm [--layers 4 --hidden 256]

Rank 0 prints a table: bytes each rank sends per step by collective, and the median step time
of several steps after warm-up, with ratios against the one-pass reduce-scatter run.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import lomo_ds
from benchmarks import common
from devkit.launch_local import as_deepspeed_launched
from lomo_ds.config.engine_sections import group_by_section
from lomo_ds.planning.planner import ModelSpec
from lomo_ds.profiling import count_comm
from lomo_ds.runtime.device import accelerator_device

# The collective the network carries (grad_reduction "reduce_scatter"), not the shared-memory
# path that CPU ranks on one node take by default: bytes on the wire are what is compared.
_RS = {"grad_reduction": "reduce_scatter"}
VARIANTS = {
    "reduce-scatter, 1 pass": _RS,
    "all-reduce, 1 pass (reference impl.)": {"grad_reduction": "all_reduce"},
    "reduce-scatter, norm clip, 2nd backward on retained graph": {**_RS, "clip_grad_norm": 1.0},
    "reduce-scatter, norm clip, 2nd forward + backward (reference impl.)": {**_RS, "clip_grad_norm": 1.0,
                                                                            "two_pass_mode": "recompute"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_run_shape_args(ap, layers=4, hidden=256, vocab=4000, seq=128, micro=2, steps=5, warmup=2)
    args = ap.parse_args()

    as_deepspeed_launched()
    lomo_ds.init_distributed()
    spec = ModelSpec("bench", hidden=args.hidden, layers=args.layers, intermediate=args.hidden * 8 // 3,
                     vocab=args.vocab, heads=max(1, args.hidden // 64))
    base = common.random_llama(spec, args.seq, "fp32")
    engines = {}
    for name, extra in VARIANTS.items():
        ds = {"train_micro_batch_size_per_gpu": args.micro,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0},
              **group_by_section({"lr": 1e-3, "bucket_size": 5_000_000, **extra})}
        engines[name] = lomo_ds.initialize(copy.deepcopy(base), ds)
    batches = common.random_batches(args.vocab, args.micro, args.seq, args.warmup + args.steps,
                                    seed=torch.distributed.get_rank(), device=accelerator_device())
    times = {name: [] for name in engines}
    counts = {}
    # Variants take turns step by step, so a slow spell on a shared machine hits them all alike.
    for step, batch in enumerate(batches):
        for name, engine in engines.items():
            torch.distributed.barrier()
            t0 = time.perf_counter()
            if step == args.warmup:
                with count_comm() as counted:
                    engine.train_step(batch)
                counts[name] = counted.as_dict()
            else:
                engine.train_step(batch)
            if step >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    rows = [(name, counts[name], statistics.median(times[name])) for name in engines]
    if torch.distributed.get_rank() == 0:
        params = sum(p.numel() for p in base.parameters())
        print(f"\n{params / 1e6:.1f}M parameters, {torch.distributed.get_world_size()} ranks, "
              f"seq {args.seq}, micro-batch {args.micro}; bytes sent per rank per step (ring model)")
        base_bytes, base_time = None, None
        print(f"{'variant':66s} {'all-gather MB':>13s} {'grad comm MB':>12s} {'step s':>7s} {'x bytes':>8s} "
              f"{'x time':>7s}")
        for name, counts, t in rows:
            grad = counts.get("reduce_scatter", {}).get("bytes", 0) + counts.get("all_reduce", {}).get("bytes", 0)
            ag = counts.get("all_gather_into_tensor", {}).get("bytes", 0)
            if base_bytes is None:
                base_bytes, base_time = ag + grad, t
            print(f"{name:66s} {ag / 1e6:13.2f} {grad / 1e6:12.2f} {t:7.3f} {(ag + grad) / base_bytes:8.2f} "
                  f"{t / base_time:7.2f}")


if __name__ == "__main__":
    main()
