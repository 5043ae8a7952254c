"""The step's agreements (the loss before the backward, the norm between two passes, the
non-finite verdict after the updating pass): element-wise sums over the ranks of a few numbers,
read on the host. They go where the gradient buckets go: through shared memory between CPU ranks
of one node (shm_all_reduce.py), else one all-reduce of the process group."""
from __future__ import annotations

import torch

from lomo_ds.comm.grad import GradRoute
from lomo_ds.comm.shm_all_reduce import SharedMemoryAllReduce
from lomo_ds.runtime.dist import sum_over_ranks


class StepSums:
    """Through the process group (deepspeed.comm)."""

    through_shared_memory = False

    def __init__(self, group, world: int):
        self.group, self.world = group, world

    def sum(self, values, name: str) -> list[float]:
        """Element-wise sums over the ranks of a few numbers (fp32) or a short 1-D tensor (its dtype)."""
        return sum_over_ranks(values, self.world, self.group, name=name)

    def abandon(self) -> None:
        """This rank's step raised (peers of a collective fail by the group's timeout)."""


class SharedMemoryStepSums(StepSums):
    through_shared_memory = True

    def __init__(self, group, world: int, rank: int, timeout_s: float | None):
        super().__init__(group, world)
        self.shm = SharedMemoryAllReduce(group, world, rank, timeout_s)  # collective: every rank at once

    def sum(self, values, name: str) -> list[float]:
        t = values if torch.is_tensor(values) else torch.tensor(values, dtype=torch.float32, device="cpu")
        return self.shm.sum(t).tolist()

    def abandon(self) -> None:
        self.shm.abandon()


def open_step_sums(route: GradRoute, group, world: int, rank: int, timeout_s: float | None = None) -> StepSums:
    """Where `route` (the buckets') is shared memory, so are the step's sums."""
    if route == GradRoute.SHARED_MEMORY:
        return SharedMemoryStepSums(group, world, rank, timeout_s)
    return StepSums(group, world)
