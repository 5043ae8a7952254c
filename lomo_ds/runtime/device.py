"""Where the engine's tensors live: one device per rank, and the device each collective takes.

DeepSpeed's accelerator names this rank's device (`cuda:<local rank>` on GPUs, `cpu` here). Every
tensor lomo_ds creates for training goes there, except the update of an offloaded shard, which
runs where the shard lives (see lomo_ds/engine/update/shard.py). Collectives take tensors on their group's
device: gloo reduces CPU tensors, NCCL only accelerator ones.

LOMO_DS_EMULATE_DEVICE_COPY=1 (tests): host_resident says no tensor is in host memory, so a CPU run
takes the path an accelerator's shards take through a checkpoint, host copies included, and the CPU
suite tests that path and measures its host memory.
"""
from __future__ import annotations

# DeepSpeed, transformers, safetensors and peft are imported inside the functions that use them: the
# CLI and the config checks start without them, and recipe/train.py's show_what_matters sets the
# ranks' logging before their first import.
import os
from collections.abc import Mapping
from typing import Any

import torch


def set_rank_device() -> None:
    """Make this rank's accelerator the current device, from the launcher's LOCAL_RANK. Nothing
    else does so before DeepSpeed's engine: torch's init_process_group does not, and a plain model
    (not built under zero.Init) reaches lomo_ds with every rank on device 0."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is not None and accelerator.device_name() != "cpu":
        accelerator.set_device(int(local_rank))


EMULATE_DEVICE_COPY = "LOMO_DS_EMULATE_DEVICE_COPY"


def host_resident(t: torch.Tensor) -> bool:
    """Whether `t` lives in host memory, where a checkpoint writes it from and reads it into in
    place; anything else (an accelerator's shard) needs a host copy to reach a file. The one place
    that decides it, so that LOMO_DS_EMULATE_DEVICE_COPY=1 can say False for every tensor: on a
    CPU run the storage code then copies as it does on a GPU, and the CPU suite sees those copies."""
    return t.device.type == "cpu" and os.environ.get(EMULATE_DEVICE_COPY) != "1"


def accelerator_device() -> torch.device:
    """This rank's device, as DeepSpeed's accelerator names it (cuda:LOCAL_RANK on GPUs once
    set_rank_device has run, cpu here)."""
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def record_event(device: torch.device):
    """An event recorded now on `device`'s current stream (None on a CPU, where work is done when
    the call returns): what waits for work queued so far, without waiting for the whole device."""
    if device.type in ("cpu", "meta"):
        return None
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    event = accelerator.Event()
    event.record(accelerator.current_stream(device))
    return event


def set_cpu_threads(device: torch.device) -> str:
    """On a CPU rank, give torch this process's cores / the ranks on this node as intra-op threads
    (else every rank starts one thread per core and they fight over them), unless OMP_NUM_THREADS
    is set: by the user, by DeepSpeed's --bind_cores_to_rank, or by torch.distributed.run. Returns
    what was decided, for the run's first log line."""
    if device.type != "cpu":
        return f"{device.type} ranks"
    if os.environ.get("OMP_NUM_THREADS"):
        return f"{torch.get_num_threads()} torch thread(s) per rank (OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']})"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    # The launcher's count of ranks on this node (DeepSpeed's LOCAL_SIZE, torchrun's LOCAL_WORLD_SIZE).
    local = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 1)
    threads = max(1, cores // local)
    torch.set_num_threads(threads)
    return (f"{threads} torch thread(s) per rank ({cores} cores / {local} ranks on this node; "
            "set OMP_NUM_THREADS to choose)")


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
