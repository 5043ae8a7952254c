"""The shared-memory machinery of lomo_ds's collectives between CPU ranks on one node: the
gradient reduce-scatter (shm_reduce_scatter.py) and ZeRO-3's parameter all-gather
(shm_all_gather.py) are two uses of the one segment, slot and flag protocol here.

Protocol. One buffer per rank, mapped by every rank of the node: a header of int64 words, then
`slots` payload slots (64-byte aligned, so a slot views any dtype). Every rank issues the same
collectives in the same order, so a send's sequence number (1, 2, ...) is the same on every rank;
send `seq` uses slot `seq % slots`.
  post:    wait until every peer has read this slot's previous payload (its read[slot] >=
           seq - slots), write the payload, then set posted[slot] = seq (`_publish`).
  consume: wait until every peer has posted[slot] >= seq (`_wait_posted`), read what this rank
           needs of every payload, then set read[slot] = seq (`_mark_read`).
A rank consumes its oldest send before posting one that would reuse that send's slot (each
transport keeps that rule), which keeps every wait finite: a peer reads slot k at the latest when
it posts send k + slots, which waits only on sends before that.
Each rank writes only its own header. A payload's stores are visible to the other cores before
the flag stored after them under x86's store ordering; `available()` requires x86-64.

A dead peer. The header also holds the rank's process id and an "abandoned" word, set when its
step raised (`abandon()`). A waiting rank looks at both every half second and fails at once,
naming the rank, instead of spinning until the timeout (train.collective_timeout).
"""
from __future__ import annotations

import os
import platform
import time

import torch

from lomo_ds.runtime import ds_compat

MIN_SLOTS = 2  # a rank may post its next payload while its peers still read its last one
ALIGN = 64  # bytes: a cache line, and a multiple of every dtype's size
_PEER_CHECK_S = 0.5
# A waiting rank first spins, yielding the core between looks, for up to _SPIN_S: a peer that is
# about to post is seen at once. After that, or from the start when this host has more ranks than
# cores for them, it sleeps between looks, _SLEEP_S at first and twice as long after each look up to
# _MAX_SLEEP_S: Linux's scheduler hands a yielding task its core straight back, so spinning ranks
# would keep the rank they wait for (or any other job, such as a second launch beside this one) off
# the cores, and every wake-up of a rank that still has to wait takes a core from one that works.
# 3 ranks on 2 cores ran 2.7x slower than 2 ranks with yielding alone; the sleeps cost a waiting
# rank at most one _MAX_SLEEP_S of latency, and a short wait only the first naps.
_SPIN_S = 1e-3
_SLEEP_S = 50e-6  # how often a waiting rank looks whether the rank it waits for is still alive, at first
_MAX_SLEEP_S = 1e-3


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def available(group) -> bool:
    """Whether the ranks of `group` can exchange through this node's shared memory: CPU (gloo)
    ranks, a group of every rank, every rank on this node (the launcher's count of ranks on this
    node equals the world size: LOCAL_SIZE from DeepSpeed's, LOCAL_WORLD_SIZE from torchrun),
    x86-64 (the protocol relies on its store ordering). Every rank of a node decides alike."""
    world = torch.distributed.get_world_size()
    on_this_node = os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE"))
    return (torch.distributed.get_backend(group) == "gloo"
            and torch.distributed.get_world_size(group) == world
            and on_this_node == str(world)
            and platform.machine().lower() in ("x86_64", "amd64"))


class SharedMemorySlots:
    """Every rank's buffer of `slots` payload slots, mapped by every rank, and the flags that
    order them. A transport subclasses it: what it posts and how it consumes the payloads."""

    kind = "shared-memory transport"  # in error messages: which collective waited
    unit = "payload"  # what a send carries, in error messages
    abandoned_in = "its step"  # where a peer that abandoned raised
    file_tag = "shm"  # /dev/shm/lomo_ds_<tag>_<token>_<rank> while the buffers are being mapped

    def __init__(self, group, world: int, rank: int, slots: int = MIN_SLOTS, timeout_s: float | None = None):
        self.group, self.world, self.rank = group, world, rank
        self.slots = max(MIN_SLOTS, slots)
        # int64 words: posted[slots], read[slots], process id, abandoned
        self.header_bytes = aligned(8 * (2 * self.slots + 2))
        self.timeout_s = timeout_s or 600.0
        self.file_stems: list[str] = []  # the buffers' file names without the rank, one per mapping
        # Every rank of the group is on this host (the buffers are shared memory): more of them than
        # the cores this process may run on means a waiting rank must give its core up.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.oversubscribed = world > cores
        self.slot_bytes = 0
        self.seq = 0  # sends posted so far
        self.buffers: list[torch.Tensor] = []  # every rank's mapping, as bytes
        self.flags: list[torch.Tensor] = []  # every rank's header, as int64

    @property
    def nbytes(self) -> int:
        """This rank's shared memory."""
        return self.header_bytes + self.slots * self.slot_bytes if self.buffers else 0

    def reserve(self, slot_bytes: int) -> None:
        """Collective (every rank, same argument, nothing posted and unread): make each slot hold
        at least `slot_bytes`, mapping new buffers when the current ones are too small."""
        slot_bytes = aligned(slot_bytes)
        if slot_bytes <= self.slot_bytes:
            return
        # A name no other job or engine on this node uses: the group's first rank draws it (from
        # the OS: torch's generator is the training's, and must draw the same with either transport).
        token = torch.tensor([int.from_bytes(os.urandom(7), "little")], dtype=torch.int64, device="cpu")
        ds_compat.broadcast_from_first(token, self.group, name="shared-memory buffer name")
        path = lambda r: f"/dev/shm/lomo_ds_{self.file_tag}_{int(token)}_{r}"  # noqa: E731
        self.file_stems.append(os.path.basename(path("")))
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

    def region(self, rank: int, seq: int, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of `rank`'s slot for send `seq`, as bytes (view them as any dtype)."""
        if nbytes > self.slot_bytes:
            raise ValueError(f"a {nbytes}-byte payload does not fit a {self.slot_bytes}-byte slot")
        start = self.header_bytes + (seq % self.slots) * self.slot_bytes
        return self.buffers[rank][start:start + nbytes]

    def _wait_slot_free(self, seq: int) -> None:
        """Before writing send `seq`: every peer has read the send it replaces."""
        slots = self.slots
        if seq > slots:
            self._wait_for(lambda r: int(self.flags[r][slots + seq % slots]) >= seq - slots, seq - slots, "read")

    def _publish(self, seq: int) -> None:
        self.flags[self.rank][seq % self.slots] = seq  # after the payload's stores (x86 keeps their order)

    def _wait_posted(self, seq: int) -> None:
        self._wait_for(lambda r: int(self.flags[r][seq % self.slots]) >= seq, seq, "posted")

    def _mark_read(self, seq: int) -> None:
        self.flags[self.rank][self.slots + seq % self.slots] = seq

    def abandon(self) -> None:
        """This rank's step raised: its peers, waiting on its next post, fail now and name it."""
        if self.flags:
            self.flags[self.rank][2 * self.slots + 1] = 1

    def _wait_for(self, ready, seq: int, what: str) -> None:
        """Wait until ready(r) for every rank r: spin, then sleep between looks (see _SPIN_S); fail,
        naming the rank, once it has died, abandoned its step, or kept us waiting too long."""
        start = next_check = spin_until = None
        nap = _SLEEP_S
        for r in range(self.world):
            while not ready(r):
                now = time.monotonic()
                if start is None:
                    start, next_check = now, now + _PEER_CHECK_S
                    spin_until = now if self.oversubscribed else now + _SPIN_S
                elif now >= next_check:
                    next_check = now + _PEER_CHECK_S
                    self._check_peer(r, seq, what, now - start)
                if now < spin_until:
                    os.sched_yield()
                else:
                    time.sleep(nap)
                    nap = min(2 * nap, _MAX_SLEEP_S)

    def _check_peer(self, r: int, seq: int, what: str, waited: float) -> None:
        header = self.flags[r]
        problem = None
        if int(header[2 * self.slots + 1]):
            problem = f"raised an error in {self.abandoned_in}"
        elif not _alive(int(header[2 * self.slots])):
            problem = f"has exited (process {int(header[2 * self.slots])})"
        elif waited > self.timeout_s:
            problem = (f"has not {what} {self.unit} {seq} in {self.timeout_s:.0f} s (train.collective_timeout): "
                       f"it hangs, or the ranks issued different collectives")
        if problem:
            raise RuntimeError(f"rank {self.rank}: rank {r} {problem} ({self.kind}, "
                               f"waiting for {self.unit} {seq} to be {what})")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True
