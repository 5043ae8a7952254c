"""8-bit shards in a checkpoint: scales on the parameter's global grid, read by any rank count.

A saved parameter of n elements is its int8 values in flat order (every rank's slice, concatenated)
and a segment table: the global start of each segment, ascending, and its scale. The segments are
the saving ranks' pieces (quant8): one per block where the block was whole on a rank, one per
rank's part where a shard boundary cut it. With one saving process, or blocks that divide the
partition size, the table is exactly one scale per block k at k * B.

A reader's slice has its own pieces (its rank count's cuts). Each reader piece takes the largest
scale among the saved segments it overlaps; an element whose saved scale is that one keeps its
integer (bitwise), any other is re-rounded from q * s_saved to the larger scale with the keyed
stochastic rounding (unbiased). So a read is lossless wherever every reader piece lies within one
saved segment: always when the saver's blocks were whole (one process, or B dividing the
partition size), and on the same rank count; only a block cut on the saver and whole (or cut
elsewhere) on the reader is re-rounded, at most N_saver - 1 blocks a parameter.
"""
from __future__ import annotations

import torch

from lomo_ds.runtime.quant8 import DEFAULT_BLOCK, QMAX, noise, piece_span


def piece_starts(start: int, local: int, block: int = DEFAULT_BLOCK, *,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """Global start of each piece of the slice [start, start + local): this rank's part of the
    segment table (concatenated over ranks in order, the table's starts)."""
    first, pieces = piece_span(start, local, block)
    starts = torch.arange(first, first + pieces, dtype=torch.int64, device=device).mul_(block)
    if pieces:
        starts[0] = start
    return starts


def read_slice(q_saved: torch.Tensor, seg_start: torch.Tensor, seg_scale: torch.Tensor, start: int, local: int,
               key: tuple[int, int, int], block: int = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8, scales) of the slice [start, start + local) read from a saved parameter: q_saved its
    int8 values in flat order (all of them, or any tensor indexable by global element), seg_start
    and seg_scale its segment table. `key` keys the re-rounding where a piece spans saved
    segments of different scales (the resumed step's key)."""
    if seg_start.dim() != 1 or seg_start.shape != seg_scale.shape or seg_start.numel() == 0:
        raise ValueError(f"segment table must be two flat tensors of equal length >= 1, got starts "
                         f"{tuple(seg_start.shape)} and scales {tuple(seg_scale.shape)}")
    if int(seg_start[0]) != 0 or bool((seg_start[1:] <= seg_start[:-1]).any()):
        raise ValueError("segment table starts must be ascending from 0")
    device = q_saved.device
    q = q_saved[start:start + local]
    g = torch.arange(start, start + local, dtype=torch.int64, device=device)
    s_old = seg_scale.to(device)[torch.searchsorted(seg_start.to(device), g, right=True) - 1]
    first, pieces = piece_span(start, local, block)
    head = start - first * block
    padded = torch.zeros(pieces * block, dtype=torch.float32, device=device)
    padded[head:head + local] = s_old
    scales = padded.view(pieces, block).amax(dim=1)
    s_new = scales.repeat_interleave(block)[head:head + local]
    moved = s_old != s_new
    w = q.to(torch.float32) * s_old
    safe = torch.where(s_new > 0, s_new, torch.ones((), dtype=torch.float32, device=device))
    rounded = torch.floor(w / safe + noise(key, start, local, device)).clamp_(-QMAX, QMAX).to(torch.int8)
    return torch.where(moved, rounded, q), scales
