"""Reduce-scatter between CPU ranks on one node, through shared memory: the `shared_memory`
route of the gradient buckets (grad.py).

Neither library has a fast one for this case. gloo's reduce-scatter goes through TCP loopback:
copies through the kernel, and threads that compete with the backward for the cores. DeepSpeed's
shared-memory kernel is a synchronous all-reduce: it copies the whole bucket in and back out, and
every call is a barrier. Here each rank packs its rank-major payload straight into its own shared
buffer, posts it and goes on with the backward; when the bucket is due (at the next bucket, or at
the end of the backward) it sums row `rank` of every rank's payload, the only bytes of its peers'
it reads, by which time its peers have long posted: no rank waits on another's jitter.

The segments, slots and flags (and the dead-peer detection) are shm_transport.py's, shared
with ZeRO-3's parameter all-gather (shm_all_gather.py). A send here is one bucket: this rank's
[world, width] payload, row r what rank r receives; consuming it sums row `rank` of every rank's
payload. A rank completes its oldest send before posting a new one once `in_flight` are
outstanding (buckets.py), so `slots` >= `in_flight` keeps every wait finite.
"""
from __future__ import annotations

import math

import torch

from lomo_ds.comm import observe
from lomo_ds.comm.shm_transport import ALIGN, MIN_SLOTS, SharedMemorySlots, available

__all__ = ["ALIGN", "MIN_SLOTS", "SharedMemoryReduceScatter", "available"]


class _Pending:
    """The handle of one posted payload (`wait()`, as a torch.distributed work handle); after the
    wait, `finite` says whether every element of the reduced slice (flag included) is finite."""

    def __init__(self, owner: "SharedMemoryReduceScatter", seq: int, out: torch.Tensor):
        self.owner, self.seq, self.out = owner, seq, out
        self.done = False
        self.finite: bool | None = None

    def wait(self) -> bool:
        """The reduced slice into `out`; whether it is all finite (flag included)."""
        if not self.done:
            self.finite = self.owner.reduce_into(self.out, self.seq)
            self.done = True
        return self.finite


class SharedMemoryReduceScatter(SharedMemorySlots):
    """`payload(width, dtype)` gives this rank's [world, width] send matrix to pack (row r: what
    rank r receives); `post(out)` publishes it and returns a handle whose `wait()` leaves in `out`
    the sum over ranks of every rank's row `rank`."""

    kind = "shared-memory reduce-scatter"
    unit = "gradient bucket"
    abandoned_in = "its backward"
    file_tag = "grad"

    def __init__(self, group, world: int, rank: int, in_flight: int = 1, timeout_s: float | None = None):
        super().__init__(group, world, rank, slots=in_flight, timeout_s=timeout_s)
        self._next: tuple[int, torch.dtype] | None = None  # (width, dtype) of the payload handed out

    def _slot(self, rank: int, seq: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        n = self.world * width * dtype.itemsize
        if n > self.slot_bytes:
            raise ValueError(f"a {self.world} x {width} {dtype} payload does not fit a {self.slot_bytes}-byte slot")
        return self.region(rank, seq, n).view(dtype).view(self.world, width)

    def payload(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's send matrix for the next post, once every peer has read what it replaces."""
        seq = self.seq + 1
        self._wait_slot_free(seq)
        self._next = (width, dtype)
        return self._slot(self.rank, seq, width, dtype)

    def post(self, out: torch.Tensor) -> _Pending:
        """Publish the payload last handed out; `out` ([width], its dtype) receives the sum."""
        width, dtype = self._next
        if out.dtype != dtype or out.numel() != width:
            raise ValueError(f"receive buffer: expected {width} elements of {dtype}, got {out.numel()} of {out.dtype}")
        self._next = None
        self.seq += 1
        self._publish(self.seq)
        # Reported as the reduce-scatter it replaces (to whoever observes, lomo_ds.profiling.count_comm).
        observe.record("reduce_scatter", width * dtype.itemsize * (self.world - 1))
        return _Pending(self, self.seq, out)

    def rows(self, out: torch.Tensor, seq: int) -> list[torch.Tensor]:
        """Row `rank` of every rank's payload `seq` (each the shape and dtype of `out`), once posted."""
        self._wait_posted(seq)
        return [self._slot(r, seq, out.numel(), out.dtype)[self.rank] for r in range(self.world)]

    def reduce_into(self, out: torch.Tensor, seq: int) -> bool:
        """Sum row `rank` of every rank's payload `seq` into `out`; whether the sum is all finite
        (from a sum over `out`)."""
        rows = self.rows(out, seq)
        if self.world == 1:
            out.copy_(rows[0])
        else:
            torch.add(rows[0], rows[1], out=out)
        for row in rows[2:]:
            out.add_(row)
        total = float(out.sum(dtype=torch.float32))
        self._mark_read(seq)
        return math.isfinite(total)
