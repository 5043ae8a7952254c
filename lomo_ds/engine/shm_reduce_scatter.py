"""Reduce-scatter between CPU ranks on one node, through shared memory: the `shared_memory`
transport of the gradient buckets (buckets.py).

Neither library has a fast one for this case. gloo's reduce-scatter goes through TCP loopback:
copies through the kernel, and threads that compete with the backward for the cores. DeepSpeed's
shared-memory kernel is a synchronous all-reduce: it copies the whole bucket in and back out, and
every call is a barrier. Here each rank packs its rank-major payload straight into its own shared
buffer, posts it and goes on with the backward; when the bucket is due (at the next bucket, or at
the end of the backward) it sums row `rank` of every rank's payload, the only bytes of its peers'
it reads, by which time its peers have long posted: no rank waits on another's jitter.

Protocol. One buffer per rank, mapped by every rank of the node: a header of int64 flags, then
SLOTS payload slots. Every rank sends the same buckets in the same order, so a send's sequence
number (1, 2, ...) is the same on every rank; send `seq` uses slot `seq % SLOTS`.
  post:    wait until every peer has read this slot's previous payload (its read[slot] >=
           seq - SLOTS), write the payload, then set posted[slot] = seq.
  reduce:  wait until every peer has posted[slot] >= seq, sum row `rank` of every payload in rank
           order, then set read[slot] = seq.
Each rank writes only its own header. A payload's stores are visible to the other cores before
the flag stored after them under x86's store ordering; `available()` requires x86-64.
"""
from __future__ import annotations

import os
import platform
import time

import torch

from lomo_ds.engine import comm_stats
from lomo_ds.runtime import ds_compat

SLOTS = 2  # a rank may post its next bucket while its peers still read its last one
_HEADER_BYTES = 64  # posted[SLOTS], read[SLOTS] as int64, padded to a cache line
_TIMEOUT_S = 1800.0  # as gloo's default: a peer that has not posted by then has died or diverged


def available(group) -> bool:
    """Whether the ranks of `group` can reduce through this node's shared memory: CPU (gloo)
    ranks, a group of every rank, every rank on this node (the launcher's count of ranks on this
    node equals the world size: LOCAL_SIZE from DeepSpeed's, LOCAL_WORLD_SIZE from torchrun),
    x86-64 (the protocol relies on its store ordering). Every rank of a node decides alike."""
    world = torch.distributed.get_world_size()
    on_this_node = os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE"))
    return (torch.distributed.get_backend(group) == "gloo"
            and torch.distributed.get_world_size(group) == world
            and on_this_node == str(world)
            and platform.machine().lower() in ("x86_64", "amd64"))


class _Pending:
    """The handle of one posted payload (`wait()`, as a torch.distributed work handle)."""

    def __init__(self, owner: "SharedMemoryReduceScatter", seq: int, out: torch.Tensor):
        self.owner, self.seq, self.out = owner, seq, out
        self.done = False

    def wait(self) -> None:
        if not self.done:
            self.owner.reduce_into(self.out, self.seq)
            self.done = True


class SharedMemoryReduceScatter:
    """`payload(width, dtype)` gives this rank's [world, width] send matrix to pack (row r: what
    rank r receives); `post(out)` publishes it and returns a handle whose `wait()` leaves in `out`
    the sum over ranks of every rank's row `rank`."""

    def __init__(self, group, world: int, rank: int):
        self.group, self.world, self.rank = group, world, rank
        self.slot_bytes = 0
        self.seq = 0  # sends posted so far
        self.buffers: list[torch.Tensor] = []  # every rank's mapping, as bytes
        self.flags: list[torch.Tensor] = []  # every rank's header, as int64
        self._next: tuple[int, torch.dtype] | None = None  # (width, dtype) of the payload handed out

    @property
    def nbytes(self) -> int:
        """This rank's shared memory."""
        return _HEADER_BYTES + SLOTS * self.slot_bytes if self.buffers else 0

    def reserve(self, slot_bytes: int) -> None:
        """Collective (every rank, same argument, nothing posted and unread): make each slot hold
        at least `slot_bytes`, mapping new buffers when the current ones are too small."""
        if slot_bytes <= self.slot_bytes:
            return
        # A name no other job or engine on this node uses: the group's first rank draws it (from
        # the OS: torch's generator is the training's, and must draw the same with either transport).
        token = torch.tensor([int.from_bytes(os.urandom(7), "little")], dtype=torch.int64, device="cpu")
        ds_compat.broadcast_from_first(token, self.group, name="shared-memory buffer name")
        path = lambda r: f"/dev/shm/lomo_ds_grad_{int(token)}_{r}"  # noqa: E731
        nbytes = _HEADER_BYTES + SLOTS * slot_bytes
        mine = torch.from_file(path(self.rank), shared=True, size=nbytes, dtype=torch.uint8)
        mine[:_HEADER_BYTES].zero_()
        self._barrier()
        self.buffers = [mine if r == self.rank else
                        torch.from_file(path(r), shared=True, size=nbytes, dtype=torch.uint8)
                        for r in range(self.world)]
        self._barrier()
        # Every rank has it mapped: the name can go, so nothing is left in /dev/shm, even after a crash.
        os.remove(path(self.rank))
        self.flags = [b[:_HEADER_BYTES].view(torch.int64) for b in self.buffers]
        self.slot_bytes, self.seq = slot_bytes, 0

    def _barrier(self) -> None:
        ds_compat.all_reduce(torch.zeros(1, device="cpu"), group=self.group, name="shared-memory barrier")

    def _slot(self, rank: int, seq: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        start = _HEADER_BYTES + (seq % SLOTS) * self.slot_bytes
        n = self.world * width * dtype.itemsize
        if n > self.slot_bytes:
            raise ValueError(f"a {self.world} x {width} {dtype} payload does not fit a {self.slot_bytes}-byte slot")
        return self.buffers[rank][start:start + n].view(dtype).view(self.world, width)

    def payload(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's send matrix for the next post, once every peer has read what it replaces."""
        seq = self.seq + 1
        if seq > SLOTS:
            self._wait_for(lambda r: int(self.flags[r][SLOTS + seq % SLOTS]) >= seq - SLOTS, seq - SLOTS, "read")
        self._next = (width, dtype)
        return self._slot(self.rank, seq, width, dtype)

    def post(self, out: torch.Tensor) -> _Pending:
        """Publish the payload last handed out; `out` ([width], its dtype) receives the sum."""
        width, dtype = self._next
        if out.dtype != dtype or out.numel() != width:
            raise ValueError(f"receive buffer: expected {width} elements of {dtype}, got {out.numel()} of {out.dtype}")
        self._next = None
        self.seq += 1
        self.flags[self.rank][self.seq % SLOTS] = self.seq  # after the payload's stores (x86 keeps their order)
        # Counted as the reduce-scatter it replaces (by an open comm_stats.count_comm, else free).
        comm_stats.record("reduce_scatter", width * dtype.itemsize * (self.world - 1))
        return _Pending(self, self.seq, out)

    def reduce_into(self, out: torch.Tensor, seq: int) -> None:
        self._wait_for(lambda r: int(self.flags[r][seq % SLOTS]) >= seq, seq, "posted")
        rows = [self._slot(r, seq, out.numel(), out.dtype)[self.rank] for r in range(self.world)]
        if self.world == 2:
            torch.add(rows[0], rows[1], out=out)
        else:
            out.copy_(rows[0])
            for row in rows[1:]:
                out.add_(row)
        self.flags[self.rank][SLOTS + seq % SLOTS] = seq

    def _wait_for(self, ready, seq: int, what: str) -> None:
        """Spin until ready(r) for every rank r, yielding the core between looks (with more
        ranks than cores, a spinning rank must not keep the one it waits for off its core)."""
        deadline = None
        for r in range(self.world):
            while not ready(r):
                if deadline is None:
                    deadline = time.monotonic() + _TIMEOUT_S
                elif time.monotonic() > deadline:
                    raise RuntimeError(f"rank {self.rank}: rank {r} has not {what} gradient bucket {seq} in "
                                       f"{_TIMEOUT_S:.0f} s (shared-memory reduce-scatter): a rank died or the ranks "
                                       "sent different buckets")
                os.sched_yield()
