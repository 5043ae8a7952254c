"""What an update rule is (SGD: sgd.py, AdaLomo: adalomo.py), and what one pass hands it.

A rule owns its state (none for SGD; AdaLomo's second moments) and applies reduced buckets to
the shard's weights (shard.py). The engine never asks which rule it runs: what it needs to know
about one is a `Rule` attribute or method.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lomo_ds.engine.update.shard import ShardWeights

Items = list[tuple[torch.nn.Parameter, Any]]  # (parameter, its reduced slice: a tensor or the accumulator's sum)


@dataclass(frozen=True)
class PassSettings:
    """What one pass does to the reduced gradient shards; the engine sets it per pass."""

    lr: float = 0.0
    grad_scale: float = 1.0  # 1 / (world * loss_scale) * clip coefficient
    clip_value: float | None = None
    weight_decay: float = 0.0


def unscale_and_clip(g: torch.Tensor, settings: PassSettings) -> torch.Tensor:
    """The gradient as the update rule sees it: averaged, unscaled and norm-clipped (all in
    grad_scale), then value-clipped. In place: `g` is a fresh copy (grad_chunk's `fresh`), or
    the slice itself where its caller reads it through `g` alone (grad_in_place)."""
    g.mul_(settings.grad_scale)
    if settings.clip_value is not None:
        g.clamp_(-settings.clip_value, settings.clip_value)
    return g


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


@dataclass(frozen=True)
class Cut:
    """A state tensor cut by ranks as ZeRO-3 cuts its parameter (runtime/shard_geometry.py): this
    rank's piece, on dimension 0, of a global flat tensor of `numel` elements. A checkpoint saves it
    as that piece and hands a run of another rank count its own (storage/engine_state.py)."""

    numel: int


@dataclass(frozen=True)
class Replicated:
    """A state tensor the same on every rank (a checkpoint saves it once)."""


StateLayout = dict[tuple[str, ...], Cut | Replicated]  # a tensor's path of keys in state_dict() -> how it lies


@dataclass(frozen=True)
class BuildContext:
    """What the engine hands a rule's `build` (updater.build_updater): every rule is built from one
    of these, so the engine builds any registered rule (config/rules.py) the same way."""

    options: Any  # the rule's own config section (lomo.<its config key>, validated); None: it has none
    module: torch.nn.Module  # the model (parameter names: module.named_parameters())
    params: list  # the parameters the rule updates, ZeRO-3 partitioned (ds_compat.shard(p): this rank's piece)
    group: Any  # the data-parallel group the shards are cut over, where bucket statistics are reduced
    geometry: Any  # geometry(param) -> this rank's ShardGeometry of a parameter (runtime/shard_geometry.py)
    host: Any = None  # the HostUpdates worker where shards live in host memory (a rule may ignore it)
    device: torch.device | None = None  # this rank's device

    @property
    def world(self) -> int:
        """Ranks the shards are cut over."""
        return torch.distributed.get_world_size(self.group) if torch.distributed.is_initialized() else 1


class Rule(Protocol):
    """An update rule on this rank's shards. A rule is registered by name in config/rules.py and built
    by `build(ctx)`; docs/rules.md walks through adding one."""

    @classmethod
    def build(cls, ctx: BuildContext) -> "Rule":
        """The rule for this rank's shards (its state allocated)."""

    # The rule's name: lomo.optimizer's value, and what a checkpoint of its state is stored under (a
    # checkpoint of another rule is refused by it).
    name: str

    # Whether the rule takes each bucket whole, its slices of shards in host memory included: its
    # per-bucket statistics need every slice before any is applied, and it hands the host part to
    # the host-update worker itself. Else the engine hands such slices to the worker one by one,
    # which applies them with `apply`.
    takes_whole_bucket: bool

    def apply_bucket(self, shard: ShardWeights, items: Items, stats: PassStats, settings: PassSettings) -> None:
        """Update this rank's slice of every parameter of a reduced bucket, unless `stats.finite`
        says the pass has seen a non-finite value (decided on the device: no host sync)."""

    def apply(self, shard: ShardWeights, param: torch.nn.Parameter, grad, finite: torch.Tensor | bool,
              settings: PassSettings) -> None:
        """One slice alone (the host-update worker's route; only where `takes_whole_bucket` is false)."""

    def slice_device(self, param: torch.nn.Parameter) -> torch.device:
        """Where the rule wants this parameter's reduced slice (and an accumulated sum of it)."""

    def state_dict(self) -> dict[str, Any] | None:
        """The rule's resumable state on this rank (None: it has none)."""

    def check_state(self, state: dict[str, Any] | None) -> None:
        """Refuse, naming the setting, a state that is not this rule's for this model: from its keys
        alone (its tensors may not be read yet). Called only with a state saved under this rule's
        name (ShardUpdater refuses another rule's by name first)."""

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore what state_dict gave (the shards are written by the same load), after check_state."""

    def state_layout(self) -> StateLayout:
        """Every tensor of state_dict() by its path of keys in it: Cut (a piece of a global flat
        tensor, per rank) or Replicated. Empty: no state."""

    def state_bytes(self) -> int:
        """Bytes of state the rule holds on this rank (its Cut tensors' pieces, its Replicated whole)."""
