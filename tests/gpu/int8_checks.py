"""8-bit weight shards (memory.int8_shards) on GPUs: tests/gpu/gpu_checks.py runs these checks in its
launch (1 and N GPUs), tests/gpu/test_gpu.py holds their figures to the bounds below, and
tests/gpu/test_int8_checks.py binds them, checks their planner arithmetic and feeds each bound a
figure it must refuse, on a CPU.

- int8_update: the fused SGD update on 8-bit shards in GPU memory (the engine's ShardUpdater and
  Int8Shards, cut blocks settled by an NCCL all-reduce MAX) against tests/engine/int8_checks.py's
  one-process CPU reference (dequantize, torch.optim.SGD in fp32, requantize with the same keyed
  noise), every rank updating from its slice of the reference's own gradient, and against the same
  reference's arithmetic run on the GPU. The keyed noise is int32 arithmetic on the device, so it
  must be the CPU's bit for bit (checked directly). Against the GPU-run reference every integer and
  scale must be equal. Against the CPU reference one operation may differ: a recomputed scale is
  absmax / (127 / (1 + headroom)), a division by a Python number, which CUDA's kernel computes as a
  multiplication by the divisor's reciprocal (one ulp apart at most); a block's integers can then
  round the other way where w / s + u lies within an ulp of an integer. So, as AdaLomo's oracle:
  at most 1e-3 of the integers differ and every scale is within 1e-6 of the reference's.
- int8_gather: after a step, every 8-bit parameter as DeepSpeed's fetch and GatheredParameters
  leave it equals the shards (collected from every rank) dequantized, bitwise, both on the CPU and
  on the GPU (q * s in fp32 and one cast: exact and the same on both).
- int8_memory: torch.cuda.max_memory_allocated over a steady step of the memory model (0.9 GB of
  bf16 weights) with a working set bounded to about a layer, with 8-bit shards and in bf16: the
  8-bit peak within the planner's estimate (MEMORY_TOLERANCE), and below the bf16 peak by at least
  the shard bytes saved minus the slack `planned_saving` states.
- int8_race: the engine on 8-bit shards with the device held back by torch.cuda._sleep (as
  gpu_checks.check_delayed_window_tail holds it) at each hand-over between streams, against the
  same run undelayed: the losses, integers and scales equal. A second undelayed run shows the runs
  are reproducible, and a run whose shard writes are put on a stream nothing waits for must differ
  (else the comparison could not see a race).
"""
from __future__ import annotations

import contextlib
import copy
import gc
import json
import math
import os

import torch

import lomo_ds
from lomo_ds.comm.int8_gather import Int8Gather
from lomo_ds.engine.update import SGD, PassSettings, PassStats, ShardGeometries, ShardUpdater
from lomo_ds.engine.update.int8 import Int8Shards, cut_blocks
from lomo_ds.runtime import ds_compat, quant8
from lomo_ds.runtime.shard_geometry import ShardGeometry
from tests.engine import int8_checks as c
from tests.engine.dist_engine_checks import ds_cfg
from tests.gpu.compare import MEMORY_TOLERANCE, memory_run_config, predicted_peak_bytes, within_tolerance
from tests.gpu.models import llama_config, measured_llama, random_batch, sync
from tests.tiny import global_batch, tiny_llama

FLIP_SHARE = 1e-3  # integers that may round the other way against the CPU reference (AdaLomo's oracle's)
SCALE_REL = 1e-6  # a scale against the CPU reference's (the fp32 oracles' bound)
UPDATE_STEPS = 3
# Noise spans compared across devices besides every parameter's: one across the 2^32 boundary of
# the flat index, where the host mixes in the high word.
NOISE_SPANS = ((2**32 - 1000, 3000), (5 * 2**32 + 7, 513))


# ----------------------------------------------------------------- the update against its references
class DeviceReference:
    """tests/engine/int8_checks.Reference's arithmetic on `device`: the same blocks dequantized,
    torch.optim.SGD on flat fp32 copies (its per-tensor loop, foreach=False, as it runs on a CPU),
    requantized with the same keyed noise. Fed the CPU reference's gradients."""

    def __init__(self, ref: c.Reference, device: torch.device):
        self.names, self.device = ref.names, device
        self.q = {n: ref.q[n].to(device) for n in ref.names}
        self.s = {n: ref.s[n].to(device) for n in ref.names}
        self.w = {n: torch.nn.Parameter(torch.zeros(ref.q[n].numel(), dtype=torch.float32, device=device))
                  for n in ref.names}
        self.opt = torch.optim.SGD(list(self.w.values()), lr=c.LR, foreach=False)
        self.rescaled = 0

    def step(self, grads: dict[str, torch.Tensor], step: int) -> None:
        with torch.no_grad():
            for n, w in self.w.items():
                w.copy_(quant8.dequantize(self.q[n], self.s[n], 0, block=c.BLOCK))
                w.grad = grads[n].to(self.device)
        self.opt.step()
        for i, n in enumerate(self.names):
            self.q[n], self.s[n], grown = quant8.requantize(self.w[n].detach(), self.s[n], 0, (c.SEED, step, i),
                                                            block=c.BLOCK)
            self.rescaled += int(grown)

    def on_host(self) -> tuple[dict, dict]:
        return {n: t.cpu() for n, t in self.q.items()}, {n: t.cpu() for n, t in self.s.items()}


def shards_on(device: torch.device, ref: c.Reference, group, int8_class=Int8Shards):
    """The reference's blocks as this rank's ZeRO-3 shards in `device` memory, and the engine's
    updater over them (SGD, chunks of c.CHUNK, the pass's flags on the device)."""
    model = c.shards(ref, group, torch.distributed.get_world_size(group), torch.distributed.get_rank(group))
    for _, p in model.params:
        t = p.ds_tensor.to(device)
        t.ds_quant_scale = p.ds_tensor.ds_quant_scale.to(device)
        p.ds_tensor = t
    geometry = ShardGeometries()
    noise_ids = {p.ds_id: i for i, (_, p) in enumerate(model.named_parameters())}
    up = ShardUpdater(True, c.SEED, device, geometry, SGD(), chunk=c.CHUNK,
                      int8=int8_class(geometry, c.BLOCK, c.SEED, noise_ids))
    return model, up


def device_step(up: ShardUpdater, model, grads: dict[str, torch.Tensor], step: int, device: torch.device) -> None:
    """tests/engine/int8_checks.sharded_step on `device`: two buckets, each settling its cut blocks."""
    up.begin_pass(PassSettings(lr=c.LR), step=step)
    items = []
    for n, p in model.params:
        geo = up.geometry(p)
        items.append((p, grads[n][geo.start:geo.start + geo.local].to(device)))
    half = len(items) // 2
    for bucket in (items[:half], items[half:]):
        up.apply_bucket(bucket, PassStats(device))


def _against(q: dict, s: dict, want_q: dict, want_s: dict) -> dict:
    holder = c.Reference.__new__(c.Reference)
    holder.q, holder.s, holder.names = want_q, want_s, sorted(want_q)
    return c.mismatches(holder, q, s)


def noise_mismatches(device: torch.device, numels: list[int], step: int) -> tuple[int, int]:
    """(elements whose keyed noise differs between `device` and the CPU, elements compared)."""
    spans = [((c.SEED, step, i), 0, n) for i, n in enumerate(numels)]
    spans += [((c.SEED, step, 0), first, count) for first, count in NOISE_SPANS]
    bad = total = 0
    for key, first, count in spans:
        here = quant8.noise(key, first, count, device).cpu()
        bad += int((here != quant8.noise(key, first, count, torch.device("cpu"))).sum())
        total += count
    return bad, total


def check_int8_update(device: torch.device, steps: int = UPDATE_STEPS) -> dict | None:
    """The 8-bit SGD update in `device` memory, step by step, against the CPU reference and its
    arithmetic on the device; and, as a control, one step with noise seeded per rank, which the
    device comparison must see."""
    group = torch.distributed.group.WORLD
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    ref = c.Reference("sgd")
    on_device = DeviceReference(ref, device)
    model, up = shards_on(device, ref, group)
    out = {"steps": [], "noise_mismatches": 0, "noise_elements": 0, "world": world, "device": str(device)}
    rescaled = 0
    for step in range(1, steps + 1):
        grads = ref.gradients(step)
        device_step(up, model, grads, step, device)
        ref.step(step)
        on_device.step(grads, step)
        q, s, disagree = c.gathered(model, group)
        out["steps"].append({"cpu": _against(q, s, ref.q, ref.s), "device": _against(q, s, *on_device.on_host()),
                             "cut_scales_disagree": disagree})
        bad, total = noise_mismatches(device, [ref.q[n].numel() for n in ref.names], step)
        out["noise_mismatches"] += bad
        out["noise_elements"] += total
        rescaled += up.shard.take_rescaled()
    total = torch.tensor([rescaled], dtype=torch.int64, device=device)
    ds_compat.all_reduce(total, group, name="rescaled blocks")
    out.update(rescaled=int(total), reference_rescaled=ref.rescaled, device_rescaled=on_device.rescaled,
               cut_blocks=sum(len(cut_blocks(p.ds_numel, world, c.BLOCK)) for _, p in model.params),
               moved_ints=c.mismatches(c.Reference("sgd"), ref.q, ref.s)["ints"])
    # The control: noise seeded per rank (the bf16 path's) on the device, one step.
    fresh = c.Reference("sgd")
    control_ref = DeviceReference(fresh, device)
    model, up = shards_on(device, fresh, group, c.PerRankNoise)
    grads = fresh.gradients(1)
    device_step(up, model, grads, 1, device)
    control_ref.step(grads, 1)
    q, s, _ = c.gathered(model, group)
    out["control_ints"] = _against(q, s, *control_ref.on_host())["ints"]
    return out if rank == 0 else None


def assert_int8_update(r: dict, world: int) -> None:
    """check_int8_update's figures: the noise the CPU's bit for bit; every step's integers and scales
    the device reference's exactly and the CPU reference's but for FLIP_SHARE of the integers and
    SCALE_REL of a scale; cut blocks one scale on every rank; the reference moved, rescaled blocks
    (counted alike), and the per-rank-noise control seen."""
    assert r["noise_elements"] > 0 and r["noise_mismatches"] == 0, \
        f"{r['noise_mismatches']} of {r['noise_elements']} noise values differ from the CPU's"
    assert r["moved_ints"] > 0, "the reference's integers never moved: the comparison would pass on anything"
    if world > 1:
        assert r["cut_blocks"] > 0, "no block is cut: the shared-scale case is not exercised"
    for i, s in enumerate(r["steps"], 1):
        assert (s["device"]["ints"], s["device"]["scales"], s["cut_scales_disagree"]) == (0, 0, 0), (i, s)
        assert s["cpu"]["ints"] <= FLIP_SHARE * s["cpu"]["elements"], (i, s)
        assert s["cpu"]["scale_rel"] <= SCALE_REL, (i, s)
    assert r["rescaled"] == r["device_rescaled"] > 0, r
    assert r["control_ints"] > 0, "noise seeded per rank went unseen: the device comparison cannot fail"


# ----------------------------------------------------------------- gathered weights
def int8_cfg(block: int = 8, bf16: bool = True, **lomo) -> dict:
    """The engine's config on 8-bit shards: norms (40 elements) persistent, the rest 8-bit, blocks
    small enough that shard boundaries cut them on 2 ranks."""
    cfg = ds_cfg(persist=100, **lomo)
    cfg["memory"] = {**cfg.get("memory", {}), "int8_shards": True, "int8_block": block}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def shards_by_name(engine) -> dict[str, tuple[torch.Tensor, torch.Tensor, int]]:
    """Every 8-bit parameter's full integers and per-block scales, put together on the host from
    every rank's shard (a cut block's scale: the first holder's), with its block size."""
    mine = {}
    for name, p in engine.module.named_parameters():
        pair = ds_compat.int8_shard(p)
        if pair is None:
            continue
        block = ds_compat.int8_block(p)
        geo = ShardGeometry(ds_compat.full_numel(p), engine.world, engine.rank)
        first, n = quant8.piece_span(geo.start, geo.local, block)
        mine[name] = (pair[0][:geo.local].cpu(), first, pair[1][:n].cpu(), block)
    every = [None] * engine.world
    torch.distributed.all_gather_object(every, mine)
    out = {}
    for name, (_, _, _, block) in mine.items():
        blocks = {}
        for r in every:
            _, first, scales, _ = r[name]
            for i, v in enumerate(scales.tolist()):
                blocks.setdefault(first + i, v)
        scales = torch.tensor([blocks[k] for k in sorted(blocks)], dtype=torch.float32, device="cpu")
        out[name] = (torch.cat([r[name][0] for r in every]), scales, block)
    return out


def check_int8_gather(cfg: dict, device: torch.device) -> dict | None:
    """After one step on the device, every 8-bit parameter as the forward's fetch and
    GatheredParameters leave it, against its shards dequantized on the CPU and on the device; then
    one doubled scale on rank 0, which the comparison must see."""
    import deepspeed

    engine = lomo_ds.initialize(tiny_llama(3), cfg)
    world, rank = engine.world, engine.rank
    engine.train_step(global_batch(0, world)[rank])
    held = shards_by_name(engine)
    fetched = c.fetched_weights(engine, global_batch(1, world)[rank])
    out = {"kinds": {}, "fetched_bad": [], "gathered_bad": [], "on_device_bad": [], "world": world}
    for name, p in engine.module.named_parameters():
        out["kinds"][name] = "int8" if name in held else str(ds_compat.shard(p).dtype)
        if name not in held:
            continue
        q, s, block = held[name]
        want = quant8.dequantize(q, s, 0, block=block, dtype=p.dtype)
        here = quant8.dequantize(q.to(device), s.to(device), 0, block=block, dtype=p.dtype)
        with deepspeed.zero.GatheredParameters([p]):
            got = p.data.detach().reshape(-1).clone()
        if not torch.equal(got.cpu(), want):
            out["gathered_bad"].append(name)
        if not torch.equal(got, here):
            out["on_device_bad"].append(name)
        if name not in fetched or not torch.equal(fetched[name].reshape(-1).cpu(), want):
            out["fetched_bad"].append(name)
    name, p = next((n, p) for n, p in engine.module.named_parameters() if n in held)
    scales = ds_compat.int8_shard(p)[1]
    if rank == 0:
        scales[0] *= 2
    with deepspeed.zero.GatheredParameters([p]):
        out["doubled_scale_seen"] = not torch.equal(p.data.detach().reshape(-1).cpu(),
                                                    quant8.dequantize(*held[name][:2], 0, block=held[name][2],
                                                                      dtype=p.dtype))
    engine.release()
    return out if rank == 0 else None


def assert_int8_gather(r: dict) -> None:
    kinds = r["kinds"]
    assert {k for n, k in kinds.items() if "norm" not in n} == {"int8"}, kinds
    assert (r["fetched_bad"], r["gathered_bad"], r["on_device_bad"]) == ([], [], []), r
    assert r["doubled_scale_seen"], "a doubled scale went unseen: the comparison cannot fail"


# ----------------------------------------------------------------- peak memory against bf16 and the planner
# The memory model's working set bounded to about a decoder layer (51M parameters): then the shards
# are most of the bf16 peak, and what 8-bit shards save shows beside the dequantized working set
# (DeepSpeed's default keeps up to 1e9 parameters gathered: the whole model, in bf16, on any rank count).
INT8_MEMORY_ZERO = {"stage3_max_live_parameters": 60_000_000, "stage3_max_reuse_distance": 60_000_000,
                    "stage3_prefetch_bucket_size": 0}
MEMORY_BLOCK = 128


def int8_memory_runs(model_dir: str, sizes: dict) -> dict[str, dict]:
    """The bf16 run (gpu_checks.check_memory's, the working set bounded) and the same with 8-bit shards."""
    bf16 = memory_run_config(model_dir, sizes["micro"], sizes["seq"])
    bf16["zero_optimization"].update(INT8_MEMORY_ZERO)
    int8 = copy.deepcopy(bf16)
    int8["memory"] = {**int8.get("memory", {}), "int8_shards": True, "int8_block": MEMORY_BLOCK}
    return {"bf16": bf16, "int8": int8}


def planned_saving(runs: dict[str, dict], model_dir: str, world: int) -> dict:
    """What the 8-bit run must save against bf16 on `world` GPUs, per GPU, from the planner:
    - shards_saved: a rank's bf16 shards of the non-persistent parameters, less their 8-bit shards
      and scales (lomo_ds/planning/int8_shards.shard_bytes);
    - int8_extras: what the planner says 8-bit shards cost beyond smaller shards (its 8-bit peak
      less the bf16 peak with the shards' saving taken off): the dequantized working set where a
      bf16 run on one GPU gathers nothing, the gather's 8-bit buffers, the dequantization's fp32
      chunk, the update's larger temporaries;
    - slack: int8_extras (at least 0) and MEMORY_TOLERANCE of shards_saved for the allocator (its
      block rounding and what it keeps cached between the two runs' allocations);
    - required: shards_saved - slack, the least the measured peaks must differ by."""
    from lomo_ds.config.run import load_run_config
    from lomo_ds.planning import int8_shards as I8
    from lomo_ds.planning.planner import run_spec_for, spec_from_hf_config

    with open(os.path.join(model_dir, "config.json")) as f:
        spec = spec_from_hf_config(json.load(f))
    run = run_spec_for(load_run_config(runs["int8"], check_files=False))
    bf16_shards = run.b * sum(math.ceil(x / world) for x in spec.param_numels() if x > run.persistence)
    q, s = I8.shard_bytes(spec, run, world)
    saved = bf16_shards - q - s
    predicted_bf16 = predicted_peak_bytes(runs["bf16"], world)
    predicted_int8 = predicted_peak_bytes(runs["int8"], world)
    extras = predicted_int8 - (predicted_bf16 - saved)
    slack = max(extras, 0) + MEMORY_TOLERANCE * saved
    return {"shards_saved": saved, "int8_extras": extras, "slack": slack, "required": saved - slack,
            "predicted_bf16": predicted_bf16, "predicted_int8": predicted_int8}


def measured_peak(device: torch.device, run: dict, sizes: dict) -> int:
    """gpu_checks.check_memory's measurement for `run`: torch.cuda.max_memory_allocated over the
    second step (the first records DeepSpeed's trace) above what was allocated before the model, the
    most of any rank."""
    base, model = measured_llama(sizes, device)
    engine = lomo_ds.initialize(model, {k: v for k, v in run.items() if k not in ("model", "tokenizer")})
    batch = random_batch(sizes, device, seed=engine.rank)
    engine.train_step(batch)
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    engine.train_step(batch)
    sync(device)
    measured = torch.cuda.max_memory_allocated(device) - base
    every = [None] * engine.world
    torch.distributed.all_gather_object(every, measured)
    engine.release()
    del engine, model, batch
    gc.collect()
    torch.cuda.empty_cache()
    return max(every)


def check_int8_memory(device: torch.device, workdir: str, sizes: dict) -> dict:
    """The memory model's steady-step peak with 8-bit shards and in bf16, and the planner's figures."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    model_dir = os.path.join(workdir, "int8_memory_model_" + "_".join(str(v) for v in sizes.values()))
    if rank == 0:
        llama_config(sizes).save_pretrained(model_dir)
    torch.distributed.barrier()
    runs = int8_memory_runs(model_dir, sizes)
    out = {"measured_bf16": measured_peak(device, runs["bf16"], sizes),
           "measured_int8": measured_peak(device, runs["int8"], sizes)}
    return {**out, **planned_saving(runs, model_dir, world), "world": world}


def assert_int8_memory(r: dict) -> None:
    """check_int8_memory's figures: the 8-bit peak within the planner's tolerance, and below the
    bf16 peak by at least the shard bytes saved less the slack (which leaves something to save)."""
    assert r["required"] > 0, r
    assert within_tolerance(r["measured_int8"], r["predicted_int8"]), \
        f"8-bit peak {r['measured_int8'] / 2**20:.0f} MiB, planner {r['predicted_int8'] / 2**20:.0f} MiB"
    saved = r["measured_bf16"] - r["measured_int8"]
    assert saved >= r["required"], (
        f"8-bit shards saved {saved / 2**20:.0f} MiB of the peak against bf16; the shards are "
        f"{r['shards_saved'] / 2**20:.0f} MiB smaller and the slack {r['slack'] / 2**20:.0f} MiB")


# ----------------------------------------------------------------- streams held back
# GPU clock cycles torch.cuda._sleep spins at each delay: tens of ms, thousands of times the tiny
# model's kernels (a quarter of gpu_checks.DELAY_CYCLES: these runs hold the device back at every bucket).
RACE_CYCLES = 50_000_000
RACE_STEPS = 3
# Where the device is held back, on the stream current there: before an update bucket reads its
# reduced gradients and its shards (buffers a next bucket or the next forward's gather may reuse or
# read), before the 8-bit gather copies the shards into its send buffer (which an update may be
# writing), before it dequantizes what it received (which the forward then reads).
DELAYS = ("update", "gather_send", "gather_dequantize")


HELD = {"count": 0}  # delays injected in the current run (each one reached, on any device)


def _sleep(device: torch.device, cycles: int) -> None:
    HELD["count"] += 1
    if device.type == "cuda":
        torch.cuda._sleep(cycles)


@contextlib.contextmanager
def held_back(engine, where: str | None, device: torch.device, cycles: int):
    """The engine with the device held back at `where` (DELAYS), or, "unordered_writes", its 8-bit
    shard writes issued on a stream of their own that nothing waits for (the control)."""
    saved = []
    if where == "update":
        apply = engine.updater.apply_bucket

        def delayed(*args, **kwargs):
            _sleep(device, cycles)
            return apply(*args, **kwargs)

        engine.updater.apply_bucket = delayed
    elif where in ("gather_send", "gather_dequantize"):
        attr = "_start" if where == "gather_send" else "wait"
        original = getattr(Int8Gather, attr)
        saved.append((attr, original))

        def held(self, *args, _original=original, **kwargs):
            _sleep(device, cycles)
            return _original(self, *args, **kwargs)

        setattr(Int8Gather, attr, held)
    elif where == "unordered_writes":
        int8 = engine.updater.shard.int8
        write = int8.write_back

        def unordered(param, weights, a, b):
            if device.type != "cuda":
                return write(param, weights, a, b)
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                _sleep(device, cycles)
                return write(param, weights, a, b)

        int8.write_back = unordered
    try:
        yield
    finally:
        for attr, original in saved:
            setattr(Int8Gather, attr, original)


def race_run(device: torch.device, where: str | None, cycles: int, steps: int) -> dict:
    """Losses and the final 8-bit state (rank 0's collection) of the engine on 8-bit shards, fp32, on
    the bucket path with prefetching gathers, held back at `where`."""
    cfg = int8_cfg(block=16, bf16=False, fetch={"stage3_prefetch_bucket_size": 1_000_000})
    engine = lomo_ds.initialize(tiny_llama(3), cfg)
    losses = []
    HELD["count"] = 0
    with held_back(engine, where, device, cycles):
        for step in range(steps):
            losses.append(engine.train_step(global_batch(step, engine.world)[engine.rank])["loss"])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    state = shards_by_name(engine)
    engine.release()
    return {"losses": losses, "state": state, "held": HELD["count"]}


def _differences(a: dict, b: dict) -> dict:
    return {"ints": sum(int((a["state"][n][0] != b["state"][n][0]).sum()) for n in a["state"]),
            "scales": sum(int((a["state"][n][1] != b["state"][n][1]).sum()) for n in a["state"]),
            "losses_equal": a["losses"] == b["losses"], "held": a["held"], "params": len(a["state"])}


def check_int8_race(device: torch.device, cycles: int = RACE_CYCLES, steps: int = RACE_STEPS) -> dict | None:
    """The engine on 8-bit shards held back at each of DELAYS, undelayed again, and with its shard
    writes unordered (the control), each against the undelayed run."""
    plain = race_run(device, None, cycles, steps)
    out = {"delayed": device.type == "cuda", "losses": plain["losses"], "runs": {}}
    for where in ("repeat", *DELAYS, "unordered_writes"):
        run = race_run(device, None if where == "repeat" else where, cycles, steps)
        out["runs"][where] = _differences(run, plain)
    return out if torch.distributed.get_rank() == 0 else None


def assert_int8_race(r: dict) -> None:
    """check_int8_race's figures: the undelayed run reproduces itself, every delayed run equals it,
    and on a GPU the unordered writes do not (else a race could not show)."""
    def same(d: dict) -> bool:
        return (d["ints"], d["scales"], d["losses_equal"]) == (0, 0, True)

    assert all(d["params"] > 0 for d in r["runs"].values()), "no 8-bit parameter to compare"
    assert same(r["runs"]["repeat"]), f"two undelayed runs differ ({r['runs']['repeat']}): not reproducible here"
    for where in DELAYS:
        d = r["runs"][where]
        assert d["held"] > 0, f"the delay at {where} was never reached: the engine no longer goes through it"
        assert same(d), f"held back at {where}: {d} against the undelayed run"
    if r["delayed"]:
        control = r["runs"]["unordered_writes"]
        assert control["held"] > 0 and not same(control), \
            f"shard writes on a stream nothing waits for went unseen ({control}): a race could not show"


def int8_checks(device: torch.device, on_gpu: bool, workdir: str) -> dict:
    """The checks of gpu_checks' launch, as partials (the peak memory only on a GPU: only CUDA
    reports allocator peaks)."""
    from functools import partial

    from tests.gpu.models import MEMORY_MODEL

    checks = {"int8_update": partial(check_int8_update, device),
              "int8_gather": partial(check_int8_gather, int8_cfg(block=8), device),
              "int8_gather_b128": partial(check_int8_gather, int8_cfg(block=128), device),
              "int8_memory": partial(check_int8_memory, device, workdir, MEMORY_MODEL["gpu"]),
              "int8_race": partial(check_int8_race, device, RACE_CYCLES if on_gpu else 0)}
    if not on_gpu:
        checks.pop("int8_memory")
    return checks


def summary_line(name: str, r: dict) -> str | None:
    """compare.format_summary's line for one of these checks (None: not one of them)."""
    if name == "int8_update":
        last = r["steps"][-1]
        return (f"{len(r['steps'])} steps: against the CPU reference {last['cpu']['ints']} of "
                f"{last['cpu']['elements']} integers and {last['cpu']['scales']} scales differ (largest scale gap "
                f"{last['cpu']['scale_rel']:.1e}), against it on the device {last['device']['ints']} and "
                f"{last['device']['scales']}; noise {r['noise_mismatches']} of {r['noise_elements']} apart; "
                f"{r['rescaled']} blocks rescaled; per-rank noise control {r['control_ints']} integers off")
    if name.startswith("int8_gather"):
        bad = r["fetched_bad"] + r["gathered_bad"] + r["on_device_bad"]
        return (f"{sum(k == 'int8' for k in r['kinds'].values())} 8-bit parameters, "
                f"{len(bad)} not their shards dequantized; a doubled scale seen: {r['doubled_scale_seen']}")
    if name == "int8_memory":
        return (f"peak {r['measured_int8'] / 2**20:.0f} MiB with 8-bit shards (planner "
                f"{r['predicted_int8'] / 2**20:.0f}), {r['measured_bf16'] / 2**20:.0f} MiB in bf16: saved "
                f"{(r['measured_bf16'] - r['measured_int8']) / 2**20:.0f} MiB, at least "
                f"{r['required'] / 2**20:.0f} required (shards {r['shards_saved'] / 2**20:.0f} MiB smaller, slack "
                f"{r['slack'] / 2**20:.0f})")
    if name == "int8_race":
        return "; ".join(f"{where}: {d['ints']} integers, {d['scales']} scales off, losses equal {d['losses_equal']}"
                         for where, d in r["runs"].items())
    return None
