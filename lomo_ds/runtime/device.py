"""Where the engine's tensors live: one device per rank, and the device each collective takes.

DeepSpeed's accelerator names this rank's device (`cuda:<local rank>` on GPUs, `cpu` here). Every
tensor lomo_ds creates for training goes there, except the update of an offloaded shard, which
runs where the shard lives (see fused_update.py). Collectives take tensors on their group's
device: gloo reduces CPU tensors, NCCL only accelerator ones.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def accelerator_device() -> torch.device:
    """This rank's device, as DeepSpeed's accelerator names it."""
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def group_device(group=None) -> torch.device:
    """The device a collective on `group` takes its tensors on."""
    if torch.distributed.get_backend(group) == "gloo":
        return torch.device("cpu")
    return accelerator_device()


def move_batch(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """The batch's tensors on `device` (other values as they are). non_blocking: a copy from
    pinned host memory overlaps with the work already queued."""
    if not isinstance(batch, Mapping):
        raise TypeError(f"batch: expected a dict of tensors, got {type(batch).__name__}")
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def capture_rng(device: torch.device) -> dict[str, torch.Tensor]:
    """The random state a forward draws from (dropout): the CPU's and, on an accelerator, its own."""
    state = {"cpu": torch.get_rng_state()}
    if device.type != "cpu":
        from deepspeed.accelerator import get_accelerator

        state["device"] = get_accelerator().get_rng_state(device.index)
    return state


def restore_rng(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "device" in state and device.type != "cpu":
        from deepspeed.accelerator import get_accelerator

        get_accelerator().set_rng_state(state["device"], device.index)
