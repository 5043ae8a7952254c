"""What the checks of 8-bit shards beside the engine's other features build and measure (gradient
accumulation, norm and value clipping, offload_param, sequence parallelism);
tests/engine/test_int8_features.py declares them and asserts on rank 0's figures.

The reference is tests/engine/int8_checks.py's one process: the tiny model in fp32 with the
dequantized 8-bit blocks as its weights, torch.optim.SGD on the gradient the feature gives (the
window's mean over all its micro-batches; torch's clip_grad_norm_ / clip_grad_value_), and the
requantization with the same keyed noise (train.seed, the optimizer step, the parameter's index).
The engine computes its own gradient (its forward, its reduce-scatter, its accumulator), in sums
of another order, so a weight may differ by fp32 ulps and, rarely, round to the other integer: the
figures are the integers that differ (`ints`), the largest difference of one (`max_flip`, in steps),
and the scales' relative difference while no integer differs (`scale_rel`).

Each check also runs a control reference with the feature taken away (no clip, or the last window
as long as the others), and measures the engine's integers against it too (`control_ints`): what a
run that ignored the feature would have been near. The tolerance must separate the two.
"""
from __future__ import annotations

import copy

import torch

import lomo_ds
from lomo_ds.runtime import ds_compat
from tests.engine import int8_checks as c
from tests.engine.dist_accumulation_checks import window_batches
from tests.engine.dist_engine_checks import ds_cfg, offloaded
from tests.engine.dist_sp_checks import micro_batch

CLIP_NORM = 0.3  # the tiny model's gradient norms are 0.9 to 2.4: the clip scales every step by 0.3 or less
CLIP_VALUE = 0.005  # larger than about 15% of the gradient's elements (5% after the norm clip)


def int8_cfg(**options) -> dict:
    """ds_cfg with 8-bit shards in the reference's blocks and noise seed (int8_checks)."""
    cfg = ds_cfg(seed=c.SEED, **options)
    cfg["memory"] = {**cfg.get("memory", {}), "int8_shards": True, "int8_block": c.BLOCK}
    return cfg


def gathered(engine) -> tuple[dict, dict]:
    """Every 8-bit parameter's full integers and global-grid scales, on every rank (collective): as
    int8_checks.gathered puts them together, read from the engine's shards through ds_compat."""
    view = c.ShardedModel([(n, _Shard(p)) for n, p in engine.module.named_parameters()
                           if ds_compat.int8_shard(p) is not None])
    q, s, _ = c.gathered(view, ds_compat.process_group(engine.params[0]))
    return q, s


class _Shard:
    """An engine parameter's 8-bit shard as int8_checks.gathered reads one (Int8Param's attributes)."""

    def __init__(self, param):
        self.ds_tensor, self.ds_quant_scale = ds_compat.int8_shard(param)
        self.ds_numel = ds_compat.full_numel(param)


class Window:
    """One optimizer step's micro-batches, as the engine and the reference see them: `mine`, this
    rank's train_step calls; `rows`, every micro-batch of every rank (the reference's mean)."""

    def __init__(self, mine: list[dict], rows: list[dict]):
        self.mine, self.rows = mine, rows


def reference_step(ref: c.Reference, rows: list[dict], step: int, clip_norm=None, clip_value=None) -> dict:
    """One step of the reference on the mean loss of `rows` (clipped as asked); its figures."""
    ref._load()
    ref.model.zero_grad()
    (sum(ref.model(**mb).loss for mb in rows) / len(rows)).backward()
    params = list(ref.model.parameters())
    out = {"norm": torch.nn.utils.clip_grad_norm_(params, clip_norm or float("inf")).item()}
    if clip_value is not None:
        grads = torch.cat([p.grad.reshape(-1) for p in params])
        out["value_clipped"] = int((grads.abs() > clip_value).sum())
        torch.nn.utils.clip_grad_value_(params, clip_value)
    ref.step(step)
    return out


def compare(ref: c.Reference, q: dict, s: dict) -> dict:
    """int8_checks.mismatches, and the largest integer difference (in quantization steps)."""
    flip = max(int((q[n].to(torch.int32) - ref.q[n].to(torch.int32)).abs().max()) for n in ref.names)
    return {**c.mismatches(ref, q, s), "max_flip": flip}


def near_reference(engine, windows: list[Window], clip_norm=None, clip_value=None, controls=None,
                   reference=lambda: c.Reference("sgd")) -> dict:
    """Train `engine` window by window beside the reference; `controls`: by name, (windows,
    clip_norm, clip_value) of a reference without a feature, the engine's integers measured against
    each too (`control_ints`)."""
    controls = controls or {}
    ref = reference()
    others = {name: reference() for name in controls}
    q, s = gathered(engine)
    start = compare(ref, q, s)
    figures, rescaled = [], 0
    for step, window in enumerate(windows):
        if len(window.mine) < engine.accumulation_steps:
            engine.start_window(len(window.mine))
        for mb in window.mine:
            out = engine.train_step(mb)
        assert out["stepped"], "the window's last micro-batch must step"
        rescaled += out.get("int8_rescaled_blocks", 0)
        figures.append(reference_step(ref, window.rows, step, clip_norm, clip_value))
        for name, (other_windows, norm, value) in controls.items():
            reference_step(others[name], other_windows[step].rows, step, norm, value)
    q, s = gathered(engine)
    total = torch.tensor([rescaled], dtype=torch.int64)
    torch.distributed.all_reduce(total)
    moved = c.mismatches(c.Reference("sgd"), ref.q, ref.s)["ints"]
    out = {**compare(ref, q, s), "start_ints": start["ints"], "moved": moved, "steps": figures,
           "rescaled": int(total), "reference_rescaled": ref.rescaled, "world": engine.world}
    out["control_ints"] = {name: compare(other, q, s)["ints"] for name, other in others.items()}
    return out


def accumulation_windows(world: int, rank: int, lengths: list[int]) -> list[Window]:
    """tests/engine/dist_accumulation_checks.py's windows of `lengths` micro-batches each."""
    out = []
    for step, k in enumerate(lengths):
        window = window_batches(step, world, k)
        out.append(Window([mbs[rank] for mbs in window], [mb for mbs in window for mb in mbs]))
    return out


def accumulation(lengths=(2, 2, 1), k: int = 2, clip_norm=None, clip_value=None, rule: str = "sgd") -> dict:
    """8-bit shards with accumulation_steps `k` over windows of `lengths` (a shorter last one: an
    epoch's end) and the clipping asked for, against the reference (`rule`: "sgd", or "adalomo",
    the reference AdaLomo). The controls: the reference stepping on each window's last
    micro-batches alone ("last": the accumulator ignored), and without each clip asked for
    ("no_norm_clip", "no_value_clip")."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    cfg = int8_cfg(accumulation_steps=k, clip_grad_norm=clip_norm, clip_grad_value=clip_value, optimizer=rule)
    engine = lomo_ds.initialize(copy.deepcopy(c.Reference(rule).model), cfg)
    windows = accumulation_windows(world, rank, list(lengths))
    controls = {}
    if max(lengths) > 1:
        controls["last"] = ([Window(w.mine[-1:], w.rows[-world:]) for w in windows], clip_norm, clip_value)
    if clip_norm is not None:
        controls["no_norm_clip"] = (windows, None, clip_value)
    if clip_value is not None:
        controls["no_value_clip"] = (windows, clip_norm, None)
    out = near_reference(engine, windows, clip_norm, clip_value, controls, reference=lambda: c.Reference(rule))
    out["fused"] = engine.fused_accumulation
    return out


def offload_equals_resident(k: int = 2, clip_norm=CLIP_NORM) -> dict:
    """The same 8-bit run with offload_param cpu and without (accumulation k, norm clipping): the
    integers and scales after 3 steps, bit for bit, and where the offloaded shards lived."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    runs = {}
    for offload in (False, True):
        cfg = int8_cfg(accumulation_steps=k, clip_grad_norm=clip_norm)
        engine = lomo_ds.initialize(copy.deepcopy(c.Reference("sgd").model), offloaded(cfg) if offload else cfg)
        for window in accumulation_windows(world, rank, [k, k, 1]):
            if len(window.mine) < k:
                engine.start_window(len(window.mine))
            for mb in window.mine:
                engine.train_step(mb)
        runs[offload] = (*gathered(engine), engine)
    (qa, sa, _), (qb, sb, off) = runs[False], runs[True]
    return {"ints": sum(int((qa[n] != qb[n]).sum()) for n in qa),
            "scales": sum(int((sa[n] != sb[n]).sum()) for n in sa),
            "parameters": len(qa), "moved": compare(c.Reference("sgd"), qa, sa)["ints"],
            "offloaded": _offloaded(off), "int8_params": sum(ds_compat.int8_shard(p) is not None for p in off.params)}


def _offloaded(engine) -> str:
    """Where ZeRO-3 was told to keep the engine's partitions (its offload's device: "cpu" under
    offload_param cpu, "none" otherwise)."""
    return str(getattr(engine.offload, "offload_device", None))


def sequence_parallel(sp: int = 2, k: int = 2, clip_norm=CLIP_NORM) -> dict:
    """8-bit shards with train.sequence_parallel_size `sp` (each rank of an SP group given its
    data-parallel group's whole rows; the engine splits them), accumulation k and norm clipping,
    against the reference on the whole rows; the control: the reference without the clip."""
    cfg = int8_cfg(accumulation_steps=k, clip_grad_norm=clip_norm, sequence_parallel_size=sp)
    engine = lomo_ds.initialize(copy.deepcopy(_sdpa_reference().model), cfg)
    dp, d = engine.sp.dp_size, engine.sp.dp_rank
    windows = [Window([micro_batch(step, i, d) for i in range(k)],
                      [micro_batch(step, i, g) for i in range(k) for g in range(dp)]) for step in range(3)]
    out = near_reference(engine, windows, clip_norm, None, {"no_norm_clip": (windows, None, None)},
                         reference=_sdpa_reference)
    return {**out, "sp": engine.sp.size, "dp": dp}


def _sdpa_reference() -> c.Reference:
    ref = c.Reference("sgd")
    ref.model.config._attn_implementation = "sdpa"  # what Ulysses wraps; the reference attends the same way
    return ref


def update_from_accumulated(lengths=(2, 2, 1), clip_value=None, norm_clip: float | None = None,
                            dtype: torch.dtype = torch.float32) -> dict:
    """The update alone, bit for bit: every rank updates its 8-bit slices from a real accumulator
    (ShardAccumulator: the window's first slices added, the last one read with them as the fused
    K-th backward reads it) with the pass's grad_scale (1 / window length, times the clip
    coefficient) and clip_value; the reference steps torch.optim.SGD on the same sum, scaled and
    clamped (clip_grad_value_) as the engine's unscale_and_clip does, and requantizes. The clip
    coefficient is the reference's own (torch's clip_grad_norm_ arithmetic on the mean gradient):
    the norm the engine sums over ranks is the engine checks' (near_reference), not this one's.
    `dtype`: the accumulator's (memory.accumulate_dtype); in bf16 the last slice is added to each
    chunk read, not into the buffer, and the reference sums as the buffer rounds."""
    from lomo_ds.engine.accumulation import ShardAccumulator
    from lomo_ds.engine.update import PassSettings, PassStats

    group = torch.distributed.group.WORLD
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    ref = c.Reference("sgd")
    model = c.shards(ref, group, world, rank)
    up = c.updater(model)
    params = [p for _, p in model.params]
    acc = ShardAccumulator(params, lambda p: up.geometry(p).local, dtype, on_host=False)
    per_step = []

    def mine(p, flat: torch.Tensor) -> torch.Tensor:
        geo = up.geometry(p)
        return flat[geo.start:geo.start + geo.local]

    for step, k in enumerate(lengths):
        grads = [ref.gradients(10 * step + i) for i in range(k)]  # the window's micro-steps' gradients
        total = {}
        for n in ref.names:  # summed as the accumulator sums: its buffer's adds, then the last slice
            buf = torch.zeros_like(grads[0][n], dtype=dtype)
            for g in grads[:-1]:
                buf.add_(g[n])
            total[n] = buf.float() + grads[-1][n] if k > 1 else grads[-1][n].clone()
        scale = 1.0 / k
        if norm_clip is not None:
            norm = torch.linalg.vector_norm(torch.cat([total[n] * scale for n in ref.names])).item()
            scale *= min(1.0, norm_clip / (norm + 1e-6))
        items = []
        for p, (n, _) in zip(params, model.params, strict=True):
            for g in grads[:-1]:
                acc.add(p, mine(p, g[n]))
            last = mine(p, grads[-1][n])
            items.append((p, acc.lazy_total(p, torch.device("cpu"), last) if k > 1 else last))
        up.begin_pass(PassSettings(lr=c.LR, grad_scale=scale, clip_value=clip_value), step=step)
        half = len(items) // 2
        for bucket in (items[:half], items[half:]):
            up.apply_bucket(bucket, PassStats(torch.device("cpu")))
        acc.zero()
        for n, p in ref.model.named_parameters():
            g = total[n].mul(scale)
            p.grad = (g.clamp_(-clip_value, clip_value) if clip_value is not None else g).view_as(p).clone()
        ref.step(step)
        q, s, disagree = c.gathered(model, group)
        per_step.append({**c.mismatches(ref, q, s), "cut_scales_disagree": disagree})
    return {"steps": per_step, "moved_ints": c.mismatches(c.Reference("sgd"), ref.q, ref.s)["ints"]}
