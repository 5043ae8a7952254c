"""The step's small all-reduces between CPU ranks on one node, through shared memory.

A LOMO step agrees on a few numbers at fixed points: the loss (and whether any rank's is
non-finite) before the backward, the global norm between the two passes of norm clipping, and the
non-finite verdict after the updating pass. gloo sends each through TCP loopback, with threads that
compete with the step for the cores: a fixed cost per agreement, paid every step, for a payload of
a few bytes. Shared memory makes each one a store, a flag and a read.

Here each rank writes its values into its own slot of the shared-memory transport
(shm_transport.py: the same segments, slots, flags and dead-peer detection as the gradient
reduce-scatter and the parameter all-gather), publishes it, waits for every peer's, and sums them
in rank order: every rank gets bit-identical sums. The engine uses it where its gradient buckets
use shared memory (the same ranks, the same conditions).
"""
from __future__ import annotations

import torch

from lomo_ds.comm import observe
from lomo_ds.comm.shm_transport import SharedMemorySlots

MAX_VALUES = 64  # the step's agreements send at most 5 numbers


class SharedMemoryAllReduce(SharedMemorySlots):
    """`sum(values)`: the element-wise sum over the ranks of a short 1-D tensor, in its dtype."""

    kind = "shared-memory all-reduce"
    unit = "step statistic"
    abandoned_in = "its step"
    file_tag = "sum"

    def __init__(self, group, world: int, rank: int, timeout_s: float | None = None):
        super().__init__(group, world, rank, timeout_s=timeout_s)
        self.reserve(MAX_VALUES * 8)  # collective: every rank builds one at the same moment

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """A new CPU tensor: `values` (1-D, host memory) summed over the ranks, in rank order."""
        n, dtype = values.numel(), values.dtype
        if values.device.type != "cpu" or n > MAX_VALUES or dtype.itemsize > 8:
            raise ValueError(f"shared-memory all-reduce: expected at most {MAX_VALUES} values of at most 8 bytes "
                             f"in host memory, got {n} of {dtype} on {values.device}")
        seq = self.seq + 1
        self._wait_slot_free(seq)
        self._row(self.rank, seq, n, dtype).copy_(values.reshape(-1))
        self.seq = seq
        self._publish(seq)
        observe.record("all_reduce", n * dtype.itemsize)  # counted as the all-reduce it replaces
        self._wait_posted(seq)
        out = self._row(0, seq, n, dtype).clone()
        for r in range(1, self.world):
            out.add_(self._row(r, seq, n, dtype))
        self._mark_read(seq)
        return out

    def _row(self, rank: int, seq: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        return self.region(rank, seq, n * dtype.itemsize).view(dtype)
