"""The data order: a pure function of (seed, epoch, step), so a resumed run replays it exactly, and
every rank derives its own micro-batches of a step from it without communication."""
from __future__ import annotations

import math

import numpy as np


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The example order of one epoch: a permutation that depends only on (n, seed, epoch)."""
    return [int(i) for i in np.random.default_rng([seed, epoch]).permutation(n)]


def micro_batches_per_epoch(n: int, world: int, micro: int) -> int:
    """Global micro-batches (one micro batch on every rank) per epoch: every example once; the last
    is topped up (see batches_for_step) so every rank always has a full micro batch, which ZeRO-3
    needs (each backward is a collective every rank must join)."""
    if n < 1:
        raise ValueError("steps_per_epoch: no training examples")
    return math.ceil(n / (world * micro))


def steps_per_epoch(n: int, world: int, micro: int, accumulation: int = 1) -> int:
    """Optimizer steps per epoch: windows of `accumulation` global micro-batches. When that does not
    divide the epoch's micro-batches, the epoch's last window is shorter and its step is the mean
    over its own micro-batches (window_of_step): epochs stay aligned (data order, evaluation), and
    no example is seen twice or carried into the next epoch's order."""
    return math.ceil(micro_batches_per_epoch(n, world, micro) / accumulation)


def window_of_step(step_in_epoch: int, n: int, world: int, micro: int, accumulation: int = 1) -> range:
    """The global micro-batch indices (within the epoch) of optimizer step `step_in_epoch`."""
    start = step_in_epoch * accumulation
    return range(start, min(start + accumulation, micro_batches_per_epoch(n, world, micro)))


def batches_for_step(order: list[int], micro_in_epoch: int, world: int, micro: int, rank: int) -> list[int]:
    """The example indices of rank `rank`'s micro batch in global micro-batch `micro_in_epoch` of an
    epoch (the optimizer step's number when there is no accumulation).

    Global micro-batch s is order[s*world*micro : (s+1)*world*micro], wrapping round to the start of
    the same epoch's order when it runs past the end; rank r takes its r-th micro slice.
    """
    g = world * micro
    start = micro_in_epoch * g + rank * micro
    return [order[(start + j) % len(order)] for j in range(micro)]


def position_of_step(global_step: int, steps_in_epoch: int) -> tuple[int, int]:
    """(epoch, step within the epoch) of the 0-based optimizer step `global_step`."""
    return divmod(global_step, steps_in_epoch)
