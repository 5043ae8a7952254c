"""The LOMO engine's resumable state in torch.distributed.checkpoint's layout, which does not depend on
the rank count that wrote it.

Each tensor a rank holds a piece of (the weight shards, the fp32 masters, AdaLomo's second moment of
a vector, `sq`) is saved as what it is: one piece of a global flat tensor of the parameter's numel
elements, a DTensor sharded on dimension 0. ZeRO-3 cuts a parameter of n elements into pieces of
ceil(n / N), rank r holding [r * ceil(n / N), ...), which is torch.chunk's cut and so DTensor's
Shard(0): the shard's real elements (its padding left out) are the DTensor's local tensor as they
are. The checkpoint's metadata then says where every element is, and a run of any rank count reads
its own ranges from whichever files hold them (torch.distributed.checkpoint's resharding): no
conversion step and no second copy, as DeepSpeed's universal checkpoints need.

Everything else in the state is the same on every rank (AdaLomo's row and column factors are
replicated, the step counters and the loss scale are agreed): rank 0 writes it once, beside the
pieces, as a plain torch file (REST) read with weights_only. Kept out of torch.distributed.checkpoint,
whose deduplication would leave each such entry in one rank's file, which is not on every node where
nodes share no disk (the Trainer's save_on_each_node), and whose reader unpickles non-tensor entries
without weights_only. The rank and world fields are not saved; a load gives this run's.

Keys are the state's paths joined by "/" (parameter names hold dots, never slashes), so what is on
disk is readable by key (`shards/model.layers.0.mlp.up_proj.weight`).

The collectives go through the gloo group the disk waits use (runtime.dist.io_group): its timeout
is output.io_timeout's, and its tensors are host tensors, as the files' are. Host-resident tensors
(every one on a CPU run, offloaded shards and masters on an accelerator) are written from and read
into in place; a device-resident shard passes through a host copy.
"""
from __future__ import annotations

import os
import pickle
from typing import Any, Iterator

import torch

from lomo_ds.engine.update.shard import ShardGeometry
from lomo_ds.runtime.dist import io_group
from lomo_ds.storage.checkpoint import CheckpointError, write_atomic

STATE_DIR = "engine_state"  # the folder inside a checkpoint
REST = "replicated.pt"  # inside it: what every rank holds the same, written once
SEP = "/"
_RANK_FIELDS = ("world", "rank")


def state_dir(directory: str) -> str:
    return os.path.join(directory, STATE_DIR)


def has_state(directory: str) -> bool:
    """Whether `directory` holds an engine state in this layout (its metadata is written last)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    try:
        FileSystemReader(state_dir(directory)).read_metadata()
    except (FileNotFoundError, OSError):
        return False
    return True


def _flatten(node: Any, prefix: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from _flatten(value, (*prefix, str(key)))
    else:
        yield prefix, node


def _unflatten(flat: dict[tuple, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def _is_cut(path: tuple) -> bool:
    """Whether the tensor at `path` of shard_state_dict's layout is one rank's piece of a parameter."""
    return (len(path) == 2 and path[0] in ("shards", "masters")) or (
        len(path) == 3 and path[0] == "adalomo" and path[2] == "sq")


def _mesh(group):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, "cpu")


def _piece(local: torch.Tensor, numel: int, world: int, rank: int, mesh):
    """`local` (this rank's shard, padding included) as its piece of the flat global tensor."""
    from torch.distributed.tensor import DTensor, Shard

    real = ShardGeometry(numel, world, rank).local
    if local.numel() < real:
        raise ValueError(f"a shard of {local.numel()} elements for {real} of a {numel}-element parameter")
    return DTensor.from_local(local.reshape(-1)[:real], mesh, [Shard(0)], run_check=False,
                              shape=torch.Size([numel]), stride=(1,))


def _numel(state: dict[str, Any], name: str) -> int:
    shape = (state.get("shapes") or {}).get(name)
    if shape is None:
        raise ValueError(f"engine state has no shape for {name!r}: it cannot be saved for another rank count")
    numel = 1
    for d in shape:
        numel *= int(d)
    return numel


def _split(state: dict[str, Any]) -> tuple[dict[tuple, torch.Tensor], dict[str, Any]]:
    """(the rank's pieces by path, the rest of the state with them left out)."""
    cut, rest = {}, {}
    for path, value in _flatten({k: v for k, v in state.items() if k not in _RANK_FIELDS}):
        if torch.is_tensor(value) and _is_cut(path):
            cut[path] = value
        else:
            rest[path] = value
    return cut, _unflatten(rest)


def save_engine_state(directory: str, state: dict[str, Any], io_timeout: float,
                      every_node: bool = False, group=None) -> None:
    """Collective: write `state` (LomoEngine.shard_state_dict's) into `directory`/engine_state: the
    pieces through torch.distributed.checkpoint, the rest (the same on every rank) by rank 0 into
    REST. `every_node`: this rank also writes the metadata and REST (the Trainer's
    save_on_each_node, where every node's first rank keeps a loadable copy on a disk no other node
    shares). `group`: the ranks writing (io_group's, all of them, where None)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    world, rank = state["world"], state["rank"]
    group = group or io_group(io_timeout)
    mesh = _mesh(group)
    cut, rest = _split(state)
    pieces = {}
    for path, value in cut.items():
        # The group is gloo: the pieces it plans over are host tensors.
        value = value.detach() if value.device.type == "cpu" else value.detach().cpu()
        pieces[SEP.join(path)] = _piece(value, _numel(state, path[1]), world, rank, mesh)
    folder = state_dir(directory)
    os.makedirs(folder, exist_ok=True)
    if rank == 0 or every_node:
        write_atomic(os.path.join(folder, REST), lambda f: torch.save(rest, f))
    metadata = dcp.save(pieces, storage_writer=FileSystemWriter(folder, sync_files=True), process_group=group)
    if every_node and rank != 0:
        from torch.distributed.checkpoint.storage import WriteResult

        results = [[WriteResult(index=i, size_in_bytes=0, storage_data=d) for i, d in metadata.storage_data.items()]]
        FileSystemWriter(folder, sync_files=True).finish(metadata, results)


def _read_rest(folder: str) -> dict[str, Any]:
    # weights_only: a checkpoint from anywhere else must not run code on every rank.
    path = os.path.join(folder, REST)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path}: refused: it holds more than tensors, numbers, strings and containers "
                              f"(a weights_only load; {str(e).splitlines()[0][:80]})") from None


def _load(state: dict[str, Any], reader, group) -> None:
    """torch.distributed.checkpoint's load into `state`; a failure on any rank (every rank hears of
    it) as a CheckpointError naming the folder and the first rank's cause."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=reader, process_group=group)
    except CheckpointException as e:
        rank, failure = sorted(e.failures.items())[0]
        cause = failure[0] if isinstance(failure, tuple) else failure
        raise CheckpointError(f"{reader.path}: rank {rank} could not read it: {type(cause).__name__}: "
                              f"{str(cause).splitlines()[0] if str(cause) else ''}") from None


def read_engine_state(directory: str, template: dict[str, Any], check, io_timeout: float,
                      group=None) -> dict[str, Any]:
    """Collective: the state in `directory`/engine_state for this rank, in shard_state_dict's layout,
    written by any rank count. `template`: this rank's own shard_state_dict (its keys, lengths and
    dtypes; host tensors in it are read into in place). `check(state)`: refuses a state that does not
    fit this run, called with the checkpoint's parameter names, shapes and counters (the pieces
    named, not yet read) before any piece is read. `group`: as save_engine_state's."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    world, rank = template["world"], template["rank"]
    group = group or io_group(io_timeout)
    folder = state_dir(directory)
    reader = FileSystemReader(folder)
    saved = reader.read_metadata().state_dict_metadata
    flat = dict(_flatten(_read_rest(folder)))
    flat.update({tuple(k.split(SEP)): None for k in saved})  # named, not read yet
    check(_unflatten(flat))
    mine, _ = _split(template)
    mesh, reads = _mesh(group), {}
    for key, meta in saved.items():
        path = tuple(key.split(SEP))
        target = mine.get(path)
        if target is None:
            del flat[path]  # kept by the writing run, not by this one (fp32 masters it does not keep)
            continue
        host = target if target.device.type == "cpu" else torch.zeros_like(target, device="cpu")
        reads[key] = _piece(host, meta.size[0], world, rank, mesh)
        flat[path] = host
    _load(reads, reader, group)
    state = _unflatten(flat)
    state["world"], state["rank"] = world, rank
    return state
