"""LOMO: lomo_ds's own engine behind the method interface."""
from __future__ import annotations

from typing import Any

import torch

from lomo_ds.config.lomo import EngineConfig, Precision
from lomo_ds.engine.lomo_engine import LomoEngine
from lomo_ds.methods.base import MethodEngine, load_rank_state, rank_state_file
from lomo_ds.runtime.memory import MemoryTracker, tensor_bytes
from lomo_ds.storage.checkpoint import write_atomic


class LomoMethodEngine(MethodEngine):
    method = "lomo"

    def __init__(self, model: torch.nn.Module, ds_config: dict, config: EngineConfig, total_steps: int,
                 precision: Precision | None = None):
        super().__init__()
        self.engine = LomoEngine(model, ds_config, config, total_steps=total_steps, precision=precision)
        self.module = self.engine.module
        self.params = self.engine.params
        self.group = self.engine.group
        self.world, self.rank = self.engine.world, self.engine.rank
        self.accumulation_steps = self.engine.accumulation_steps

    @property
    def global_step(self) -> int:
        return self.engine.global_step

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.engine.is_gradient_accumulation_boundary()

    def start_window(self, micro_batches: int) -> None:
        self.engine.start_window(micro_batches)

    def train_step(self, batch: dict[str, Any]) -> dict[str, Any]:
        return self.engine.train_step(batch)  # the engine moves the batch to its device

    def eval_forward(self, batch: dict[str, Any]):
        return self.engine.eval_forward(batch)

    def full_state_dict(self):
        return self.engine.full_state_dict()

    # ----------------------------------------------------------------- resume: one file per rank
    def state_dict(self) -> dict[str, Any]:
        return {"lomo": self.engine.shard_state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.engine.load_shard_state_dict(state["lomo"])

    def save_state(self, directory: str) -> None:
        state = self.state_dict()
        write_atomic(rank_state_file(directory, self.rank), lambda f: torch.save(state, f))

    def load_state(self, directory: str) -> None:
        self.load_state_dict(load_rank_state(directory, self.rank))

    # ----------------------------------------------------------------- memory accounting
    def _make_tracker(self) -> MemoryTracker:
        return self.engine.enable_memory_tracking()

    def _grad_bytes(self) -> int:
        # The shard accumulator (accumulation_steps > 1) is held all the time, on the device; in
        # host memory with memory.accumulate_on "cpu" on an accelerator, where it is not GPU memory.
        acc = self.engine.accumulator
        held = acc.nbytes() if acc is not None and next(iter(acc.buffers.values())).device == self.device else 0
        if self.tracker is None or not self.tracker.samples:
            return held
        return held + self.tracker.peak.grad_bytes + self.tracker.peak.bucket_bytes

    def _optimizer_bytes(self) -> int:
        adalomo = self.engine.updater.adalomo
        return (sum(tensor_bytes(m) for m in self.engine.updater.masters.values())
                + (adalomo.state_bytes() if adalomo is not None else 0))
