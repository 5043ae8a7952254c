"""8-bit weight shards (memory.int8_shards) against bf16 shards on CPU ranks: memory against the
planner's terms, the gather's bytes, and where the step's time goes.

  OMP_NUM_THREADS=1 python -m benchmarks.int8_step                # 2 ranks, the defaults below
  OMP_NUM_THREADS=1 python -m benchmarks.int8_step --quick        # a few seconds of steps: proves it runs

Two LOMO engines (SGD) train copies of one random bf16 LLaMA built from a config, on the same
batches: "bf16" (bf16 shards, stochastic rounding) and "int8" (the same run with memory.int8_shards).

Memory, per rank, each engine after a warm-up step (DeepSpeed's module trace recorded):
  - the shards between steps: int8 integers and fp32 scales, or bf16's; the persistent
    parameters (compute dtype, shards and their whole copies), each against the planner's term
    (lomo_ds/planning/int8_shards.py; bf16: 2 bytes a padded ZeRO-3 slice element);
  - the engine's own tracker (params, activations, their total) against the planner's estimate,
    as tests/planning/test_planner.py compares them;
  - the step's peak of host allocations above what was live before it, from the allocator's own
    events (torch's profiler), against the planner's total less the shards the rank holds between
    steps. The collectives are gloo's (--transport torch, the default: comm.param_gather torch,
    grad_reduction reduce_scatter), whose results are tensors the step allocates, as a GPU's
    collectives' are; --transport auto takes lomo_ds's shared-memory transports between CPU
    ranks, whose buffers are their own (a CPU-only path);
  - the bytes this rank sends in all-gathers during a step (lomo_ds.profiling.count_comm: ZeRO-3's
    parameter gathers; int8: its integers and scales), and in all-reduces (int8: the cut blocks'
    maxima).

Speed: the engines take turns, a step each (bf16, int8, bf16, int8, ...) so that a slow spell on a
shared machine hits both. The benchmark wraps, from the outside (the engine's code is unchanged),
the shard reads and writes of the fused update (ShardWeights.weights: int8 dequantizes a chunk to
fp32, bf16 casts it; write_back and settle: int8 requantizes with keyed stochastic rounding, bf16
rounds stochastically), the 8-bit gather's dequantization (Int8Gather._dequantized), and the rest of
ZeRO-3's parameter gathers (each parameter's all_gather_coalesced and its handle's wait: buffers,
collectives, and on CPU ranks the wait for the slower rank), and prints each as a share of the
engine's step, per-step means over the ranks. The 8-bit update's count of recomputed scales
(int8_rescaled_blocks) is printed beside them.
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINES = ("bf16", "int8")
MIB = 2**20
# The gathered working set and the persistent parameters sized to the small model, as the CPU
# benchmarks do (benchmarks/common.py ds_config): norms persistent, every Linear gathered on use.
ZERO = {"stage": 3, "stage3_param_persistence_threshold": 10_000, "stage3_max_live_parameters": 1_000_000,
        "stage3_max_reuse_distance": 1_000_000, "stage3_prefetch_bucket_size": 0}
QUICK = dict(hidden=128, layers=2, intermediate=345, vocab=512, seq=32, micro=2, rounds=2, bucket=50_000)
# The quantization's own time; "gather: the rest" is the rest of ZeRO-3's parameter gathers (their
# buffers, collectives and waits, less the 8-bit dequantization): both engines'.
SPANS = ("gather: dequantize", "update: read", "update: write")
OTHER_SPANS = ("update: cut pieces", "gather: the rest")
# The planner's 8-bit gather transients (lomo_ds/planning/int8_shards.py int8_terms)
IN_FLIGHT = "gather in flight (8-bit buffers and scales)"
DEQUANTIZE = "dequantize (a part in fp32 and its cast)"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    # 7 heads of 64, and an intermediate size not a multiple of 4: on 2 ranks the MLP's shard
    # boundaries cut blocks of 128 (the cut blocks' all-reduce and settling take part), as odd sizes
    # and rank counts do on real runs.
    ap.add_argument("--hidden", type=int, default=448)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=1202)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro", type=int, default=2, help="sequences per rank per step")
    ap.add_argument("--rounds", type=int, default=6, help="timed steps of each engine (they take turns)")
    ap.add_argument("--block", type=int, default=128, help="memory.int8_block")
    ap.add_argument("--lr", type=float, default=1e-3, help="lomo.lr (SGD)")
    ap.add_argument("--bucket", type=int, default=1_000_000, help="comm.bucket_size")
    ap.add_argument("--transport", choices=("torch", "auto"), default="torch",
                    help="torch: gloo's collectives (comm.param_gather torch, grad_reduction reduce_scatter); "
                         "auto: lomo_ds's shared-memory transports between CPU ranks (a CPU-only path)")
    ap.add_argument("--quick", action="store_true", help="a tiny model and two rounds (seconds of steps)")
    ap.add_argument("--rank-run", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.quick:
        for k, v in QUICK.items():
            setattr(a, k, v)
    if a.ranks < 1 or a.rounds < 1:
        ap.error("--ranks and --rounds: expected at least 1")
    return a


# ----------------------------------------------------------------------------- the run, on each rank
def heads(a) -> tuple[int, int, int]:
    """(attention heads, key-value heads, head dim): heads of 64, grouped by the largest divisor of
    the head count up to half of it (two queries a key where the count is even)."""
    h = max(2, a.hidden // 64)
    return h, max(d for d in range(1, h // 2 + 1) if h % d == 0), a.hidden // h


def run_config(a, int8: bool):
    from lomo_ds.config.engine_sections import group_by_section
    from lomo_ds.config.run import load_run_config

    ds = {"train_micro_batch_size_per_gpu": a.micro, "bf16": {"enabled": True}, "zero_optimization": ZERO}
    options = {"lr": a.lr, "optimizer": "sgd", "bucket_size": a.bucket}
    if a.transport == "torch":
        options.update(param_gather="torch", grad_reduction="reduce_scatter")
    if int8:
        options.update(int8_shards=True, int8_block=a.block)
    return load_run_config({**ds, **group_by_section(options), "model": {"path": "<built in memory>"},
                            "tokenizer": {"max_length": a.seq}}, check_files=False)


def model(a):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    h, kv, hd = heads(a)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                      num_hidden_layers=a.layers, num_attention_heads=h, num_key_value_heads=kv, head_dim=hd,
                      max_position_embeddings=max(64, a.seq), attn_implementation="eager", use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


class Spans:
    """Seconds inside wrapped functions, by label, since the last take (wrapped from the outside: the
    engine's code is unchanged). Exclusive: a wrapped call inside another counts under its own label,
    and its time is taken out of the outer one's."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.inner: list[float] = []  # per open call: the seconds its wrapped callees took

    def call(self, label: str, fn, *args, **kwargs):
        self.inner.append(0.0)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - t0
            self.seconds[label] += elapsed - self.inner.pop()
            if self.inner:
                self.inner[-1] += elapsed

    def wrap(self, owner, name: str, label: str) -> None:
        fn = getattr(owner, name)
        setattr(owner, name, lambda *args, **kwargs: self.call(label, fn, *args, **kwargs))

    def wrap_gathers(self, params, label: str) -> None:
        """ZeRO-3's fetches of `params`: each parameter's all_gather_coalesced (how DeepSpeed's
        coordinator starts a gather, and where lomo_ds routes the 8-bit ones) and the wait of the
        handle it returns (the gather finished: for int8 its dequantization, timed apart)."""
        for p in params:
            fetch = getattr(p, "all_gather_coalesced", None)
            if fetch is not None:
                p.all_gather_coalesced = functools.partial(self._fetch, fetch, label)

    def _fetch(self, fetch, label: str, *args, **kwargs):
        handle = self.call(label, fetch, *args, **kwargs)
        wait = handle.wait
        handle.wait = lambda *a, **k: self.call(label, wait, *a, **k)
        return handle

    def take(self) -> dict[str, float]:
        out, self.seconds = dict(self.seconds), defaultdict(float)
        return out


def held_bytes(engine) -> dict[str, int]:
    """This rank's parameter storage between steps: 8-bit shards and scales, the compute-dtype shards
    of the other non-persistent parameters, and the persistent parameters' tensors (each storage once)."""
    from lomo_ds.runtime import ds_compat

    out = dict.fromkeys(("int8", "scales", "bf16", "persistent"), 0)
    seen: set[int] = set()
    for p in engine.params:
        pair = ds_compat.int8_shard(p)
        if pair is not None:
            out["int8"] += pair[0].untyped_storage().nbytes()
            out["scales"] += pair[1].untyped_storage().nbytes()
            continue
        key = "persistent" if ds_compat.is_persistent(p) else "bf16"
        for t in (ds_compat.shard(p), p.data):
            st = t.untyped_storage()
            if st.nbytes() and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                out[key] += st.nbytes()
    return out


def peak_of_allocations(step) -> tuple[int, object]:
    """The peak of live CPU memory during `step()` above what was live before it, from the allocator's
    own events (torch's profiler; as tests/planning/test_planner.py measures it), and step's result."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = step()
    live = peak = 0
    for e in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak, result


def memory_of(engine, batch) -> dict:
    """One engine's memory figures on this rank (a step taken: the tracker's, the step's peak, the
    bytes sent)."""
    from lomo_ds.profiling import count_comm

    held = held_bytes(engine)
    engine.enable_memory_tracking()
    engine.reset_memory()
    with count_comm() as counts:
        peak, _ = peak_of_allocations(lambda: engine.train_step(batch))
    return {"held": held, "breakdown": engine.memory_breakdown(),
            "persistent_whole": engine.tracker.peak.persistent_bytes, "step_peak": peak,
            "comm": counts.as_dict()}


def timed_rounds(a, engines: dict, batches: list) -> tuple[dict, dict, dict]:
    """The engines take turns, a step each; per engine the step times, the wrapped spans' seconds a
    step, and the blocks whose scale the 8-bit update recomputed."""
    import torch

    from lomo_ds.comm.int8_gather import Int8Gather
    from lomo_ds.engine.update.shard import ShardWeights

    spans = Spans()
    spans.wrap(Int8Gather, "_dequantized", "gather: dequantize")
    for engine in engines.values():
        spans.wrap_gathers(engine.module.parameters(), "gather: the rest")
    spans.wrap(ShardWeights, "weights", "update: read")
    spans.wrap(ShardWeights, "write_back", "update: write")
    # int8's cut pieces, requantized once a bucket after an all-reduce of their maxima, which waits
    # for the other rank: apart from the requantization's own time
    spans.wrap(ShardWeights, "settle", "update: cut pieces")
    times, parts, rescaled = defaultdict(list), defaultdict(list), defaultdict(list)
    for i in range(a.rounds):
        for name, engine in engines.items():
            torch.distributed.barrier()
            spans.take()
            t0 = time.perf_counter()
            out = engine.train_step(batches[i % len(batches)])
            torch.distributed.barrier()
            times[name].append(time.perf_counter() - t0)
            parts[name].append(spans.take())
            rescaled[name].append(int((out or {}).get("int8_rescaled_blocks", 0)))
    return dict(times), dict(parts), dict(rescaled)


def rank_main(a) -> None:
    import copy

    import torch

    import lomo_ds
    from lomo_ds.methods import build_engine

    lomo_ds.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    base = model(a)
    engines = {name: build_engine(run_config(a, name == "int8"), copy.deepcopy(base), total_steps=0)
               for name in ENGINES}
    g = torch.Generator(device="cpu").manual_seed(1000 + rank)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, a.vocab, (a.micro, a.seq), generator=g, device="cpu")
        batches.append({"input_ids": ids, "labels": ids.clone()})
    for engine in engines.values():  # DeepSpeed records its module trace; the next steps are steady
        engine.train_step(batches[0])
    memory = {name: memory_of(engine, batches[1]) for name, engine in engines.items()}
    times, parts, rescaled = timed_rounds(a, engines, batches)
    mine = {"memory": memory, "times": times, "parts": parts, "rescaled": rescaled}
    every = [None] * world
    torch.distributed.all_gather_object(every, mine)
    if rank == 0:
        params = sum(p.numel() for p in base.parameters())
        threads = os.environ.get("OMP_NUM_THREADS", "unset")
        print(f"LLaMA of {params / 1e6:.2f}M parameters (hidden {a.hidden}, {a.layers} layers, intermediate "
              f"{a.intermediate}, vocab {a.vocab}), {world} CPU ranks, micro-batch {a.micro} x {a.seq}, "
              f"SGD lr {a.lr:g}, block {a.block}, transport {a.transport}, {a.rounds} timed steps each, "
              f"OMP_NUM_THREADS={threads}, torch threads {torch.get_num_threads()}")
        for line in report_memory(a, world, every) + report_speed(every):
            print(line)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------- the report
def planned(a, world: int) -> dict:
    """The planner's terms for each engine's run on `world` ranks (the same config the engines read)."""
    from lomo_ds.planning import int8_shards as I8
    from lomo_ds.planning.planner import ModelSpec, estimate, run_spec_for

    h, kv, hd = heads(a)
    spec = ModelSpec("bench", a.hidden, a.layers, a.intermediate, a.vocab, h, kv, hd)
    out = {}
    for name in ENGINES:
        run = replace(run_spec_for(run_config(a, name == "int8")), attn="eager")
        est = estimate(spec, "lomo", world, run)
        small = [x for x in spec.param_numels() if x <= run.persistence]
        big = [x for x in spec.param_numels() if x > run.persistence]
        q, s = I8.shard_bytes(spec, run, world) if run.int8_shards else (0, 0)
        bf16 = 0 if run.int8_shards else run.b * sum(math.ceil(x / world) for x in big)
        persistent = I8.persistent_bytes(spec, run, world)
        # What lives before a step: the shards of every parameter (the persistent ones' whole copies
        # are gathered again during the step, on more than one rank).
        between = q + s + bf16 + (run.b * sum(math.ceil(x / world) for x in small) if world > 1 else persistent)
        out[name] = {"int8": q, "scales": s, "bf16": bf16, "persistent": persistent, "est": est,
                     "step": est.total - between}
    return out


def _row(label: str, measured: float, plan: float) -> str:
    ratio = f"{measured / plan:6.3f}" if plan else "     -"
    return f"  {label:46s} {measured / MIB:10.3f} {plan / MIB:10.3f} {ratio}"


def report_memory(a, world: int, every: list) -> list[str]:
    plan = planned(a, world)
    lines = []
    for rank, r in enumerate(every):
        lines.append(f"\nmemory, rank {rank} of {world} (MiB)    {'measured':>10s} {'planned':>10s} "
                     "measured/planned")
        for name in ENGINES:
            m, p = r["memory"][name], plan[name]
            held, est = m["held"], p["est"]
            lines.append(f" {name}")
            if name == "int8":
                lines.append(_row("8-bit shards (int8)", held["int8"], p["int8"]))
                lines.append(_row("scales (fp32)", held["scales"], p["scales"]))
                lines.append(_row("8-bit shards + scales", held["int8"] + held["scales"], p["int8"] + p["scales"]))
            else:
                lines.append(_row("bf16 shards", held["bf16"], p["bf16"]))
            lines.append(_row("persistent (shards + whole, in the step)",
                              held["persistent"] + m["persistent_whole"], p["persistent"]))
            # The tracker samples at gradient hooks: the gather's transients (int8: its buffers and
            # the dequantization's fp32 part) are gone by then, so they are left out of its terms.
            transient = est.int8.get(IN_FLIGHT, 0) + est.int8.get(DEQUANTIZE, 0)
            lines.append(_row("tracker: params", m["breakdown"]["params"], est.params - transient))
            lines.append(_row("tracker: activations", m["breakdown"]["activations"], est.activations))
            lines.append(_row("tracker: params+grads+activations", m["breakdown"]["total"], est.accounted - transient))
            if transient:
                lines.append(f"  (planned, not in the tracker's terms: {IN_FLIGHT} {est.int8[IN_FLIGHT] / MIB:.3f}, "
                             f"{DEQUANTIZE} {est.int8[DEQUANTIZE] / MIB:.3f})")
            lines.append(_row("step peak of allocations (above its start)", m["step_peak"], p["step"]))
        i8, b16 = r["memory"]["int8"]["held"], r["memory"]["bf16"]["held"]
        lines.append(f"  int8 shards + scales / bf16 shards: {(i8['int8'] + i8['scales']) / b16['bf16']:.4f} "
                     f"(planned {(plan['int8']['int8'] + plan['int8']['scales']) / plan['bf16']['bf16']:.4f})")
        peaks = r["memory"]["int8"]["step_peak"], r["memory"]["bf16"]["step_peak"]
        lines.append(f"  int8 step peak / bf16 step peak: {peaks[0] / peaks[1]:.3f} "
                     f"(planned {plan['int8']['step'] / plan['bf16']['step']:.3f})")
    lines += report_comm(every)
    return lines


def report_comm(every: list) -> list[str]:
    lines = ["\nbytes a rank sends in one step (count_comm, ring cost model), mean over the ranks:"]
    ops = sorted({op for r in every for name in ENGINES for op in r["memory"][name]["comm"]})
    lines.append(f"  {'op':24s} " + " ".join(f"{name + ' MiB':>10s} {name + ' calls':>11s}" for name in ENGINES))
    sent = {}
    for op in ops:
        row = []
        for name in ENGINES:
            figs = [r["memory"][name]["comm"].get(op, {"bytes": 0, "calls": 0}) for r in every]
            b, c = statistics.mean(f["bytes"] for f in figs), statistics.mean(f["calls"] for f in figs)
            sent[(name, op)] = b
            row.append(f"{b / MIB:10.3f} {c:11.1f}")
        lines.append(f"  {op:24s} " + " ".join(row))
    gather = "all_gather_into_tensor"
    if sent.get(("bf16", gather)):
        lines.append(f"  the parameter gather, int8 / bf16: {sent[('int8', gather)] / sent[('bf16', gather)]:.4f}")
    return lines


def report_speed(every: list) -> list[str]:
    lines = ["\nspeed: per-step means over the timed steps and the ranks, ms, and share of the engine's step"]
    steps = {name: statistics.mean(t for r in every for t in r["times"][name]) for name in ENGINES}
    lines.append(f"  {'':22s} " + " ".join(f"{name + ' ms':>10s} {name + ' %':>7s}" for name in ENGINES))
    lines.append(f"  {'step':22s} " + " ".join(f"{steps[n] * 1e3:10.1f} {100.0:7.1f}" for n in ENGINES))
    for span in (*SPANS, "all three", *OTHER_SPANS):
        row = []
        for name in ENGINES:
            per_step = statistics.mean(sum(p.get(k, 0.0) for k in SPANS) if span == "all three" else p.get(span, 0.0)
                                       for r in every for p in r["parts"][name])
            row.append(f"{per_step * 1e3:10.1f} {100 * per_step / steps[name]:7.1f}")
        lines.append(f"  {span:22s} " + " ".join(row))
    ratios = [i / b for r in every for i, b in zip(r["times"]["int8"], r["times"]["bf16"], strict=True)]
    lines.append(f"  int8 step / bf16 step: {statistics.median(ratios):.3f} (median of the per-round ratios)")
    pieces = every[0]["memory"]["int8"]["held"]["scales"] // 4
    lines.append(f"  blocks whose scale the 8-bit update recomputed, per step (rank 0): "
                 f"{statistics.mean(every[0]['rescaled']['int8']):.1f} of its {pieces} scales")
    lines.append("  update: read = int8 dequantize to fp32 / bf16 cast to fp32; update: write = int8 requantize "
                 "(keyed stochastic rounding) / bf16 stochastic rounding; update: cut pieces = int8's blocks cut "
                 "by a shard boundary, settled a bucket at a time (an all-reduce of their maxima, then their "
                 "requantization); gather: the rest = the parameter gathers less the dequantization (packing, "
                 "collectives, waiting for the other rank)")
    return lines


# ----------------------------------------------------------------------------- the launcher
def main(argv=None) -> None:
    a = parse_args(argv)
    if a.rank_run:
        return rank_main(a)
    from devkit.launch_local import run_local

    flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items() if k not in ("rank_run", "quick")]
    env = {"PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = run_local(["-m", "benchmarks.int8_step", *flags, "--rank-run"], a.ranks, timeout=1800, env=env, cwd=ROOT)
    if proc.returncode != 0:
        sys.exit(f"the ranks failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    print(proc.stdout, end="")


if __name__ == "__main__":
    main()
