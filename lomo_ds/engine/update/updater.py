"""The fused, sharded update as the engine drives it: one pass at a time, bucket by bucket.

As each parameter's gradient becomes ready in the backward pass it joins a bucket (buckets.py).
A full bucket is reduce-scattered over the data-parallel group, so each rank receives only the
summed gradient of its own slice of each parameter; the rank then updates that slice of its ZeRO-3
shard (`param.ds_tensor`) in fp32 arithmetic and lets the gradient go. No whole-model gradient.

One pass: `begin_pass(settings, measure=...)` returns the pass's PassStats, then the buckets call
`apply_bucket(items, stats)`: the measuring pass (norm clipping, loss scaling) sums the squares of
the reduced slices; an updating pass hands each bucket to the rule (sgd.py, adalomo.py). A bucket
is applied only while `stats.finite` holds, decided on the device (a non-finite gradient is
zeroed, not read): no host sync. The update runs where the shard lives: on the accelerator, or in
host memory under `offload_param: {device: cpu}` (each shard's own device).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from lomo_ds.engine.update.int8 import Int8Shards
from lomo_ds.engine.update.rule import BuildContext, Cut, Items, PassSettings, PassStats, Rule
from lomo_ds.engine.update.sgd import SGD
from lomo_ds.engine.update.shard import ShardGeometries, ShardWeights, grad_sum_sq
from lomo_ds.runtime import ds_compat
from lomo_ds.runtime.shard_geometry import PIECES


class ShardUpdater:
    """This rank's shard weights and the rule that updates them, one pass at a time."""

    def __init__(self, stochastic_rounding: bool, seed: int, stats_device: torch.device,
                 geometry: ShardGeometries | None = None, rule: Rule | None = None, master_params=(),
                 chunk: int = 1 << 22, int8: Int8Shards | None = None):
        """`rule`: SGD by default; `master_params`: the parameters given an fp32 master copy;
        `int8`: the 8-bit path of the shards that carry scales (memory.int8_shards)."""
        self.geometry = geometry or ShardGeometries()
        self.shard = ShardWeights(self.geometry, stochastic_rounding, seed, master_params, chunk, int8)
        self.rule: Rule = rule if rule is not None else SGD()
        self.stats_device = stats_device
        self.settings = PassSettings()
        self.measuring = False

    @property
    def masters(self) -> dict[int, torch.Tensor]:
        return self.shard.masters

    def generator(self, device: torch.device) -> torch.Generator:
        return self.shard.generator(device)

    def begin_pass(self, settings: PassSettings, measure: bool = False, step: int | None = None) -> PassStats:
        """Start one pass: `measure` only sums squares (the first of two passes), else update by
        `settings`. `step` (the optimizer step) reseeds the rounding noise."""
        self.settings, self.measuring = settings, measure
        if step is not None:
            self.shard.reseed(step)
        return PassStats(self.stats_device)

    def apply_bucket(self, items: Items, stats: PassStats) -> None:
        if not self.measuring:
            self.rule.apply_bucket(self.shard, items, stats, self.settings)
            self.shard.settle([param for param, _ in items])  # 8-bit cut blocks: the same on every rank
            return
        for param, grad_shard in items:
            n = self.geometry(param).local
            if n:
                stats.sum_sq.add_(grad_sum_sq(grad_shard, n, self.shard.chunk).mul_(self.settings.grad_scale**2))

    def apply(self, param: torch.nn.Parameter, grad_shard, finite: torch.Tensor | bool) -> None:
        """One slice alone, as the host-update worker applies it (a rule that takes no whole bucket)."""
        self.rule.apply(self.shard, param, grad_shard, finite, self.settings)

    def slice_device(self, param: torch.nn.Parameter) -> torch.device:
        return self.rule.slice_device(param)

    def state_bytes(self) -> int:
        """The update's own memory on this rank: the fp32 masters and the rule's state."""
        return self.shard.master_bytes() + self.rule.state_bytes()

    # ----------------------------------------------------------------- resumable state
    def state_dict(self, module: torch.nn.Module, params: list) -> dict[str, Any]:
        """{"shards", "masters", "shapes"}: the shard weights by parameter name (ShardWeights');
        "rule": {"name": the rule's name, "state": its state (None: it keeps none)}; and PIECES
        (runtime/shard_geometry.py): which of these tensors are this rank's pieces of a global flat
        tensor (the shards, the masters, the rule's Cut state), which a checkpoint saves per rank
        and hands a run of another rank count its own slice of; the rest is replicated."""
        shard = self.shard.state_dict(module, params)
        numels = {name: math.prod(shape) for name, shape in shard["shapes"].items()}
        pieces = {(part, name): numels[name] for part in ("shards", "masters") for name in shard[part]}
        pieces.update({("rule", "state", *path): how.numel for path, how in self.rule.state_layout().items()
                       if isinstance(how, Cut)})
        return {**shard, "rule": {"name": self.rule.name, "state": self.rule.state_dict()}, PIECES: pieces}

    def check_state(self, state: dict[str, Any], module: torch.nn.Module, params: list) -> None:
        """Every refusal of a state (another rule's, by name first; another model's), from its names
        and shapes alone: a load that reads the tensors in place calls it before reading any. A
        state of the layout before rules were named is moved to this one in place (rule_entry)."""
        saved = rule_entry(state)
        if saved["name"] != self.rule.name:
            raise ValueError(f"lomo.optimizer: the checkpoint was written by the rule {saved['name']!r}, this run's "
                             f"is {self.rule.name!r}; a checkpoint resumes with the rule that wrote it (its state is "
                             f"that rule's): resume with lomo.optimizer {saved['name']!r}")
        self.shard.check_state(state, module, params)
        self.rule.check_state(saved["state"])

    def load_state_dict(self, state: dict[str, Any], module: torch.nn.Module, params: list) -> None:
        """Every refusal of the shards comes before anything is written."""
        state = dict(state)  # check_state may move the caller's old-layout entry: its own copy
        self.check_state(state, module, params)
        self.rule.load_state_dict(state["rule"]["state"])
        self.shard.load_state_dict(state, module)


# Before checkpoints stored the rule's state under the rule's name, every engine state held it under
# this key: AdaLomo's state, or None where SGD (the one other rule then) wrote it.
_UNNAMED = "adalomo"


def rule_entry(state: dict[str, Any]) -> dict[str, Any]:
    """The state's {"name", "state"} of the rule that wrote it. A state of the layout before it (the
    rule's state under "adalomo") is moved to this one in place, so that every checkpoint written
    then resumes as it did: as AdaLomo's where it holds a state, as SGD's where it holds None."""
    if "rule" not in state and _UNNAMED in state:
        old = state.pop(_UNNAMED)
        state["rule"] = {"name": "adalomo" if old else "sgd", "state": old}
    entry = state.get("rule")
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise ValueError(f"checkpoint's engine state has no rule entry ({{'name', 'state'}} under 'rule'; its keys: "
                         f"{sorted(state)}): not an engine state of lomo_ds")
    return entry


def build_updater(config, module: torch.nn.Module, params: list, group, dtype: torch.dtype, host,
                  device: torch.device) -> ShardUpdater:
    """The engine's updater from its EngineConfig: the rule lomo.optimizer names, built from its
    registry entry (config/rules.py) with its own options; fp32 masters where asked for and the
    weights are not fp32, rounding seeded by train.seed, chunks of memory.update_chunk_elements.
    `host`: the HostUpdates worker, or None; `device`: this rank's, where the pass statistics live."""
    lomo = config.lomo
    spec = lomo.rule
    geometries = ShardGeometries()
    ctx = BuildContext(lomo.rule_options, module, params, group, geometries, host=host, device=device)
    rule = spec.rule_class().build(ctx)
    if getattr(rule, "name", None) != spec.name:
        # The name is what its checkpointed state is stored and refused by: it must be the registry's.
        raise ValueError(f"lomo.optimizer: the rule registered as {spec.name!r} builds a rule named "
                         f"{getattr(rule, 'name', None)!r}; its class's `name` must be {spec.name!r}")
    masters = params if lomo.fp32_master_weights and dtype != torch.float32 else ()
    return ShardUpdater(lomo.stochastic_rounding, config.train.seed, device, geometries, rule, masters,
                        chunk=config.memory.update_chunk_elements, int8=int8_path(config, module, geometries, host))


def int8_path(config, module: torch.nn.Module, geometries: ShardGeometries, host) -> Int8Shards | None:
    """The 8-bit path where memory.int8_shards asks for it: noise keyed by train.seed and each
    parameter's index in module.named_parameters() (the same on every rank count)."""
    memory = config.memory
    if not getattr(memory, "int8_shards", False):
        return None
    if host is not None and any(host.holds(p) for p in module.parameters() if ds_compat.is_zero_param(p)):
        # The worker issues no collective, and a cut block's scale needs one (int8.py). A worker
        # that holds no shard (shards on the accelerator) takes no update; "auto" starts none with
        # 8-bit shards (host_updates.use_thread).
        raise ValueError("memory.host_update: the host-update worker (shards in host memory, offload_param: cpu, "
                         "with memory.host_update 'thread') is not supported with memory.int8_shards; set "
                         "memory.host_update: inline or auto")
    noise_ids = {ds_compat.param_id(p): i for i, (_, p) in enumerate(module.named_parameters())
                 if ds_compat.is_zero_param(p)}
    return Int8Shards(geometries, getattr(memory, "int8_block", 128), config.train.seed, noise_ids)
