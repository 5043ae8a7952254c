"""The fused, sharded LOMO update: the part DeepSpeed does not have.

As each parameter's gradient becomes ready in the backward pass it joins a bucket. A full
bucket is reduce-scattered over the data-parallel group, so each rank receives only the summed
gradient of its own slice of each parameter; the rank then updates that slice of its ZeRO-3
shard (`param.ds_tensor`) in fp32 arithmetic and lets the gradient go. No whole-model gradient,
no optimizer state.

Shard layout (DeepSpeed ZeRO-3): with `part = ceil(numel / world)`, rank r holds flat elements
[r*part, min((r+1)*part, numel)) of the parameter; the last ranks may carry padding, and a rank
may hold no real element at all when numel < world.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from . import ds_compat
from .precision import stochastic_round_to_bf16


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


def geometry(param: torch.nn.Parameter, world: int, rank: int) -> ShardGeometry:
    return ShardGeometry(ds_compat.full_numel(param), world, rank)


@dataclass
class UpdateRule:
    """What the update pass does to a reduced gradient shard. Filled in per step by the engine."""

    lr: float = 0.0
    grad_scale: float = 1.0  # 1 / (world * loss_scale) * clip coefficient
    clip_value: float | None = None
    weight_decay: float = 0.0


@dataclass
class PassStats:
    """What the measuring pass learns: this rank's share of the global squared norm."""

    sum_sq: float = 0.0


class ShardUpdater:
    """Applies one reduced gradient shard to this rank's slice of a parameter.

    Each parameter is sharded over its own process group (`ds_process_group`): its shard
    geometry comes from that group's size and this rank's place in it. The update runs where the
    shard lives: on the accelerator, or in host memory under `offload_param: {device: cpu}`.
    An AdaLomo rule (lomo_ds/adalomo.py), when set, replaces the SGD update of the updating pass;
    it takes each bucket whole for its per-bucket statistics collectives.
    """

    def __init__(self, stochastic_rounding: bool, fp32_master: bool, seed: int, device: torch.device):
        self.adalomo = None
        self.stochastic_rounding = stochastic_rounding
        self.fp32_master = fp32_master
        self.masters: dict[int, torch.Tensor] = {}  # ds_id -> fp32 copy of the local real elements
        # Stochastic rounding draws its noise on the shards' device (torch refuses a generator
        # on another device); reseeded every step, so resumed runs round as uninterrupted ones.
        self.generator = torch.Generator(device=device)
        self.rule = UpdateRule()
        self.measuring = False
        self.stats = PassStats()
        self._geometry: dict[int, ShardGeometry] = {}

    def reseed(self, seed: int, step: int) -> None:
        # A pure function of (seed, rank, step): resumed runs round exactly as uninterrupted ones.
        self.generator.manual_seed((seed * 1_000_003 + step) * 4099 + torch.distributed.get_rank())

    def geometry(self, param: torch.nn.Parameter) -> ShardGeometry:
        pid = ds_compat.param_id(param)
        if pid not in self._geometry:
            if torch.distributed.is_initialized():
                group = ds_compat.process_group(param)
                world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
            else:  # a single process without a process group holds the whole parameter
                world, rank = 1, 0
            self._geometry[pid] = geometry(param, world, rank)
        return self._geometry[pid]

    def init_masters(self, params) -> None:
        for p in params:
            n = self.geometry(p).local
            self.masters[ds_compat.param_id(p)] = ds_compat.shard(p)[:n].detach().float().clone()

    def apply_bucket(self, items: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
        if self.adalomo is not None and not self.measuring:
            self.adalomo.apply_bucket(self, items)
            return
        for param, grad_shard in items:
            self.apply(param, grad_shard)

    def apply(self, param: torch.nn.Parameter, grad_shard: torch.Tensor) -> None:
        n = self.geometry(param).local
        if n == 0:
            return
        g = self.real_grad(param, grad_shard)
        if self.measuring:
            # fp32 norm per tensor, accumulated in fp64 across tensors (as clip_grad_norm_ does).
            self.stats.sum_sq += float(torch.linalg.vector_norm(g)) ** 2 * self.rule.grad_scale**2
            return
        step_scale = self.rule.grad_scale
        if self.rule.clip_value is not None:
            g, step_scale = self.unscale_and_clip(g), 1.0
        weights = self.weights(param)
        if self.rule.weight_decay:
            weights.mul_(1.0 - self.rule.lr * self.rule.weight_decay)
        weights.add_(g, alpha=-self.rule.lr * step_scale)  # scale folded into the axpy: one pass
        self.write_back(param, weights)

    def real_grad(self, param: torch.nn.Parameter, grad_shard: torch.Tensor) -> torch.Tensor:
        """The fp32 real elements of a reduced gradient slice, where the shard lives (an offloaded
        shard is updated in host memory: the slice goes there, not the shard here)."""
        return grad_shard[:self.geometry(param).local].to(ds_compat.shard(param).device, torch.float32)

    def unscale_and_clip(self, g: torch.Tensor) -> torch.Tensor:
        """The gradient as the update rule sees it: averaged, unscaled and norm-clipped (all in
        grad_scale), then value-clipped. In place: `g` aliases the received bucket or the freed
        gradient, both ours to overwrite."""
        g.mul_(self.rule.grad_scale)
        if self.rule.clip_value is not None:
            g.clamp_(-self.rule.clip_value, self.rule.clip_value)
        return g

    def weights(self, param: torch.nn.Parameter) -> torch.Tensor:
        """fp32 weights of this rank's real elements to update in place: the master copy, the
        shard itself when it is fp32, else an fp32 copy that write_back rounds into the shard."""
        master = self.masters.get(ds_compat.param_id(param))
        if master is not None:
            return master
        return ds_compat.shard(param)[:self.geometry(param).local].float()

    def write_back(self, param: torch.nn.Parameter, weights: torch.Tensor) -> None:
        """Store updated fp32 `weights` (from `weights(param)`) into the parameter's shard."""
        shard = ds_compat.shard(param)[:self.geometry(param).local]
        if weights.data_ptr() == shard.data_ptr():
            return  # fp32 shard updated in place
        if shard.dtype == torch.bfloat16 and self.stochastic_rounding and ds_compat.param_id(param) not in self.masters:
            shard.copy_(stochastic_round_to_bf16(weights, self.generator))
        else:
            shard.copy_(weights)


class ReduceScatterBuckets:
    """Collects ready gradients and reduce-scatters them in buckets of `capacity` elements.

    The reduce-scatter input is laid out rank-major: row r of a [world, n] matrix holds, for every
    parameter in the bucket, the elements rank r owns (zero-padded to `part`). One collective then
    delivers each rank exactly its slices, summed over ranks: the same bytes as DeepSpeed's own
    ZeRO-3 gradient path, half those of an all-reduce.
    """

    def __init__(self, group, world: int, rank: int, capacity: int, reduce_dtype: torch.dtype | None,
                 on_bucket: Callable[[list[tuple[torch.nn.Parameter, torch.Tensor]]], None], tracker=None,
                 all_reduce: bool = False):
        self.group, self.world, self.rank = group, world, rank
        # all_reduce=True is the public reference implementation's way (all-reduce each full
        # gradient, then keep this rank's slice): twice the bytes. Kept only as a baseline for
        # the communication benchmark.
        self.all_reduce = all_reduce
        self.capacity = capacity
        self.reduce_dtype = reduce_dtype
        # Called once per reduced bucket with [(param, this rank's reduced slice)], the slice
        # `part` long (padding included): an update rule that needs a collective per bucket
        # (e.g. AdaLomo's row/column statistics) gets every parameter of the bucket at once.
        self.on_bucket = on_bucket
        self.tracker = tracker
        self.pending: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self.pending_elems = 0
        self.found_nonfinite = False  # some rank's gradient was non-finite in this backward

    def reset(self) -> None:
        """Start of a backward."""
        self.found_nonfinite = False

    def add(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        if self.world == 1:
            # One rank: the shard is the whole parameter and there is nothing to reduce.
            self.on_bucket([(param, grad.reshape(-1))])
            return
        if self.all_reduce:
            full = grad.reshape(-1).to(self.reduce_dtype or grad.dtype)
            ds_compat.all_reduce(full, group=self.group)
            start = self.rank * math.ceil(grad.numel() / self.world)
            self.on_bucket([(param, full[start:start + math.ceil(grad.numel() / self.world)])])
            return
        part = math.ceil(grad.numel() / self.world)
        if self.pending and self.pending_elems + part > self.capacity:
            self.flush()
        self.pending.append((param, grad))
        self.pending_elems += part
        if self.tracker is not None:
            self.tracker.note_bucket(self.pending_bytes())
        if self.pending_elems >= self.capacity:
            self.flush()

    def pending_bytes(self) -> int:
        return sum(g.numel() * g.element_size() for _, g in self.pending)

    def flush(self) -> None:
        if not self.pending:
            return
        dtype = self.reduce_dtype or self.pending[0][1].dtype
        width = self.pending_elems
        grads = self.pending
        if len(grads) == 1 and grads[0][1].numel() == width * self.world and grads[0][1].dtype == dtype:
            send = grads[0][1].reshape(-1)  # already rank-major: no copy
        else:
            send = torch.empty(self.world, width, dtype=dtype, device=grads[0][1].device)
            col = 0
            for _, g in grads:
                part = math.ceil(g.numel() / self.world)
                flat = g.reshape(-1)
                full_rows = g.numel() // part
                send[:full_rows, col:col + part].copy_(flat[:full_rows * part].view(full_rows, part))
                tail = g.numel() - full_rows * part
                if full_rows < self.world:
                    send[full_rows:, col:col + part].zero_()
                    if tail:
                        send[full_rows, col:col + tail].copy_(flat[full_rows * part:])
                col += part
            send = send.view(-1)
        if self.tracker is not None:
            self.tracker.note_bucket(self.pending_bytes() + send.numel() * send.element_size() * (send.data_ptr() != grads[0][1].data_ptr()))
        received = torch.empty(width, dtype=dtype, device=send.device)
        ds_compat.reduce_scatter(received, send, self.group)
        self.pending, self.pending_elems = [], 0
        del send
        items, col = [], 0
        for param, g in grads:
            part = math.ceil(g.numel() / self.world)
            items.append((param, received[col:col + part]))
            col += part
        del grads
        self.on_bucket(items)
