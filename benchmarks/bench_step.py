"""Step time of LOMO against its floor and against DeepSpeed ZeRO-3 SGD, and where LOMO's extra time goes.

  OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 2 -m benchmarks.bench_step [--steps 8]
  python -m torch.distributed.run --nproc_per_node N -m benchmarks.bench_step --preset gpu --offload   # GPUs
  ... -m benchmarks.bench_step --preset tiny          # seconds on a CPU: proves it runs (tests/comm/test_buckets.py)

--preset sets the model and run sizes (cpu: the default on a machine without CUDA, gpu: a 0.2B
LLaMA in bf16, tiny); any size flag given wins over it.

Engines, each on its own copy of the same model, take turns step by step on the same batches
(a slow spell on a shared machine hits them all alike); rank 0 prints the median step time and
the median of the per-round ratios to the floor:

  floor          the same model's ZeRO-3 forward + backward, every gradient discarded on arrival:
                 no reduction, no update. No fused optimizer can be faster.
  lomo           one backward, buckets reduce-scattered while the backward goes on, fused update;
                 the default transport (comm.grad_reduction "auto": through shared memory for CPU
                 ranks on one node, else the backend's reduce-scatter)
  lomo clipped   norm clipping: a measuring backward, then the updating one on the retained graph
  lomo rs        lomo with grad_reduction "reduce_scatter": the overlapped reduce-scatter (gloo's
                 async work on a CPU), the path of GPUs and of CPU ranks on several nodes
  deepspeed sgd  DeepSpeed ZeRO-3's own optimizer path with torch.optim.SGD

--offload adds two engines with the shards in host memory (zero_optimization.offload_param cpu,
pinned on GPUs): "floor offload", the floor's forward + backward gathering from the host, and
"lomo offload", LOMO updating the shards there. The summary gives offload against no offload and
LOMO offload against its own floor.

The summary flags, loudly, any LOMO engine of one backward (lomo, lomo rs; lomo offload against
floor offload) above 1.10x its floor: the extra a fused update may cost. Above it, look for host
syncs in the backward or an update that does not overlap with it. --fail-above-flag: rank 0 then
exits with status 3, and the launch fails (tests/gpu/run_all.sh passes it: a regression fails the
GPU suite).

--accumulation K: every engine's step is K micro-batches (LOMO's shard accumulator, DeepSpeed's own
accumulation) and the floor's is K floor micro-steps; the report adds clipped / unclipped per round
(at K > 1 norm clipping is one pass over the accumulated shards, not a second backward).

and the breakdown of LOMO's time spent in its own code, from the engine's timers: packing the
rank-major payload, the non-finite flag, starting the reduce-scatter (posting it, in shared
memory), waiting for it during the backward and at its end (in shared memory: summing this rank's
row of every payload), the update arithmetic, and the rest of the hook and end-of-backward code
(bookkeeping).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

import lomo_ds
from benchmarks import common
from devkit.floor import FloorEngine
from devkit.launch_local import as_deepspeed_launched
from lomo_ds.methods.deepspeed_optim import DeepSpeedOptimizerEngine
from lomo_ds.planning.planner import ModelSpec
from lomo_ds.profiling import attach_timers
from lomo_ds.runtime.host_malloc import keep_freed_memory

LR = 1e-3
BREAKDOWN = ("pack", "flag", "launch", "wait", "wait at end", "update")
FLAG_ABOVE = 1.10  # a LOMO step of one backward above this many times its floor is flagged
FLAGGED_EXIT = 3  # the exit status of --fail-above-flag when an engine is flagged (1 and 2: Python's and argparse's)
# Each LOMO engine of one backward and the floor it is held to (the same forward + backward).
FLAGGED = {"lomo": "floor", "lomo rs": "floor", "lomo offload": "floor offload"}
OFFLOAD_ENGINES = ("floor offload", "lomo offload")
PRESETS = {
    "cpu": dict(layers=6, hidden=512, vocab=10_000, seq=128, micro=4, bucket_size=1_000_000, steps=8, warmup=2,
                dtype="fp32"),
    # A 0.2B LLaMA: big enough that the GPU, not the host, sets the pace of the floor.
    "gpu": dict(layers=12, hidden=1024, vocab=32_000, seq=512, micro=4, bucket_size=25_000_000, steps=10, warmup=3,
                dtype="bf16"),
    "tiny": dict(layers=1, hidden=64, vocab=128, seq=16, micro=1, bucket_size=2000, steps=2, warmup=1, dtype="fp32"),
}


def start_ranks() -> None:
    """The ranks as a training run starts them: DeepSpeed's environment, and on CPU ranks freed
    memory kept for the next step (as launch/train.py does), which every engine of the process shares."""
    from lomo_ds.runtime.device import accelerator_device

    as_deepspeed_launched()
    if accelerator_device().type == "cpu":
        keep_freed_memory()
    lomo_ds.init_distributed()


def bench_llama(layers: int, hidden: int, vocab: int, seq: int, dtype: str = "fp32"):
    spec = ModelSpec("bench", hidden=hidden, layers=layers, intermediate=hidden * 8 // 3, vocab=vocab,
                     heads=max(1, hidden // 64))
    return common.random_llama(spec, seq, dtype)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="model and run sizes (default: gpu where CUDA is, else cpu)")
    common.add_run_shape_args(ap)  # defaults from the preset
    ap.add_argument("--bucket-size", type=int, help="comm.bucket_size (elements per rank)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), help="the model's and the shards' dtype")
    ap.add_argument("--in-flight", type=int, default=1, help="reduce-scatters LOMO lets run at once")
    ap.add_argument("--accumulation", type=int, default=1, help="micro-batches per step (gradient_accumulation_steps)")
    ap.add_argument("--engines", default="floor,lomo,lomo clipped,lomo rs,deepspeed sgd",
                    help="comma-separated subset of the engines (the floor is always run)")
    ap.add_argument("--offload", action="store_true",
                    help="also the floor and LOMO with offload_param cpu (floor offload, lomo offload)")
    ap.add_argument("--fail-above-flag", action="store_true",
                    help=f"exit with status {FLAGGED_EXIT} when a LOMO engine is above {FLAG_ABOVE:.2f}x its floor")
    args = ap.parse_args(argv)
    args.preset = args.preset or ("gpu" if torch.cuda.is_available() else "cpu")
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def bench(args: argparse.Namespace):
    """Every engine on one model, taking turns step by step, on the ranks already started. Returns
    the model, each engine's step times, LOMO's time breakdowns, and the transport each LOMO
    engine's buckets came to."""
    from deepspeed.accelerator import get_accelerator

    from lomo_ds.runtime.device import accelerator_device

    device = accelerator_device()
    accelerator = get_accelerator()
    base = bench_llama(args.layers, args.hidden, args.vocab, args.seq, args.dtype)
    zero = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": args.accumulation,
            "zero_optimization": {"stage": 3}}
    if args.dtype == "bf16":
        zero["bf16"] = {"enabled": True}
    # Pinned host memory where there is a device to copy to and from without blocking.
    offloaded = {**zero, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu",
                                                                             "pin_memory": device.type != "cpu"}}}
    lomo = {"lomo": {"lr": LR}, "comm": {"bucket_size": args.bucket_size, "max_in_flight": args.in_flight},
            "train": {"accumulation_steps": args.accumulation}}
    clipped = {**lomo, "train": {**lomo["train"], "clip_grad_norm": 1.0}}
    reduce_scatter = {**lomo, "comm": {**lomo["comm"], "grad_reduction": "reduce_scatter"}}
    makers = {
        "lomo": lambda m: lomo_ds.initialize(m, {**zero, **lomo}),
        "lomo clipped": lambda m: lomo_ds.initialize(m, {**zero, **clipped}),
        "lomo rs": lambda m: lomo_ds.initialize(m, {**zero, **reduce_scatter}),
        "deepspeed sgd": lambda m: DeepSpeedOptimizerEngine(m, zero, "sgd", "sgd", lr=LR, clip=None, total_steps=0,
                                                            warmup_steps=0),
        "floor offload": lambda m: FloorEngine(m, offloaded),
        "lomo offload": lambda m: lomo_ds.initialize(m, {**offloaded, **lomo}),
    }
    wanted = args.engines.split(",") + (list(OFFLOAD_ENGINES) if args.offload else [])
    engines = {"floor": FloorEngine(copy.deepcopy(base), zero)}
    engines.update({name: make(copy.deepcopy(base)) for name, make in makers.items() if name in wanted})
    timed = {name: e for name, e in engines.items() if name.startswith("lomo")}
    for e in timed.values():
        attach_timers(e)

    g = torch.Generator(device="cpu").manual_seed(torch.distributed.get_rank())
    times = {name: [] for name in engines}
    times["floor backward"] = []  # the floor's backward alone
    times["floor forward"] = []
    parts = {name: [] for name in timed}
    for step in range(args.warmup + args.steps):
        # On the device already: the floor takes its batch as it is (LOMO's move is then a no-op).
        ids = [torch.randint(0, args.vocab, (args.micro, args.seq), generator=g, device="cpu").to(device)
               for _ in range(args.accumulation)]
        batches = [{"input_ids": i, "labels": i} for i in ids]
        for name, engine in engines.items():
            accelerator.synchronize()
            torch.distributed.barrier()
            t0 = time.perf_counter()
            for batch in batches:  # one optimizer step: K micro-batches (the floor: K floor micro-steps)
                engine.train_step(batch)
            # A step is done when its queued kernels are (on a GPU the host runs ahead), and a
            # data-parallel step when its slowest rank is: the floor, which never waits for another
            # rank in its backward, must not be timed on a rank that happened to be fast.
            accelerator.synchronize()
            torch.distributed.barrier()
            elapsed = time.perf_counter() - t0
            if name in timed:
                taken = engine.timers.take()
            if step >= args.warmup:
                times[name].append(elapsed)
                if name == "floor":
                    spans = engine.last_step_seconds()
                    times["floor backward"].append(spans["backward"])
                    times["floor forward"].append(spans["forward"])
                if name in timed:
                    parts[name].append(taken)
    torch.distributed.barrier()
    return base, times, parts, {name: e.buckets.route.value for name, e in timed.items()}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start_ranks()
    base, times, parts, transports = bench(args)
    rank = torch.distributed.get_rank()
    if rank == 0:
        report(args, base, torch.distributed.get_world_size(), times, parts, transports)
    torch.distributed.destroy_process_group()
    # Rank 0's times are the ones reported, so its verdict alone decides; a launcher fails the run
    # when any rank exits with an error.
    if args.fail_above_flag and rank == 0 and flagged(times):
        raise SystemExit(FLAGGED_EXIT)


def per_round(times: dict[str, list[float]], name: str, against: str) -> float:
    """The median over the rounds of `name`'s step time over `against`'s in the same round."""
    return statistics.median(t / f for t, f in zip(times[name], times[against], strict=True))


def held_to_floor(times: dict[str, list[float]]) -> dict[str, tuple[str, float]]:
    """Each flagged LOMO engine that ran: its floor and its per-round ratio to it."""
    return {name: (floor, per_round(times, name, floor)) for name, floor in FLAGGED.items()
            if name in times and floor in times}


def flagged(times: dict[str, list[float]]) -> dict[str, tuple[str, float]]:
    """The LOMO engines above FLAG_ABOVE x their floor."""
    return {name: held for name, held in held_to_floor(times).items() if held[1] > FLAG_ABOVE}


def summary(times: dict[str, list[float]]) -> list[str]:
    """LOMO against its floor, offload against none, and the flag: the lines that close the report."""
    lines = []
    held = held_to_floor(times)
    if held:
        lines.append(f"LOMO against its floor (limit {FLAG_ABOVE:.2f}x): " + ", ".join(
            f"{name} {ratio:.3f}x {floor}" for name, (floor, ratio) in held.items()))
    if all(name in times for name in ("lomo offload", "lomo", "floor offload")):
        lines.append(f"offload against none: lomo offload {per_round(times, 'lomo offload', 'lomo'):.3f}x lomo, "
                     f"floor offload {per_round(times, 'floor offload', 'floor'):.3f}x floor")
    over = flagged(times)
    if over:
        bar = "!" * 100
        lines += [bar, f"!!! LOMO ABOVE {FLAG_ABOVE:.2f}x ITS FLOOR: " + ", ".join(
            f"{name} {ratio:.3f}x {floor}" for name, (floor, ratio) in over.items()),
            "!!! look for host syncs in the backward or an update that does not overlap with it "
            "(the breakdown above)", bar]
    elif held:
        lines.append(f"LOMO within {FLAG_ABOVE:.2f}x its floor: OK")
    return lines


def report(args, base, world, times, parts, transports) -> None:
    n_params = sum(p.numel() for p in base.parameters())
    print(f"\n{n_params / 1e6:.1f}M-parameter LLaMA (hidden {args.hidden}, {args.layers} layers), {world} ranks, "
          f"micro-batch {args.micro} x {args.seq}, {args.accumulation} micro-batch(es) per step, {args.dtype}, "
          f"bucket {args.bucket_size:,} elements, "
          f"at most {args.in_flight} reduce-scatter(s) in flight, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; median of {args.steps} steps")
    floor = times["floor"]
    print(f"{'engine':16s} {'step s':>8s} {'x floor':>8s}   (x floor: median of the per-round ratios)")
    ratios = {}
    for name, ts in times.items():
        ratios[name] = statistics.median(t / f for t, f in zip(ts, floor, strict=True))
        print(f"{name:16s} {statistics.median(ts):8.3f} {ratios[name]:8.3f}")
    if "lomo" in ratios and "lomo clipped" in ratios:
        extra = ratios["lomo clipped"] - ratios["lomo"]
        print(f"norm clipping costs {extra:.3f} x floor over lomo; one backward is "
              f"{ratios['floor backward']:.3f} x floor")
        clipped = statistics.median(c / u for c, u in zip(times["lomo clipped"], times["lomo"], strict=True))
        print(f"lomo clipped / lomo: {clipped:.3f} (median of the per-round ratios)")
    for name, steps in parts.items():
        print(f"\n{name} (grad_reduction -> {transports[name]}): time in LOMO's own code per step, ms (median), "
              "and as a share of the floor step")
        floor_ms = statistics.median(floor) * 1e3
        in_code = [s.get("hook", 0.0) + s.get("flush", 0.0) for s in steps]
        rows = {k: [s.get(k, 0.0) for s in steps] for k in BREAKDOWN}
        rows["bookkeeping"] = [t - sum(s.get(k, 0.0) for k in BREAKDOWN) for t, s in zip(in_code, steps, strict=True)]
        rows["total in hooks + flush"] = in_code
        for k, v in rows.items():
            ms = statistics.median(v) * 1e3
            print(f"  {k:24s} {ms:9.1f} {100 * ms / floor_ms:6.1f}%")
    print()
    for line in summary(times):
        print(line)


if __name__ == "__main__":
    main()
