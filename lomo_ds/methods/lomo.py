"""LOMO: lomo_ds's own engine behind the method interface."""
from __future__ import annotations

from typing import Any

import torch

from lomo_ds.config.lomo import EngineConfig, Precision
from lomo_ds.engine.lomo_engine import LomoEngine
from lomo_ds.engine.update.reslice import reslice
from lomo_ds.engine.update.shard import check_shapes
from lomo_ds.methods.base import MethodEngine, load_rank_state, save_rank_state
from lomo_ds.runtime import ds_compat
from lomo_ds.runtime.memory import MemoryTracker


def load_engine_state(engine: LomoEngine, directory: str) -> dict[str, Any]:
    """This rank's rank-state file from `directory`, written by this rank count or by any other: the
    shards cut again for this one (engine/update/reslice.py), the rest as rank 0 wrote it. The
    recipe's and the Trainer's resume both read through here."""
    # This rank's own file first: with save_on_each_node a node's folder holds its own ranks' alone.
    try:
        mine = load_rank_state(directory, engine.rank)
    except FileNotFoundError:
        mine = None  # a rank the writing run did not have
    if mine is not None and mine["lomo"]["world"] == engine.world:
        return mine
    written = (mine or load_rank_state(directory, 0))["lomo"]["world"]
    files = [load_rank_state(directory, r) for r in range(written)]
    check_shapes(files[0]["lomo"], engine.module)  # before any range is read for this model
    numels = {n: ds_compat.full_numel(p) for n, p in engine.module.named_parameters()}
    return {**files[0], "lomo": reslice([f["lomo"] for f in files], engine.shard_state_dict(), numels,
                                        engine.world, engine.rank)}


class LomoMethodEngine(MethodEngine):
    method = "lomo"
    reshards = True  # resumes from a checkpoint of another rank count (load_state)

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
        save_rank_state(directory, self.rank, self.state_dict())

    def load_state(self, directory: str) -> None:
        self.load_state_dict(load_engine_state(self.engine, directory))

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
        return self.engine.updater.state_bytes()  # the fp32 masters and the update rule's state
