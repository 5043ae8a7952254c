"""Reduce-scatter between CPU ranks on one node, through shared memory: the `shared_memory`
transport of the gradient buckets (buckets.py).

Neither library has a fast one for this case. gloo's reduce-scatter goes through TCP loopback:
copies through the kernel, and threads that compete with the backward for the cores. DeepSpeed's
shared-memory kernel is a synchronous all-reduce: it copies the whole bucket in and back out, and
every call is a barrier. Here each rank packs its rank-major payload straight into its own shared
buffer, posts it and goes on with the backward; when the bucket is due (at the next bucket, or at
the end of the backward) it sums row `rank` of every rank's payload, the only bytes of its peers'
it reads, by which time its peers have long posted: no rank waits on another's jitter.

Protocol. One buffer per rank, mapped by every rank of the node: a header of int64 words, then
`slots` payload slots (64-byte aligned, so a slot views any dtype). Every rank sends the same
buckets in the same order, so a send's sequence number (1, 2, ...) is the same on every rank;
send `seq` uses slot `seq % slots`.
  post:    wait until every peer has read this slot's previous payload (its read[slot] >=
           seq - slots), write the payload, then set posted[slot] = seq.
  reduce:  wait until every peer has posted[slot] >= seq, sum row `rank` of every payload in rank
           order, then set read[slot] = seq.
A rank completes its oldest send before posting a new one once `in_flight` are outstanding
(buckets.py), so `slots` >= `in_flight` keeps every wait finite: a peer reads slot k at the latest
when it posts its send k + in_flight - 1, which waits only on sends before that.
Each rank writes only its own header. A payload's stores are visible to the other cores before
the flag stored after them under x86's store ordering; `available()` requires x86-64.

A dead peer. The header also holds the rank's process id and an "abandoned" word, set when its
backward raised (`abandon()`). A waiting rank looks at both every half second and fails at once,
naming the rank, instead of spinning until the timeout (lomo.collective_timeout).
"""
from __future__ import annotations

import os
import platform
import time

import torch

from lomo_ds.engine import comm_stats
from lomo_ds.runtime import ds_compat

MIN_SLOTS = 2  # a rank may post its next bucket while its peers still read its last one
ALIGN = 64  # bytes: a cache line, and a multiple of every dtype's size
_PEER_CHECK_S = 0.5  # how often a waiting rank looks whether the rank it waits for is still alive


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


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

    def __init__(self, group, world: int, rank: int, in_flight: int = 1, timeout_s: float | None = None):
        self.group, self.world, self.rank = group, world, rank
        self.slots = max(MIN_SLOTS, in_flight)
        # int64 words: posted[slots], read[slots], process id, abandoned
        self.header_bytes = _aligned(8 * (2 * self.slots + 2))
        self.timeout_s = timeout_s or 600.0
        self.slot_bytes = 0
        self.seq = 0  # sends posted so far
        self.buffers: list[torch.Tensor] = []  # every rank's mapping, as bytes
        self.flags: list[torch.Tensor] = []  # every rank's header, as int64
        self._next: tuple[int, torch.dtype] | None = None  # (width, dtype) of the payload handed out

    @property
    def nbytes(self) -> int:
        """This rank's shared memory."""
        return self.header_bytes + self.slots * self.slot_bytes if self.buffers else 0

    def reserve(self, slot_bytes: int) -> None:
        """Collective (every rank, same argument, nothing posted and unread): make each slot hold
        at least `slot_bytes`, mapping new buffers when the current ones are too small."""
        slot_bytes = _aligned(slot_bytes)
        if slot_bytes <= self.slot_bytes:
            return
        # A name no other job or engine on this node uses: the group's first rank draws it (from
        # the OS: torch's generator is the training's, and must draw the same with either transport).
        token = torch.tensor([int.from_bytes(os.urandom(7), "little")], dtype=torch.int64, device="cpu")
        ds_compat.broadcast_from_first(token, self.group, name="shared-memory buffer name")
        path = lambda r: f"/dev/shm/lomo_ds_grad_{int(token)}_{r}"  # noqa: E731
        nbytes = self.header_bytes + self.slots * slot_bytes
        mine = torch.from_file(path(self.rank), shared=True, size=nbytes, dtype=torch.uint8)
        mine[:self.header_bytes].zero_()
        mine[:self.header_bytes].view(torch.int64)[2 * self.slots] = os.getpid()
        self._barrier()
        self.buffers = [mine if r == self.rank else
                        torch.from_file(path(r), shared=True, size=nbytes, dtype=torch.uint8)
                        for r in range(self.world)]
        self._barrier()
        # Every rank has it mapped: the name can go, so nothing is left in /dev/shm, even after a crash.
        os.remove(path(self.rank))
        self.flags = [b[:self.header_bytes].view(torch.int64) for b in self.buffers]
        self.slot_bytes, self.seq = slot_bytes, 0

    def _barrier(self) -> None:
        ds_compat.all_reduce(torch.zeros(1, device="cpu"), group=self.group, name="shared-memory barrier")

    def _slot(self, rank: int, seq: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        start = self.header_bytes + (seq % self.slots) * self.slot_bytes
        n = self.world * width * dtype.itemsize
        if n > self.slot_bytes:
            raise ValueError(f"a {self.world} x {width} {dtype} payload does not fit a {self.slot_bytes}-byte slot")
        return self.buffers[rank][start:start + n].view(dtype).view(self.world, width)

    def payload(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's send matrix for the next post, once every peer has read what it replaces."""
        seq, slots = self.seq + 1, self.slots
        if seq > slots:
            self._wait_for(lambda r: int(self.flags[r][slots + seq % slots]) >= seq - slots, seq - slots, "read")
        self._next = (width, dtype)
        return self._slot(self.rank, seq, width, dtype)

    def post(self, out: torch.Tensor) -> _Pending:
        """Publish the payload last handed out; `out` ([width], its dtype) receives the sum."""
        width, dtype = self._next
        if out.dtype != dtype or out.numel() != width:
            raise ValueError(f"receive buffer: expected {width} elements of {dtype}, got {out.numel()} of {out.dtype}")
        self._next = None
        self.seq += 1
        self.flags[self.rank][self.seq % self.slots] = self.seq  # after the payload's stores (x86 keeps their order)
        # Counted as the reduce-scatter it replaces (by an open comm_stats.count_comm, else free).
        comm_stats.record("reduce_scatter", width * dtype.itemsize * (self.world - 1))
        return _Pending(self, self.seq, out)

    def reduce_into(self, out: torch.Tensor, seq: int) -> None:
        self._wait_for(lambda r: int(self.flags[r][seq % self.slots]) >= seq, seq, "posted")
        rows = [self._slot(r, seq, out.numel(), out.dtype)[self.rank] for r in range(self.world)]
        if self.world == 2:
            torch.add(rows[0], rows[1], out=out)
        else:
            out.copy_(rows[0])
            for row in rows[1:]:
                out.add_(row)
        self.flags[self.rank][self.slots + seq % self.slots] = seq

    def abandon(self) -> None:
        """This rank's backward raised: its peers, waiting on its next post, fail now and name it."""
        if self.flags:
            self.flags[self.rank][2 * self.slots + 1] = 1

    def _wait_for(self, ready, seq: int, what: str) -> None:
        """Spin until ready(r) for every rank r, yielding the core between looks (with more
        ranks than cores, a spinning rank must not keep the one it waits for off its core); fail,
        naming the rank, once it has died, abandoned the backward, or kept us waiting too long."""
        start = next_check = None
        for r in range(self.world):
            while not ready(r):
                now = time.monotonic()
                if start is None:
                    start, next_check = now, now + _PEER_CHECK_S
                elif now >= next_check:
                    next_check = now + _PEER_CHECK_S
                    self._check_peer(r, seq, what, now - start)
                os.sched_yield()

    def _check_peer(self, r: int, seq: int, what: str, waited: float) -> None:
        header = self.flags[r]
        problem = None
        if int(header[2 * self.slots + 1]):
            problem = "raised an error in its backward"
        elif not _alive(int(header[2 * self.slots])):
            problem = f"has exited (process {int(header[2 * self.slots])})"
        elif waited > self.timeout_s:
            problem = (f"has not {what} gradient bucket {seq} in {self.timeout_s:.0f} s (lomo.collective_timeout): "
                       "it hangs, or the ranks sent different buckets")
        if problem:
            raise RuntimeError(f"rank {self.rank}: rank {r} {problem} (shared-memory reduce-scatter, "
                               f"waiting for bucket {seq} to be {what})")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True
