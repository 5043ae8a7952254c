"""The interface every training method implements, and what the methods share.

    engine.train_step(batch)      # one optimizer step -> {"loss", "lr", "grad_norm", "skipped", "loss_scale"}
    engine.eval_forward(batch)    # the model's outputs, no gradients
    engine.full_state_dict()      # collective: full parameters on rank 0 (None elsewhere)
    engine.save_state(directory)  # collective: every rank writes its part of a resumable checkpoint
    engine.load_state(directory)  # collective: every rank reads its part back
    engine.supports_resume        # whether save_state/load_state exist for this method

LOMO's engines (LOMO, LoRA+LOMO) write their engine's state (LomoEngine.shard_state_dict(): the
rank's shards, fp32 masters, the update rule's state, the step counters) into the checkpoint's
`engine_state/` (lomo_ds.storage.engine_state: torch.distributed.checkpoint's layout, resumable on
any rank count); what a method adds (LoRA+LOMO's adapters and their optimizer) goes into one file
per rank, `rank_NNNNN.pt` (save_rank_state). load_rank_state also reads what the Trainer
integration wrote before, `lomo_rank_NNNNN.pt` holding the engine's state alone.

Resume goes through a directory rather than a state dict because DeepSpeed's own optimizers
checkpoint themselves (`save_checkpoint` writes its files into a directory); lomo_ds.storage.checkpoint
hands every method a staging directory and makes the whole checkpoint appear atomically.

Memory accounting (per rank, bytes; the same rules for every method)
--------------------------------------------------------------------
On CUDA the caching allocator's `max_memory_allocated` is reported beside the accounting
(`cuda_peak`). On a CPU there is no allocator to ask, so the categories are counted from the
tensors each method holds:

  params            this rank's parameter shards (ZeRO-3 `ds_tensor`) + the peak of gathered full
                    parameters (persistent small parameters included), sampled at every gradient
                    hook of the backward pass by lomo_ds.runtime.memory.MemoryTracker.
  grads             gradient memory held: DeepSpeed's gradient shard buffer, reduce buckets and
                    step-time fp32 copy; LOMO's `.grad` alive + the reduce-scatter bucket in flight;
                    LoRA+LOMO also the adapters' gradients.
  optimizer_states  fp32 master copies that are not the parameter shard itself + every tensor in a
                    torch optimizer's `state` (AdaLomo's: its second moments and step counts). As in
                    the paper's Table 1 the fp32 masters count here.
  activations       bytes of the unique storages autograd saves during the forward pass
                    (lomo_ds.runtime.memory.ActivationCounter), parameters excluded.
  total             the sum of the four; peak_rss (the process's resident peak) is an upper bound beside it.
"""
from __future__ import annotations

import os
from typing import Any, Protocol, runtime_checkable

import torch

from lomo_ds.engine.release import empty_held
from lomo_ds.runtime import ds_compat
from lomo_ds.runtime.device import accelerator_device, move_batch
from lomo_ds.runtime.dist import gather_full_state_dict, init_distributed
from lomo_ds.runtime.memory import ActivationCounter, MemoryTracker, breakdown, tensor_bytes
from lomo_ds.storage.checkpoint import write_atomic

RANK_STATE = "rank_{:05d}.pt"
# What the Trainer integration wrote before it used RANK_STATE: the engine's state alone, unwrapped.
OLD_TRAINER_STATE = "lomo_rank_{:05d}.pt"


@runtime_checkable
class Engine(Protocol):
    method: str
    module: torch.nn.Module
    device: torch.device
    rank: int
    world: int
    global_step: int  # optimizer steps
    supports_resume: bool
    accumulation_steps: int  # micro-batches per optimizer step (gradient_accumulation_steps)

    def train_step(self, batch: dict[str, Any]) -> dict[str, Any]:
        """One micro-batch; the result's "stepped" says whether it ended an optimizer step."""

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next train_step ends an optimizer step (DeepSpeed's name)."""

    def start_window(self, micro_batches: int) -> None:
        """The window now starting has `micro_batches` (<= accumulation_steps) micro-batches."""

    def eval_forward(self, batch: dict[str, Any]) -> Any: ...

    def full_state_dict(self) -> dict[str, torch.Tensor] | None: ...

    def save_state(self, directory: str) -> None: ...

    def load_state(self, directory: str) -> None: ...


def rank_state_file(directory: str, rank: int) -> str:
    return os.path.join(directory, RANK_STATE.format(rank))


def save_rank_state(directory: str, rank: int, state: dict[str, Any]) -> None:
    """Write this rank's state file (the module docstring's layout), atomically."""
    write_atomic(rank_state_file(directory, rank), lambda f: torch.save(state, f))


def load_rank_state(directory: str, rank: int) -> dict[str, Any]:
    """This rank's state file, in the layout save_rank_state writes (an old Trainer file converted)."""
    path = rank_state_file(directory, rank)
    old = os.path.join(directory, OLD_TRAINER_STATE.format(rank))
    if not os.path.exists(path) and os.path.exists(old):
        return {"lomo": _load(old)}
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: missing state file for rank {rank}")
    return _load(path)


def _load(path: str) -> dict[str, Any]:
    # Memory-mapped: each tensor is read from the file as it is copied into its shard, so a rank
    # never holds its whole state in host memory. weights_only: a checkpoint directory from
    # anywhere else must not run code on every rank (tensors, numbers, strings and containers only).
    return torch.load(path, map_location="cpu", mmap=True, weights_only=True)


class MethodEngine:
    """What every method shares: device, batch placement, evaluation, the memory breakdown."""

    method = "base"
    supports_resume = True
    reshards = False  # whether load_state takes a state written by another rank count
    accumulation_steps = 1
    module: torch.nn.Module
    params: list  # what the memory tracker samples
    rank: int
    world: int
    group = None

    def __init__(self):
        init_distributed()  # sets this rank's accelerator before its device is read
        self.device = accelerator_device()
        self.tracker: MemoryTracker | None = None
        self.activations: ActivationCounter | None = None

    def is_gradient_accumulation_boundary(self) -> bool:
        return True

    def start_window(self, micro_batches: int) -> None:
        if micro_batches != 1:
            raise ValueError(f"start_window: train.method={self.method!r} takes one micro-batch per step, "
                             f"got {micro_batches}")

    @torch.no_grad()
    def eval_forward(self, batch: dict[str, Any]):
        self.module.eval()
        return self.module(**move_batch(batch, self.device))

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        return gather_full_state_dict(self.module, self.rank)

    def save_state(self, directory: str) -> None:
        raise NotImplementedError(f"train.method={self.method!r} has nothing to resume")

    def load_state(self, directory: str) -> None:
        raise NotImplementedError(f"train.method={self.method!r} has nothing to resume")

    def release(self) -> dict[str, int]:
        """Free every tensor this method's engine holds, in place (lomo_ds/engine/release.py: its
        shards, gathered parameters, optimizer state, buffers); returns the bytes freed by device
        type. The engine is unusable afterwards."""
        return empty_held(self)

    # ----------------------------------------------------------------- memory accounting
    def enable_memory_tracking(self) -> MemoryTracker:
        self.activations = ActivationCounter(self.module)
        self.tracker = self._make_tracker()
        return self.tracker

    def _make_tracker(self) -> MemoryTracker:
        return MemoryTracker(self.params)

    def reset_memory(self) -> None:
        if self.tracker is not None:
            self.tracker.reset()
        if self.activations is not None:
            self.activations.reset()

    def all_params(self) -> list:
        return list(self.module.parameters())  # a tied tensor once

    def _param_bytes(self) -> int:
        if self.tracker is not None and self.tracker.samples:
            return self.tracker.peak_param_bytes - self.tracker.master_bytes
        return sum(tensor_bytes(ds_compat.shard(p)) if ds_compat.is_zero_param(p) else tensor_bytes(p.data)
                   for p in self.all_params())

    def _grad_bytes(self) -> int:
        return 0

    def _optimizer_bytes(self) -> int:
        return 0

    def memory_breakdown(self) -> dict[str, int]:
        """Per-rank peak bytes by category (rules in this module's docstring)."""
        return breakdown(self._param_bytes(), self._grad_bytes(), self._optimizer_bytes(),
                         self.activations.peak if self.activations is not None else 0)
