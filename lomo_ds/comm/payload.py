"""The reduce-scatter payload every gradient transport carries, and its non-finite flag.

The payload is rank-major: row r of a [world, width + 1] matrix holds, for every parameter of a
bucket, the elements rank r owns (zero-padded to the parameter's per-rank `part`), then one flag
element: 0 when this rank's gradients in the bucket, and everything it has received in the pass
so far, are finite; NaN otherwise. The collective sums the flags with the gradients, so every rank
receives the same verdict on the bucket with no extra collective.
"""
from __future__ import annotations

import math

import torch

SUM_PIECE = 1 << 22  # elements of an fp16 tensor converted to fp32 at once by _sum32


def all_finite(t: torch.Tensor) -> torch.Tensor:
    """Whether every element of `t` is finite, as a device bool (no host sync), from its fp32 sum:
    a NaN, or an infinity, makes the sum non-finite (inf - inf is NaN). A sum reads each element
    once with no per-element output, where torch.isfinite writes a mask as large as `t`. A sum of
    finite elements that overflows fp32 (elements of 1e32 and more) reads as non-finite: the step
    is skipped, the safe side, and such a gradient is no gradient to step on."""
    return torch.isfinite(_sum32(t))


def _sum32(t: torch.Tensor) -> torch.Tensor:
    """The sum of `t` as a finiteness test, without an fp32 copy of `t`: torch's sum(dtype=fp32) of
    a bf16 tensor on a CPU converts the whole tensor first (twice the largest gradient's bytes).
    bf16 has fp32's exponent range, so its own sum (accumulated in fp32) overflows where an fp32
    sum would; fp16's does not, so an fp16 tensor is summed in fp32 a bounded piece at a time."""
    if t.dtype in (torch.float32, torch.bfloat16):
        return t.sum().float()
    flat = t.reshape(-1)
    total = torch.zeros((), dtype=torch.float32, device=t.device)
    for a in range(0, flat.numel(), SUM_PIECE):
        total += flat[a:a + SUM_PIECE].sum(dtype=torch.float32)
    return total


def nonfinite_marker(t: torch.Tensor, finite_so_far: torch.Tensor | None = None) -> torch.Tensor:
    """0 when every element of `t` is finite (and `finite_so_far` holds), NaN otherwise: 0 * sum
    (inf * 0 and NaN * 0 are NaN). A device tensor, so building the flag costs no host sync. A sum
    rather than a min and a max: `t` is the packed payload, a strided view (the flag column sits
    between its rows), which a sum reads in one pass."""
    marker = _sum32(t).mul_(0.0)
    if finite_so_far is not None:
        marker = torch.where(finite_so_far, marker, math.nan)
    return marker


def pack(send: torch.Tensor, spans: list[slice], grads: list[torch.Tensor | None], world: int) -> None:
    """Fill the gradient columns of the rank-major payload `send` (its flag column is the caller's):
    each gradient's flat elements [r*part, (r+1)*part) go to row r of its columns `spans`, zeros
    where a gradient is None or runs short."""
    for cols, g in zip(spans, grads, strict=True):
        if g is None:
            send[:, cols].zero_()  # no gradient on this rank: it contributes zeros
            continue
        flat, part = g.reshape(-1), cols.stop - cols.start
        full_rows = g.numel() // part
        send[:full_rows, cols].copy_(flat[:full_rows * part].view(full_rows, part))  # one copy (one kernel launch)
        if full_rows < world:
            send[full_rows:, cols].zero_()
            tail = g.numel() - full_rows * part
            if tail:
                send[full_rows, cols.start:cols.start + tail].copy_(flat[full_rows * part:])
