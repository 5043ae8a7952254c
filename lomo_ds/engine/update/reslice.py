"""A rank's resumable state for another rank count, from the states N ranks wrote.

The files keep DeepSpeed ZeRO-3's own partition convention, which fixes where every element is
for any rank count: a parameter of n elements is cut into ceil(n / N) pieces, rank r holding
[r * ceil(n / N), ...) and zeros past the end (shard.py's ShardGeometry). So the concatenation of
the N pieces is the flat parameter whatever N was, and a rank of M reads its own range straight
from the files: no conversion step and no second copy of the checkpoint, as DeepSpeed's universal
checkpoints need. The files are memory-mapped (methods/base.py), so a rank reads only the pages
of its own range.

What is cut this way: the shards, the fp32 masters and AdaLomo's second moment of a vector
(`sq`, one value per element). Everything else in a rank's state is the same on every rank
(AdaLomo's row and column factors are replicated, the step counters and the loss scale are
agreed), and is taken from rank 0's.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from lomo_ds.engine.update.shard import ShardGeometry


def _sharded(state: dict[str, Any]):
    """(path, parameter name) of every tensor cut by ranks in one rank's state."""
    for group in ("shards", "masters"):
        for name in state.get(group) or {}:
            yield (group, name), name
    for name, moments in (state.get("adalomo") or {}).items():
        if "sq" in moments:
            yield ("adalomo", name, "sq"), name


def _at(node: Any, path: tuple) -> Any:
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _containers_copied(node: Any) -> Any:
    return {k: _containers_copied(v) for k, v in node.items()} if isinstance(node, dict) else node


def _range_of(numel: int, world: int, rank: int) -> tuple[int, int]:
    g = ShardGeometry(numel, world, rank)
    return g.start, g.start + g.local


def _piece(olds: Sequence[dict], path: tuple, numel: int, start: int, stop: int, length: int,
           dtype: torch.dtype) -> torch.Tensor:
    """Elements [start, stop) of the flat parameter, gathered from the old ranks' pieces, in a
    tensor of `length` (zeros past stop - start, as a shard's padding)."""
    # On the host, as the files' tensors are: the load copies it into the shard wherever that lives.
    out = torch.zeros(length, dtype=dtype, device="cpu")
    world = len(olds)
    part = math.ceil(numel / world)
    for r in range(start // part if part else 0, world):
        lo, hi = _range_of(numel, world, r)
        if lo >= stop:
            break
        a, b = max(lo, start), min(hi, stop)
        if a >= b:
            continue
        source = _at(olds[r], path)
        if source is None:
            raise ValueError(f"checkpoint rank file {r} has no {'.'.join(path)}")
        out[a - start:b - start].copy_(source[a - lo:b - lo])
    return out


def reslice(olds: Sequence[dict[str, Any]], template: dict[str, Any], numels: dict[str, int],
            world: int, rank: int) -> dict[str, Any]:
    """This rank's state (rank `rank` of `world`) from `olds`, the states ranks 0..N-1 wrote (in
    shard_state_dict's layout). `template`: this rank's own current state, for the keys and the
    tensors' lengths and dtypes; `numels`: each parameter's element count."""
    old_world = len(olds)
    for r, old in enumerate(olds):
        if old.get("world") != old_world or old.get("rank") != r:
            raise ValueError(f"checkpoint rank file {r} says rank {old.get('rank')} of {old.get('world')}; "
                             f"expected rank {r} of {old_world}")
    # Rank 0's state, its containers copied (their cut tensors are replaced below), its tensors not.
    out = _containers_copied(olds[0])
    out["world"], out["rank"] = world, rank
    for path, name in list(_sharded(out)):
        if name not in numels:
            continue  # a parameter this model lacks: refused by the load's own check
        target = _at(template, path)
        start, stop = _range_of(numels[name], world, rank)
        length = target.numel() if torch.is_tensor(target) else stop - start
        dtype = target.dtype if torch.is_tensor(target) else _at(out, path).dtype
        *parents, key = path
        _at(out, tuple(parents))[key] = _piece(olds, path, numels[name], start, stop, length, dtype)
    return out
