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
    """Applies one reduced gradient shard to this rank's slice of a parameter."""

    def __init__(self, world: int, rank: int, stochastic_rounding: bool, fp32_master: bool, seed: int):
        self.world, self.rank = world, rank
        self.stochastic_rounding = stochastic_rounding
        self.fp32_master = fp32_master
        self.masters: dict[int, torch.Tensor] = {}  # ds_id -> fp32 copy of the local real elements
        self.generator = torch.Generator()
        self.generator.manual_seed(seed * 1000 + rank)
        self.rule = UpdateRule()
        self.measuring = False
        self.stats = PassStats()

    def reseed(self, seed: int, step: int) -> None:
        # A pure function of (seed, rank, step): resumed runs round exactly as uninterrupted ones.
        self.generator.manual_seed((seed * 1_000_003 + step) * 4099 + self.rank)

    def init_masters(self, params) -> None:
        for p in params:
            n = geometry(p, self.world, self.rank).local
            self.masters[ds_compat.param_id(p)] = ds_compat.shard(p)[:n].detach().float().clone()

    def apply_bucket(self, items: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
        for param, grad_shard in items:
            self.apply(param, grad_shard)

    def apply(self, param: torch.nn.Parameter, grad_shard: torch.Tensor) -> None:
        n = geometry(param, self.world, self.rank).local
        if n == 0:
            return
        g = grad_shard[:n].float()
        if self.measuring:
            # fp32 norm per tensor, accumulated in fp64 across tensors (as clip_grad_norm_ does).
            self.stats.sum_sq += float(torch.linalg.vector_norm(g)) ** 2 * self.rule.grad_scale**2
            return
        step_scale = self.rule.grad_scale
        if self.rule.clip_value is not None:
            # `g` may alias the received bucket or the freed gradient: both are ours to overwrite.
            g.mul_(self.rule.grad_scale).clamp_(-self.rule.clip_value, self.rule.clip_value)
            step_scale = 1.0
        shard = ds_compat.shard(param)[:n]
        master = self.masters.get(ds_compat.param_id(param))
        weights = master if master is not None else shard.float()
        if self.rule.weight_decay:
            weights.mul_(1.0 - self.rule.lr * self.rule.weight_decay)
        weights.add_(g, alpha=-self.rule.lr * step_scale)  # scale folded into the axpy: one pass
        if weights.data_ptr() == shard.data_ptr():
            return  # fp32 shard updated in place
        if shard.dtype == torch.bfloat16 and self.stochastic_rounding and master is None:
            shard.copy_(stochastic_round_to_bf16(weights, self.generator))
        else:
            shard.copy_(weights)
