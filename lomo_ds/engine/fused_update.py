"""The fused, sharded LOMO update: the part DeepSpeed does not have.

As each parameter's gradient becomes ready in the backward pass it joins a bucket (buckets.py).
A full bucket is reduce-scattered over the data-parallel group, so each rank receives only the
summed gradient of its own slice of each parameter; the rank then updates that slice of its ZeRO-3
shard (`param.ds_tensor`) in fp32 arithmetic and lets the gradient go. No whole-model gradient,
no optimizer state.

Chunks (memory.update_chunk_elements): a slice is updated `chunk` elements at a time, so the update's
temporaries (an fp32 copy of the gradient and of the weights where they are not fp32, and the
stochastic-rounding noise) are bounded by the chunk, not by the largest parameter. Every step of
the SGD update is elementwise, so an fp32 result is bit for bit the unchunked one; sums over a
slice (the clipping norm, AdaLomo's statistics) stay whole where the slice is fp32 (it needs no
temporary), and are summed chunk by chunk otherwise. Stochastic rounding draws its noise chunk by
chunk from the same per-device generator, in the slice's order: on a CPU the draws come from the
generator one element after another, so the noise is the same as one draw over the slice; on an
accelerator each draw advances the generator's offset by its own amount, so the noise differs
from an unchunked update's, and is still independent and uniform for every element (unbiased).

Shard layout (DeepSpeed ZeRO-3): with `part = ceil(numel / world)`, rank r holds flat elements
[r*part, min((r+1)*part, numel)) of the parameter; the last ranks may carry padding, and a rank
may hold no real element at all when numel < world.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lomo_ds.engine.precision import stochastic_round_to_bf16
from lomo_ds.runtime import ds_compat


@dataclass(frozen=True)
class ShardGeometry:
    numel: int
    world: int
    rank: int

    @property
    def part(self) -> int:
        return math.ceil(self.numel / self.world)

    @property
    def start(self) -> int:
        return self.rank * self.part

    @property
    def local(self) -> int:
        """Real (unpadded) elements of the parameter on this rank."""
        return max(0, min(self.part, self.numel - self.start))


def chunk_bounds(n: int, size: int, start: int = 0, align: int = 1) -> list[tuple[int, int]]:
    """[a, b) pieces of a slice of n elements starting at flat element `start` of its parameter,
    each at most `size` elements (at least `align`, rounded down to a multiple of it), their ends at
    multiples of that size in the parameter's flat index: with `align` a matrix's row length, every
    whole row of the slice falls in one chunk."""
    size = max(align, size // align * align)
    bounds, a = [], 0
    while a < n:
        b = min(n, ((start + a) // size + 1) * size - start)
        bounds.append((a, b))
        a = b
    return bounds


def grad_chunk(grad, a: int, b: int, device: torch.device, *, fresh: bool = False) -> torch.Tensor:
    """Elements [a, b) of a reduced gradient slice as fp32 on `device`. `fresh`: a new tensor the
    caller may overwrite; else possibly a view of the slice itself (the received bucket, the
    accumulator's buffer), which the caller must never write: an update that reads a chunk more than
    once (AdaLomo's three passes) would read its own writes. `grad` is a tensor, or an object with
    `chunk(a, b, device, fresh)` (the accumulator's sum, accumulation.py)."""
    if torch.is_tensor(grad):
        return grad[a:b].to(device, torch.float32, copy=fresh)
    return grad.chunk(a, b, device, fresh=fresh)


def grad_in_place(grad, n: int, device: torch.device) -> torch.Tensor | None:
    """The slice's first n elements as one fp32 tensor on `device` without a copy, or None where
    that needs one (then it is read chunk by chunk). It is the received bucket or the accumulator's
    buffer itself: a caller that writes it reads the gradient through this tensor alone from then
    on (AdaLomo's in-place route), and nothing reads the slice after the update (the bucket is
    freed, the accumulator zeroed)."""
    if torch.is_tensor(grad):
        real = grad[:n]
        return real if real.dtype == torch.float32 and real.device == device else None
    return grad.in_place(n, device)


def geometry(param: torch.nn.Parameter, world: int, rank: int) -> ShardGeometry:
    return ShardGeometry(ds_compat.full_numel(param), world, rank)


@dataclass(frozen=True)
class UpdateRule:
    """What one backward pass does to the reduced gradient shards; the engine sets it per pass."""

    lr: float = 0.0
    grad_scale: float = 1.0  # 1 / (world * loss_scale) * clip coefficient
    clip_value: float | None = None
    weight_decay: float = 0.0


class PassStats:
    """What one backward pass learns, kept on the device so that learning it costs no host
    synchronisation: this rank's share of the global squared norm (fp64, the measuring pass),
    and whether every bucket so far was finite (the buckets fold each one in). `read()` is the
    pass's one read; the engine sums the figures over the ranks first."""

    def __init__(self, device: torch.device):
        self.sum_sq = torch.zeros((), dtype=torch.float64, device=device)
        self.finite = torch.ones((), dtype=torch.bool, device=device)
        # The flag's value where every verdict so far was a Python bool (a transport that reads its
        # flags in host memory); None once a device verdict was folded in (reading it would sync).
        self._known: bool | None = True

    def fold(self, verdict: torch.Tensor | bool) -> None:
        """Fold a bucket's verdict into the pass's flag: a device tensor stays on the device (no
        host sync), a bool is known already."""
        if torch.is_tensor(verdict):
            self.finite.logical_and_(verdict)
            self._known = None
        elif not verdict:
            self.finite.fill_(False)
            if self._known is not None:
                self._known = False

    def finite_now(self) -> torch.Tensor | bool:
        """The flag as the update reads it: True where every verdict so far was known in host
        memory and held, so the update needs no masking pass over the slice; else the device flag,
        never read here (no host sync on an accelerator)."""
        return True if self._known else self.finite

    def norm_sq_or_inf(self) -> torch.Tensor:
        """This rank's squared norm, or inf once anything was non-finite: one fp64 number carries both."""
        return torch.where(self.finite, self.sum_sq, torch.full_like(self.sum_sq, math.inf))


class ShardGeometries:
    """This rank's ShardGeometry of each parameter, from the parameter's own process group
    (`ds_process_group`): that group's size and this rank's place in it."""

    def __init__(self):
        self._cache: dict[int, ShardGeometry] = {}

    def __call__(self, param: torch.nn.Parameter) -> ShardGeometry:
        pid = ds_compat.param_id(param)
        if pid not in self._cache:
            if torch.distributed.is_initialized():
                group = ds_compat.process_group(param)
                world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
            else:  # a single process without a process group holds the whole parameter
                world, rank = 1, 0
            self._cache[pid] = geometry(param, world, rank)
        return self._cache[pid]


class ShardUpdater:
    """Applies one reduced gradient shard to this rank's slice of a parameter.

    The update runs where the shard lives: on the accelerator, or in host memory under
    `offload_param: {device: cpu}` (each shard's own device: they need not all be on one).
    `adalomo` (lomo_ds/engine/adalomo.py), when given, replaces the SGD update of the updating
    pass; it takes each bucket whole for its per-bucket statistics collectives, and hands the
    host part of the shards in host memory to the host-update worker when the engine has one.

    One backward pass: `begin_pass(rule, measure=...)` returns the pass's PassStats, then the
    buckets call `apply_bucket(items, stats)`. A bucket is applied only while `stats.finite`
    holds, decided on the device (a non-finite gradient is zeroed, not read): no host sync.
    """

    def __init__(self, stochastic_rounding: bool, seed: int, stats_device: torch.device,
                 geometry: ShardGeometries | None = None, adalomo=None, master_params=(), chunk: int = 1 << 22):
        self.stochastic_rounding = stochastic_rounding
        self.chunk = chunk  # memory.update_chunk_elements
        self.seed = seed
        self.stats_device = stats_device
        self.geometry = geometry or ShardGeometries()
        self.adalomo = adalomo
        self.masters: dict[int, torch.Tensor] = {}  # ds_id -> fp32 copy of the local real elements
        for p in master_params:
            n = self.geometry(p).local
            self.masters[ds_compat.param_id(p)] = ds_compat.shard(p)[:n].detach().float().clone()
        # Stochastic rounding draws its noise on each shard's device (torch refuses a generator on
        # another device): one generator per device, reseeded every step.
        self._generators: dict[torch.device, torch.Generator] = {}
        self._step = 0
        self.rule = UpdateRule()
        self.measuring = False

    def begin_pass(self, rule: UpdateRule, measure: bool = False, step: int | None = None) -> PassStats:
        """Start one backward pass: `measure` only sums squares (the first of two passes), else
        update by `rule`. `step` (the optimizer step) reseeds the rounding noise."""
        self.rule, self.measuring = rule, measure
        if step is not None:
            self._step = step
            for gen in self._generators.values():
                gen.manual_seed(self._seed_for(step))
        return PassStats(self.stats_device)

    def _seed_for(self, step: int) -> int:
        # A pure function of (seed, rank, step): resumed runs round exactly as uninterrupted ones.
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return (self.seed * 1_000_003 + step) * 4099 + rank

    def generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self._seed_for(self._step))
        return self._generators[device]

    def apply_bucket(self, items: list[tuple[torch.nn.Parameter, torch.Tensor]], stats: PassStats) -> None:
        if self.measuring:
            for param, grad_shard in items:
                n = self.geometry(param).local
                if n:
                    stats.sum_sq.add_(self.sum_sq(grad_shard, n).mul_(self.rule.grad_scale**2))
            return
        if self.adalomo is not None:
            self.adalomo.apply_bucket(self, items, stats.finite)
            return
        finite = stats.finite_now()
        for param, grad_shard in items:
            self.apply(param, grad_shard, finite)

    def sum_sq(self, grad, n: int) -> torch.Tensor:
        """fp64 squared L2 norm of a gradient slice's first n elements, on the slice's device: one
        fp32 norm over the slice where it is fp32 (as clip_grad_norm_ takes it per tensor), else
        fp32 norms of its chunks, summed in fp64 (no fp32 copy of the whole slice)."""
        device = grad.device
        whole = grad_in_place(grad, n, device)
        if whole is not None:
            return torch.linalg.vector_norm(whole, dtype=torch.float32).double().square_()
        total = torch.zeros((), dtype=torch.float64, device=device)
        for a, b in chunk_bounds(n, self.chunk):
            total.add_(torch.linalg.vector_norm(grad_chunk(grad, a, b, device)).double().square_())
        return total

    def apply(self, param: torch.nn.Parameter, grad_shard, finite: torch.Tensor | bool) -> None:
        """Update this rank's slice of `param` from its reduced slice (a tensor, or the accumulator's
        sum), unless `finite` (the pass's device flag as of this bucket) is false; `finite=True`:
        known finite on the host. Chunk by chunk (module docstring)."""
        n = self.geometry(param).local
        if n == 0:
            return
        device = ds_compat.shard(param).device
        keep = None if finite is True else finite.to(device)
        step_scale = 1.0 if self.rule.clip_value is not None else self.rule.grad_scale
        decay = None
        if self.rule.weight_decay:
            decay = 1.0 - self.rule.lr * self.rule.weight_decay
            decay = decay if keep is None else torch.where(keep, decay, 1.0)
        masked = keep is not None or self.rule.clip_value is not None
        for a, b in chunk_bounds(n, self.chunk):
            # The slice may be the received bucket or the accumulator itself: written only as a copy.
            g = grad_chunk(grad_shard, a, b, device, fresh=masked)
            if keep is not None:
                g.masked_fill_(~keep, 0.0)  # a skipped bucket moves nothing (NaN * 0 would still be NaN)
            if self.rule.clip_value is not None:
                g = self.unscale_and_clip(g)
            weights = self.weights(param, a, b)
            if decay is not None:
                weights.mul_(decay)
            weights.add_(g, alpha=-self.rule.lr * step_scale)  # scale folded into the axpy: one pass
            self.write_back(param, weights, a, b)
            del g, weights

    def slice_device(self, param: torch.nn.Parameter) -> torch.device:
        """Where the update wants this parameter's reduced slice: beside the shard, or, for a
        shard in host memory whose AdaLomo update the host-update worker finishes, on the rank's
        device (the hook computes its statistics there)."""
        if self.adalomo is not None:
            return self.adalomo.device_of(param)
        return ds_compat.shard(param).device

    def unscale_and_clip(self, g: torch.Tensor) -> torch.Tensor:
        """The gradient as the update rule sees it: averaged, unscaled and norm-clipped (all in
        grad_scale), then value-clipped. In place: `g` is a fresh copy (grad_chunk's `fresh`), or
        the slice itself where its caller reads it through `g` alone (grad_in_place)."""
        g.mul_(self.rule.grad_scale)
        if self.rule.clip_value is not None:
            g.clamp_(-self.rule.clip_value, self.rule.clip_value)
        return g

    def weights_in_place(self, param: torch.nn.Parameter) -> bool:
        """Whether `weights(param)` is the stored fp32 weights themselves (a master, or an fp32
        shard), not a copy: then a whole-slice pass over them needs no temporary."""
        return (ds_compat.param_id(param) in self.masters
                or ds_compat.shard(param).dtype == torch.float32)

    def weights_sum_sq(self, param: torch.nn.Parameter) -> torch.Tensor:
        """sum(θ^2) of this rank's real elements (fp32, on the shard's device): one norm over the
        stored fp32 weights, or over fp32 copies of their chunks (summed in fp32)."""
        if self.weights_in_place(param):
            return torch.linalg.vector_norm(self.weights(param)).square()
        total = torch.zeros((), dtype=torch.float32, device=ds_compat.shard(param).device)
        for a, b in chunk_bounds(self.geometry(param).local, self.chunk):
            total += torch.linalg.vector_norm(self.weights(param, a, b)).square()
        return total

    def weights(self, param: torch.nn.Parameter, a: int = 0, b: int | None = None) -> torch.Tensor:
        """fp32 weights of this rank's real elements [a, b) (default: all of them) to update in
        place: the master copy, the shard itself when it is fp32, else an fp32 copy that write_back
        rounds into the shard."""
        b = self.geometry(param).local if b is None else b
        master = self.masters.get(ds_compat.param_id(param))
        if master is not None:
            return master[a:b]
        return ds_compat.shard(param)[a:b].float()

    def write_back(self, param: torch.nn.Parameter, weights: torch.Tensor, a: int = 0, b: int | None = None) -> None:
        """Store updated fp32 `weights` (from `weights(param, a, b)`) into elements [a, b) of the
        parameter's shard."""
        b = self.geometry(param).local if b is None else b
        shard = ds_compat.shard(param)[a:b]
        if weights.dtype == shard.dtype and weights.data_ptr() == shard.data_ptr():
            return  # fp32 shard updated in place
        if shard.dtype == torch.bfloat16 and self.stochastic_rounding and ds_compat.param_id(param) not in self.masters:
            shard.copy_(stochastic_round_to_bf16(weights, self.generator(shard.device)))
        else:
            shard.copy_(weights)
