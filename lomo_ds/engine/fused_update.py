"""The fused, sharded LOMO update: the part DeepSpeed does not have.

As each parameter's gradient becomes ready in the backward pass it joins a bucket (buckets.py).
A full bucket is reduce-scattered over the data-parallel group, so each rank receives only the
summed gradient of its own slice of each parameter; the rank then updates that slice of its ZeRO-3
shard (`param.ds_tensor`) in fp32 arithmetic and lets the gradient go. No whole-model gradient,
no optimizer state.

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
    An AdaLomo rule (lomo_ds/engine/adalomo.py), when set, replaces the SGD update of the updating pass;
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
