"""The fused-update engine's sequence-memory options (memory.tiled_mlp, memory.offload_checkpoints,
lomo_ds/engine/sequence_memory.py): applied by that engine only, and offloading checkpoints needs
checkpointed layers."""
from __future__ import annotations

from lomo_ds.config.errors import ConfigError
from lomo_ds.config.methods import LOMO_METHODS


def check_engine_memory(cfg, loading) -> None:
    memory = [k for k in ("tiled_mlp", "offload_checkpoints") if getattr(cfg.memory, k)]
    if memory and cfg.train.method not in LOMO_METHODS:
        raise ConfigError(f"memory.{memory[0]}: applied by the fused-update engine (train.method {LOMO_METHODS}), "
                          f"not by {cfg.train.method!r}")


def check_offloaded_checkpoints(cfg, loading) -> None:
    if cfg.memory.offload_checkpoints and not cfg.model.gradient_checkpointing:
        raise ConfigError("memory.offload_checkpoints: needs model.gradient_checkpointing true (the checkpointed "
                          "layers' inputs are what it offloads)")
