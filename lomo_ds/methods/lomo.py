"""LOMO: lomo_ds's own engine behind the method interface."""
from __future__ import annotations

from typing import Any

import torch

from lomo_ds.config.engine_config import EngineConfig, Precision
from lomo_ds.engine.lomo_engine import LomoEngine
from lomo_ds.methods.base import MethodEngine, load_rank_state, save_rank_state
from lomo_ds.methods.release import merge_freed
from lomo_ds.runtime.memory import MemoryTracker
from lomo_ds.storage.checkpoint import IO_TIMEOUT_S
from lomo_ds.storage.engine_state import has_state, read_engine_state, save_engine_state


def load_engine_state(engine: LomoEngine, directory: str, io_timeout: float = IO_TIMEOUT_S) -> dict[str, Any]:
    """The engine's state in `directory` for this rank (shard_state_dict's layout), written by this
    rank count or any other (torch.distributed.checkpoint's layout, storage/engine_state.py); or a
    rank file of the layout before it, on the rank count that wrote it. The recipe's and the
    Trainer's resume both read through here."""
    if has_state(directory):
        def check(state):  # another model's, or one the run's settings cannot take: before any read
            engine.check_state(state)
        return read_engine_state(directory, engine.shard_state_dict(), check, io_timeout)
    state = load_rank_state(directory, engine.rank)["lomo"]
    if state["world"] != engine.world:
        raise ValueError(f"{directory}: rank files of {state['world']} ranks (written before {directory}/"
                         f"engine_state existed) resume on {state['world']} ranks only, this run has {engine.world}")
    return state


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

    # ----------------------------------------------------------------- resume
    # The engine's state goes into the checkpoint's engine_state/ (any rank count resumes it); what
    # a subclass adds to state_dict (LoRA+LOMO's adapters and their optimizer, the same on every
    # rank) into this rank's rank file, which a rank the writing run did not have reads from rank 0's.
    io_timeout = IO_TIMEOUT_S  # output.io_timeout where the recipe builds the engine

    def state_dict(self) -> dict[str, Any]:
        return {"lomo": self.engine.shard_state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.engine.load_shard_state_dict(state["lomo"])

    def save_state(self, directory: str) -> None:
        state = self.state_dict()
        save_engine_state(directory, state.pop("lomo"), self.io_timeout)
        if state:
            save_rank_state(directory, self.rank, state)

    def load_state(self, directory: str) -> None:
        state = {"lomo": load_engine_state(self.engine, directory, self.io_timeout)}
        if set(self.state_dict()) - {"lomo"}:
            try:
                state.update(load_rank_state(directory, self.rank))
            except FileNotFoundError:
                state.update(load_rank_state(directory, 0))  # a rank the writing run did not have
        self.load_state_dict(state)

    def release(self) -> dict[str, int]:
        """The LomoEngine frees what it owns (LomoEngine.release); what the method holds beside it
        (LoRA+LOMO's adapters' masters and their optimizer) goes the generic way."""
        return merge_freed(self.engine.release(), super().release())

    # ----------------------------------------------------------------- memory accounting
    def _make_tracker(self) -> MemoryTracker:
        return self.engine.enable_memory_tracking()

    def _grad_bytes(self) -> int:
        # The shard accumulator (accumulation_steps > 1) is held all the time, on the device; in
        # host memory with memory.accumulate_on "cpu" on an accelerator, where it is not GPU memory.
        held = self.engine.accumulator_bytes(self.device)
        if self.tracker is None or not self.tracker.samples:
            return held
        return held + self.tracker.peak.grad_bytes + self.tracker.peak.bucket_bytes

    def _optimizer_bytes(self) -> int:
        return self.engine.state_bytes()  # the fp32 masters and the update rule's state
