"""Free the memory an engine holds, for a process that is done training but not done (the harness
on the export loads the whole model on rank 0's device next).

Dropping the last reference is not enough: DeepSpeed's module hooks, its parameter coordinator and
an engine's own closures keep the engine reachable, so its parameter shards, gathered parameters,
fp32 masters, optimizer state and bucket buffers would stay allocated. Instead every tensor
reachable from the engine is emptied in place (its storage replaced by an empty one on the same
device), then the accelerator's cache is emptied. The engine is unusable afterwards.

The walk follows the engine's own objects (lomo_ds, DeepSpeed, torch, transformers, peft) and
containers, and a tensor's attributes (ZeRO-3 keeps a parameter's shard on the parameter). It
leaves the communication layers alone (lomo_ds.comm, deepspeed.comm, torch.distributed): the ranks
still meet at a barrier after the harness.
"""
from __future__ import annotations

import gc
import types

import torch

_WALKED = ("lomo_ds.", "deepspeed.", "torch.", "transformers.", "peft.")
_KEPT = ("lomo_ds.comm", "deepspeed.comm", "torch.distributed")


def _walked(obj) -> bool:
    module = type(obj).__module__ or ""
    return module.startswith(_WALKED) and not module.startswith(_KEPT)


def held_tensors(root) -> list[torch.Tensor]:
    """Every tensor reachable from `root` along the walk the module docstring describes, once each."""
    seen, found, todo = set(), [], [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, types.FunctionType, types.ModuleType, str, bytes)):
            continue
        seen.add(id(obj))
        if torch.is_tensor(obj):
            found.append(obj)
            todo.extend(getattr(obj, "__dict__", {}).values())  # a ZeRO-3 parameter's ds_tensor
            if obj.is_leaf and obj.grad is not None:
                todo.append(obj.grad)
        elif isinstance(obj, dict):
            todo.extend(obj.keys())
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
        elif obj is root or _walked(obj):
            todo.extend(getattr(obj, "__dict__", {}).values())
    return found


def empty_held(root) -> dict[str, int]:
    """Empty every tensor `root` holds (module docstring) and the accelerator's cache; returns the
    bytes freed by device type ({"cuda": .., "cpu": ..}), each storage counted once (a tensor
    emptied before counts nothing)."""
    from deepspeed.accelerator import get_accelerator

    get_accelerator().synchronize()  # no kernel still reads what is freed
    freed: dict[str, int] = {}
    storages = set()
    with torch.no_grad():
        for t in held_tensors(root):
            storage = t.untyped_storage()
            key = (t.device, storage.data_ptr())
            if storage.nbytes() and key not in storages:
                storages.add(key)
                freed[t.device.type] = freed.get(t.device.type, 0) + storage.nbytes()
            if isinstance(t, torch.nn.Parameter):
                t.grad = None
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    gc.collect()
    get_accelerator().empty_cache()
    return freed
