"""The LOMO engine's resumable state in torch.distributed.checkpoint's layout, which does not depend on
the rank count that wrote it.

Each tensor a rank holds a piece of is saved as what it is: one piece of a global flat tensor of its
parameter's numel elements, a DTensor sharded on dimension 0. Which tensors those are, the state says
itself: its PIECES entry (runtime/shard_geometry.py) names each by its path and global numel (the
engine puts in its weight shards, its fp32 masters and whatever state its update rule declares cut);
nothing here knows a rule. ZeRO-3 cuts a parameter of n elements into pieces of ceil(n / N), rank
r holding [r * ceil(n / N), ...) (ShardGeometry), which is torch.chunk's cut and so DTensor's
Shard(0): the shard's real elements (its padding left out) are the DTensor's local tensor as they
are. The checkpoint's metadata then says where every element is, and a run of any rank count reads
its own ranges from whichever files hold them (torch.distributed.checkpoint's resharding): no
conversion step and no second copy, as DeepSpeed's universal checkpoints need.

Everything else in the state is the same on every rank (a rule's replicated state, the step counters
and the loss scale): rank 0 writes it once, beside the pieces, as a plain torch file (REST) read
with weights_only. A load refuses a checkpoint that cut a tensor otherwise than the reading state
declares (_check_cut_alike). Kept out of torch.distributed.checkpoint,
whose deduplication would leave each such entry in one rank's file, which is not on every node where
nodes share no disk (the Trainer's save_on_each_node), and whose reader unpickles non-tensor entries
without weights_only. The rank and world fields are not saved; a load gives this run's.

Keys are the state's paths joined by "/" (parameter names hold dots, never slashes), so what is on
disk is readable by key (`shards/model.layers.0.mlp.up_proj.weight`).

The collectives go through the gloo group the disk waits use (runtime.dist.io_group): its timeout
is output.io_timeout's, and its tensors are host tensors, as the files' are.

Host memory: one piece at a time, never the rank's whole state. The planning takes each piece as a
DTensor on that gloo ("cpu") mesh whose local tensor is a stand-in: a host tensor of the piece's
length and dtype over one element (expand), which gives the planners the shapes and offsets they
plan from without a copy of the data (a device tensor would be copied to the mesh's device whole,
and a meta one is materialised by the load planner). The data goes through the planners' own hooks,
which the file writer and reader call one item after another:
- save (PieceSaver.resolve_data, in _planners): a host-resident piece (on a CPU run, offloaded shards and masters
  on an accelerator) is written as it is; any other (a device-resident shard, or a padded shard's
  real part, a view the writer would clone) through a host copy of that one piece. The writer keeps
  every tensor it was handed until its file is closed (for the safetensors format, which this does
  not write), so the planner frees the previous copy's memory when asked for the next piece:
  FileSystemWriter with thread_count=1 and per_thread_copy_ahead=0 asks for a piece only after
  writing the one before. A writer that asked ahead would have written a freed copy:
  _check_written refuses such a checkpoint by its recorded lengths.
- load (PieceLoader.resolve_tensor): the reader copies each item it read from the file (a host
  tensor) straight into the destination's range of the live tensor, wherever it lives; nothing else
  is allocated.
runtime.device.host_resident decides what is host memory; LOMO_DS_EMULATE_DEVICE_COPY=1 makes a CPU
run copy as an accelerator's does (tests/host_memory.py measures both).
"""
from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from lomo_ds.runtime.device import host_resident
from lomo_ds.runtime.dist import io_group
from lomo_ds.runtime.shard_geometry import PIECES, ShardGeometry
from lomo_ds.storage.checkpoint import CheckpointError, write_atomic

STATE_DIR = "engine_state"  # the folder inside a checkpoint
REST = "replicated.pt"  # inside it: what every rank holds the same, written once
SEP = "/"
_RANK_FIELDS = ("world", "rank")
_NOT_SAVED = (*_RANK_FIELDS, PIECES)  # PIECES: this run's declaration; a load goes by the reading run's


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


def _mesh(group):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, "cpu")


def _piece(local: torch.Tensor, numel: int, world: int, rank: int) -> torch.Tensor:
    """The real elements of `local` (this rank's shard, padding included): its piece of the flat
    global tensor of `numel` elements."""
    real = ShardGeometry(numel, world, rank).local
    if local.numel() < real:
        raise ValueError(f"a shard of {local.numel()} elements for {real} of a {numel}-element parameter")
    return local.detach().reshape(-1)[:real]


def _planned(piece: torch.Tensor, numel: int, mesh):
    """A DTensor the planners plan `piece` from: its length, dtype and place in the global tensor,
    over a one-element host stand-in (the data goes through the planners' hooks, not through it)."""
    from torch.distributed.tensor import DTensor, Shard

    stand_in = torch.empty(1, dtype=piece.dtype, device="cpu").expand(piece.numel())
    return DTensor.from_local(stand_in, mesh, [Shard(0)], run_check=False, shape=torch.Size([numel]), stride=(1,))


def _planners():
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

    class PieceSaver(DefaultSavePlanner):
        """Hands the writer each piece as a host tensor, copying only the one being written."""

        def __init__(self, pieces: dict[str, torch.Tensor]):
            super().__init__()
            self.pieces, self.copy, self.copied = pieces, None, {}

        def resolve_data(self, write_item):
            if self.copy is not None:  # written: the writer asks for a piece after writing the last
                self.copy.untyped_storage().resize_(0)
                self.copy = None
            piece = self.pieces[write_item.index.fqn]
            if host_resident(piece) and piece.untyped_storage().nbytes() == piece.nbytes:
                return piece
            self.copy = piece.to("cpu", copy=True)
            self.copied[write_item.index] = piece.nbytes
            return self.copy

    class PieceLoader(DefaultLoadPlanner):
        """Reads each item into its range of the live tensor, wherever that lives."""

        def __init__(self, pieces: dict[str, torch.Tensor]):
            super().__init__()
            self.pieces = pieces

        def resolve_tensor(self, read_item):
            return self.transform_tensor(read_item, self.pieces[read_item.dest_index.fqn])  # its range

    return PieceSaver, PieceLoader


def _check_written(metadata, copied: dict, folder: str) -> None:
    """Refuse a checkpoint in which a copied piece was not written whole (a writer that asked for a
    piece before writing the one before it would have written a freed copy)."""
    for index, nbytes in copied.items():
        info = metadata.storage_data.get(index)
        if info is not None and info.length < nbytes:
            raise CheckpointError(f"{folder}: {index.fqn} was written as {info.length} bytes of its {nbytes}: "
                                  "torch.distributed.checkpoint's writer asked for pieces ahead of writing them")


def _split(state: dict[str, Any]) -> tuple[dict[tuple, tuple[torch.Tensor, int]], dict[str, Any]]:
    """({path: (the rank's piece, its global numel)} for every tensor the state's PIECES declares,
    the rest of the state with them left out)."""
    declared = state.get(PIECES) or {}
    cut, rest = {}, {}
    for path, value in _flatten({k: v for k, v in state.items() if k not in _NOT_SAVED}):
        if path in declared:
            if not torch.is_tensor(value):
                raise ValueError(f"engine state declares {SEP.join(path)!r} one rank's piece of a tensor, and it "
                                 f"holds {type(value).__name__}")
            cut[path] = (value, int(declared[path]))
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
    pieces, planned = {}, {}
    for path, (value, numel) in cut.items():
        key = SEP.join(path)
        pieces[key] = _piece(value, numel, world, rank)
        planned[key] = _planned(pieces[key], numel, mesh)
    folder = state_dir(directory)
    os.makedirs(folder, exist_ok=True)
    if rank == 0 or every_node:
        write_atomic(os.path.join(folder, REST), lambda f: torch.save(rest, f))
    saver = _planners()[0](pieces)
    # One thread, nothing copied ahead: the writer asks for a piece after writing the one before.
    writer = FileSystemWriter(folder, sync_files=True, thread_count=1, per_thread_copy_ahead=0)
    metadata = dcp.save(planned, storage_writer=writer, planner=saver, process_group=group)
    _check_written(metadata, saver.copied, folder)
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


def _load(state: dict[str, Any], reader, planner, group) -> None:
    """torch.distributed.checkpoint's load into `state`; a failure on any rank (every rank hears of
    it) as a CheckpointError naming the folder and the first rank's cause."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=reader, planner=planner, process_group=group)
    except CheckpointException as e:
        rank, failure = sorted(e.failures.items())[0]
        cause = failure[0] if isinstance(failure, tuple) else failure
        raise CheckpointError(f"{reader.path}: rank {rank} could not read it: {type(cause).__name__}: "
                              f"{str(cause).splitlines()[0] if str(cause) else ''}") from None


@dataclass(frozen=True)
class _Unread:
    """A piece the checkpoint holds, named to read_engine_state's `check`, not read yet: its key on disk."""

    key: str


def _check_cut_alike(template: dict[str, Any], mine: dict[tuple, Any], flat: dict[tuple, Any], folder: str) -> None:
    """Refuse a checkpoint whose tensors are cut otherwise than this run declares (a state declared
    another way when it was written): a piece saved per rank where this run keeps the tensor whole
    would be dropped, and a whole tensor where this run keeps a piece would hand every rank rank 0's."""
    kept = dict(_flatten({k: v for k, v in template.items() if k not in _NOT_SAVED}))
    for path, value in flat.items():
        if isinstance(value, _Unread) and path not in mine and torch.is_tensor(kept.get(path)):
            raise CheckpointError(f"{folder}: {SEP.join(path)!r} was saved as one piece per rank, and this run "
                                  "keeps it whole on every rank (its state declares it replicated): a state of "
                                  "another layout")
        if path in mine and torch.is_tensor(value):
            raise CheckpointError(f"{folder}: {SEP.join(path)!r} was saved whole, once, and this run keeps one piece "
                                  "of it per rank (its state declares it cut): a state of another layout")


def read_engine_state(directory: str, template: dict[str, Any], check, io_timeout: float,
                      group=None) -> dict[str, Any]:
    """Collective: the state in `directory`/engine_state for this rank, in shard_state_dict's layout,
    written by any rank count. `template`: this rank's own shard_state_dict (its keys, lengths and
    dtypes): its tensors are read into in place, wherever they live, and are the state returned.
    `check(state)`: refuses a state that does not fit this run, called with the checkpoint's
    parameter names, shapes and counters (the pieces named, not yet read: _Unread) before any piece
    is read. It may move entries in place (a state of an older layout read as this one's): each
    piece is read into the template's piece at the path where `check` left it. Which tensors are
    pieces, the template's PIECES says. `group`: as save_engine_state's."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    world, rank = template["world"], template["rank"]
    group = group or io_group(io_timeout)
    folder = state_dir(directory)
    reader = FileSystemReader(folder)
    saved = reader.read_metadata().state_dict_metadata
    named = _unflatten({**dict(_flatten(_read_rest(folder))),
                        **{tuple(k.split(SEP)): _Unread(k) for k in saved}})
    check(named)
    flat = dict(_flatten(named))
    mine, _ = _split(template)
    _check_cut_alike(template, mine, flat, folder)
    mesh, pieces, planned = _mesh(group), {}, {}
    for path, value in list(flat.items()):
        if not isinstance(value, _Unread):
            continue
        key, numel = value.key, saved[value.key].size[0]
        if path not in mine:
            del flat[path]  # kept by the writing run, not by this one (fp32 masters it does not keep)
            continue
        target = mine[path][0]
        pieces[key] = _piece(target, numel, world, rank)
        planned[key] = _planned(pieces[key], numel, mesh)
        flat[path] = target
    _load(planned, reader, _planners()[1](pieces), group)
    state = _unflatten(flat)
    state["world"], state["rank"] = world, rank
    if PIECES in template:  # what this run's pieces are, as its own state says
        state[PIECES] = template[PIECES]
    return state
