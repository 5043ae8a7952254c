"""8-bit weight shards: int8 absmax blocks on each parameter's global flat index, and stochastic
rounding with noise keyed by the element, so that every rank count draws the same noise for it.

Format. int8 with one fp32 scale per block of B elements (B = 128 by default): an element is
stored as q in [-127, 127] and read as q * s, with s = absmax / 127 when the block's scale is set.
    - int8 rather than fp8: int8 spaces its 255 levels evenly over [-absmax, absmax], a step of
      absmax/127 everywhere. e4m3's 3 mantissa bits give a step of 1/16 to 1/8 of the value itself:
      coarser than int8's for every value above absmax/8, which is where most of a block's 128
      weights lie; finer only below absmax/16 (e5m2, with 2 bits, is coarser still). On an even
      grid stochastic rounding is one formula, floor(w/s + u) with one uniform u; on fp8's grid the
      step changes with the exponent. int8 also needs no hardware support: every device has int8
      tensors and fp32 arithmetic.
    - Symmetric ([-127, 127], no -128, no offset): zero is exact, a weight's sign never depends on
      rounding, and one scale per block is all the state.
    - B = 128: 4 bytes of scale per 128 bytes of weights (1.03 bytes a parameter, 0.52x of bf16).
      Smaller blocks track outliers more closely at more scale bytes (B = 32: 1.125 bytes a
      parameter); larger ones let one outlier coarsen more weights. B must be a multiple of 8, so
      that blocks fall on 8-byte words of the int8 buffer and on DeepSpeed's quantizer groups
      (which it requires to be multiples of 8).

Blocks lie on the parameter's global flat index: block k is [k*B, (k+1)*B) (the last one ends at
numel). A rank's shard is the slice [start, start + local) of the flat parameter (ZeRO-3: ceil(n/N)
elements per rank); its *pieces* are the slice's intersections with the blocks, one scale each, in
order: piece p of a slice covers block start // B + p. A piece is either a whole block, or the part
of a block that a shard boundary cuts (each rank then keeps a scale for its own piece). So:
    - The noise of an element is a function of (seed, step, parameter id, global element index)
      alone (`noise`): the same on every rank count and in a one-process reference.
    - A block that is whole on this rank (every block of a one-process reference, and all but at
      most N-1 blocks of a parameter on N ranks) is quantized exactly as the reference quantizes it,
      bit for bit, at every step, given the same values: its scale and its integers depend on its
      own elements and its own history only.
    - A cut block is not rank-count independent: each piece's scale comes from the piece's own
      absmax and history. Quantized from the same values, the piece that holds the block's absmax
      gets the reference's scale and integers, the other piece a scale at most as large (finer
      steps) and its own integers; through updates the pieces' scales move apart from the
      reference block's. The noise is still the reference's, element for element.
    - Checkpoints (quant8_grid) map pieces to the global grid by their block index: piece p of a
      slice is block start // B + p. A block is saved with one scale when it was whole, and as its
      pieces (the saving run's cut offset and one scale a side) when it was cut. A reader keeps a
      saved scale wherever its own piece lies within one saved segment (a piece of a whole saved
      block keeps the block's scale: its absmax is no larger, as the scale rule allows, so that
      read is lossless); where its piece spans two saved segments, it takes the larger scale and
      re-rounds the other segment's integers stochastically (unbiased, not bitwise).
    - DeepSpeed's own gather (ZeRO++ quantized partitions) dequantizes groups of equal size,
      gathered_numel / scales_numel. The pieces are such groups only when B divides the partition
      size ceil(n/N) (`uniform_groups`); otherwise the gather must dequantize piece by piece.

Stochastic rounding. An update reads w = q * s in fp32, changes it, and writes q' = floor(w/s + u),
u uniform in [0, 1): E[q' * s] = w whatever the update's size, so steps far below one quantization
step s still add up in expectation. u is a counter-based hash of the key and the element's global
index (the key mixed on the host, then murmur3's finaliser twice in torch int32 arithmetic on the
tensor's device: no generator state, no host synchronisation), keeping its top 24 bits:
u = k / 2^24. The fp32 sum w/s + u is below 128 in magnitude, so its rounding moves the chance of
rounding up by at most 2^-17: a bias below 2^-17 of a step, far under what an update of 1% of a
step needs.

The scale rule. After an update a piece's scale is recomputed only when its new absolute maximum
exceeds 127 * s; the piece is then re-rounded at s = absmax * (1 + headroom) / 127 (with the step's
keyed noise: unbiased, with more variance than a step at the old scale: every integer of the piece
moves off the grid by up to the maximum's growth). When the maximum shrinks s is kept, so that a
block's grid does not move under updates far smaller than its step. `requantize` returns how many
pieces were recomputed, as a device tensor, for the caller to report.
    - How often: with headroom 0 a fresh scale puts the piece's maximum exactly on 127, so any
      update that grows that one element recomputes the piece: with Gaussian weights and updates
      of 1-10% of a step in random directions, 17-50% of the pieces every step (fewer as the
      scale ratchets up to the maximum's running peak). A headroom of 1/16 (the maximum on 119.5,
      steps 6% coarser) leaves such updates 7.5 steps of room: recomputes drop to about 0.02% of
      the pieces a step at 10% of a step over 100 steps, none at 1-3%. benchmarks/quant8_bench.py prints both.
    - The default headroom is 0 (s = absmax / 127 exactly, the format as specified); a caller
      that reports frequent recomputes passes a headroom.

Chunks. `block_chunks` cuts a slice into chunks whose ends fall on block boundaries of the global
grid, so that a chunk holds whole pieces: requantizing a slice chunk by chunk, each with its own
scales (`chunk_pieces`), is the same as requantizing it at once.
"""
from __future__ import annotations

import math

import torch

from lomo_ds.runtime.shard_geometry import chunk_bounds

DEFAULT_BLOCK = 128
QMAX = 127
_U_BITS = 24
_MASK64 = (1 << 64) - 1


def check_block(block: int) -> int:
    """`block` as the block size, or a clear error: a positive multiple of 8."""
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0 or block % 8:
        raise ValueError(f"block size (elements per 8-bit scale) must be a positive multiple of 8, got {block!r}")
    return block


def _mix_int(z: int) -> int:
    """The splitmix64 finaliser on a Python int (the host side of the key)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


_GOLDEN = 0x9E3779B97F4A7C15


def stream_key(seed: int, step: int, param_id: int) -> int:
    """One 64-bit key per (seed, step, parameter): the three mixed in turn, so that nearby seeds,
    steps and parameter ids give unrelated streams."""
    for name, v in (("seed", seed), ("step", step), ("param_id", param_id)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"noise key {name} must be a Python int, got {type(v).__name__}")
    z = _mix_int(seed + _GOLDEN)
    z = _mix_int(z ^ (step + 2 * _GOLDEN))
    return _mix_int(z ^ (param_id + 3 * _GOLDEN))


def _s32(v: int) -> int:
    """A 32-bit pattern as the int32 that holds it."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


_W32, _F1, _F2 = _s32(0x9E3779B9), _s32(0x85EBCA6B), _s32(0xC2B2AE35)


def _xorshift_(z: torch.Tensor, tmp: torch.Tensor, k: int) -> None:
    """z ^= z >>> k on int32 bit patterns, in place (torch's >> is arithmetic on signed ints)."""
    torch.bitwise_right_shift(z, k, out=tmp)
    z.bitwise_xor_(tmp.bitwise_and_((1 << (32 - k)) - 1))


def _fmix32_(z: torch.Tensor, tmp: torch.Tensor) -> None:
    """murmur3's 32-bit finaliser, in place; multiplications wrap modulo 2^32."""
    _xorshift_(z, tmp, 16)
    z.mul_(_F1)
    _xorshift_(z, tmp, 13)
    z.mul_(_F2)
    _xorshift_(z, tmp, 16)


def _noise_words(key64: int, hi: int, lo: int, count: int, device: torch.device) -> torch.Tensor:
    """The 32-bit hash of elements hi * 2^32 + [lo, lo + count) (lo + count <= 2^32)."""
    k = _mix_int(key64 ^ hi)
    z = torch.arange(count, dtype=torch.int32, device=device).add_(_s32(lo))
    tmp = torch.empty_like(z)
    z.mul_(_W32).add_(_s32(k))
    _fmix32_(z, tmp)
    z.bitwise_xor_(_s32(k >> 32))
    _fmix32_(z, tmp)
    return z


def noise(key: tuple[int, int, int], first: int, count: int, device: torch.device) -> torch.Tensor:
    """u in [0, 1) (fp32, multiples of 2^-24) for global flat elements [first, first + count) of
    the parameter named by key = (seed, step, param_id). Element g's u depends on (key, g) alone:
    the high word of g and the key are mixed on the host (exact Python ints), the low word on the
    device in int32 (two rounds of murmur3's finaliser, keyed by the two halves of the mixed key;
    int32 arithmetic vectorises on every device, where int64 multiplication does not on CPUs).
    Integer multiplications wrap modulo 2^32, as two's-complement int32 does on every device."""
    if first < 0 or count < 0:
        raise ValueError(f"noise: first and count must be >= 0, got first={first}, count={count}")
    key64 = stream_key(*key)
    out = torch.empty(count, dtype=torch.float32, device=device)
    pos = 0
    while pos < count:  # one run per 2^32-element window of the flat index (almost always one)
        g = first + pos
        n = min(count - pos, ((g >> 32) + 1 << 32) - g)
        z = _noise_words(key64, g >> 32, g & 0xFFFFFFFF, n, device)
        torch.bitwise_right_shift(z, 32 - _U_BITS, out=z)
        z.bitwise_and_((1 << _U_BITS) - 1)
        out[pos:pos + n] = z
        pos += n
    return out.mul_(2.0**-_U_BITS)


def piece_span(start: int, local: int, block: int) -> tuple[int, int]:
    """(first block, number of pieces) of the slice [start, start + local): piece p of the slice
    is its part of global block first + p."""
    check_block(block)
    if start < 0 or local < 0:
        raise ValueError(f"slice start and length must be >= 0, got start={start}, local={local}")
    if local == 0:
        return start // block, 0
    first = start // block
    return first, (start + local - 1) // block - first + 1


def uniform_groups(part: int, block: int = DEFAULT_BLOCK) -> bool:
    """Whether every rank's pieces are whole blocks for a partition size `part` (ceil(n/N)): then
    the pieces are the equal groups DeepSpeed's gather dequantizes (padding pieces scaled 0)."""
    return part % check_block(block) == 0


def _blocked(x: torch.Tensor, start: int, block: int) -> tuple[torch.Tensor, int]:
    """x (the slice's elements) padded with zeros to whole blocks of the global grid, as a
    (pieces, block) tensor, and the offset of x's first element in it. Zeros change no absmax."""
    first, pieces = piece_span(start, x.numel(), block)
    head = start - first * block
    if head == 0 and x.numel() == pieces * block:
        return x.reshape(pieces, block), 0
    out = torch.zeros(pieces * block, dtype=x.dtype, device=x.device)
    out[head:head + x.numel()] = x.reshape(-1)
    return out.view(pieces, block), head


def _unblocked(t: torch.Tensor, head: int, n: int) -> torch.Tensor:
    return t.reshape(-1)[head:head + n]


def _check_slice(x: torch.Tensor, what: str, dtype: torch.dtype | None = None) -> None:
    if x.dim() != 1:
        raise ValueError(f"{what} must be a flat (1-D) slice, got shape {tuple(x.shape)}")
    if dtype is not None and x.dtype != dtype:
        raise TypeError(f"{what} must be {dtype}, got {x.dtype}")


def _check_scales(scales: torch.Tensor, start: int, n: int, block: int) -> None:
    _, pieces = piece_span(start, n, block)
    if scales.dim() != 1 or scales.numel() != pieces or scales.dtype != torch.float32:
        raise ValueError(f"scales must be a flat fp32 tensor of one scale per piece ({pieces} for {n} elements at "
                         f"start {start}, block {block}), got {scales.dtype} of shape {tuple(scales.shape)}")


def _round_blocks(xb: torch.Tensor, scales: torch.Tensor, key, start: int, head: int, block: int) -> torch.Tensor:
    """Integers of the blocked values at the given scales: floor(x/s + u) with the keyed noise,
    or round-to-nearest without a key. A piece scaled 0 (all zeros) stays 0."""
    safe = torch.where(scales > 0, scales, torch.ones((), dtype=scales.dtype, device=scales.device))
    y = xb.to(torch.float32) / safe.unsqueeze(1)
    if key is None:
        y = torch.round(y)
    else:
        y = y.add_(noise(key, start - head, xb.numel(), xb.device).view_as(y)).floor_()
    return y.clamp_(-QMAX, QMAX).to(torch.int8)


def _levels(headroom: float) -> float:
    """The integer a fresh scale maps a piece's absmax to: 127 / (1 + headroom)."""
    if not 0.0 <= headroom < 1.0:
        raise ValueError(f"scale headroom must be in [0, 1), got {headroom!r}")
    return QMAX / (1.0 + headroom)


def quantize(x: torch.Tensor, start: int, *, block: int = DEFAULT_BLOCK, scales: torch.Tensor | None = None,
             key: tuple[int, int, int] | None = None, headroom: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 slice, fp32 scales) of the slice x = flat elements [start, start + x.numel()) of a
    parameter. scales None: each piece gets absmax * (1 + headroom) / 127; else the given scales
    are used as they are (a value beyond 127 * s saturates: see `requantize` for the scale rule).
    key None rounds to nearest (error <= s/2, deterministic: the starting weights); key =
    (seed, step, param_id) rounds stochastically with the keyed noise (error < s, unbiased)."""
    _check_slice(x, "quantize's input")
    check_block(block)
    xb, head = _blocked(x.to(torch.float32), start, block)
    if scales is None:
        levels = _levels(headroom)
        scales = xb.abs().amax(dim=1) / levels if xb.numel() else torch.zeros(0, dtype=torch.float32, device=x.device)
    else:
        _check_scales(scales, start, x.numel(), block)
    q = _round_blocks(xb, scales, key, start, head, block)
    return _unblocked(q, head, x.numel()), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, start: int, *, block: int = DEFAULT_BLOCK,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The slice's values q * s in `dtype` (computed in fp32, then cast once)."""
    _check_slice(q, "dequantize's input", torch.int8)
    _check_scales(scales, start, q.numel(), block)
    qb, head = _blocked(q, start, block)
    out = qb.to(torch.float32).mul_(scales.unsqueeze(1))
    return _unblocked(out, head, q.numel()).to(dtype)


def requantize(w: torch.Tensor, scales: torch.Tensor, start: int, key: tuple[int, int, int], *,
               block: int = DEFAULT_BLOCK, headroom: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 slice, scales, pieces recomputed) after an update wrote the fp32 values w of the
    slice whose scales were `scales`. A piece whose new absmax exceeds 127 * s gets
    s = absmax * (1 + headroom) / 127; the others keep s. Every element is rounded stochastically
    with the keyed noise. The count is an int64 device tensor (no host synchronisation). w must be
    finite: a non-finite value has no integer (the caller's overflow check comes first)."""
    _check_slice(w, "requantize's input")
    _check_scales(scales, start, w.numel(), block)
    wb, head = _blocked(w.to(torch.float32), start, block)
    peak = wb.abs().amax(dim=1) if wb.numel() else torch.zeros(0, dtype=torch.float32, device=w.device)
    grown = peak > scales * QMAX
    new_scales = torch.where(grown, peak / _levels(headroom), scales)
    q = _round_blocks(wb, new_scales, key, start, head, block)
    return _unblocked(q, head, w.numel()), new_scales, grown.sum()


def block_chunks(start: int, local: int, size: int, *, block: int = DEFAULT_BLOCK,
                 align: int = 1) -> list[tuple[int, int]]:
    """[a, b) chunks of the slice [start, start + local), each at most `size` elements (at least
    one unit, rounded down to a multiple of it; the unit is lcm(block, align)), every end but the
    slice's own at a multiple of the unit in the global flat index: each chunk holds whole pieces,
    and with `align` a row length, whole rows."""
    check_block(block)
    if size < 1 or align < 1:
        raise ValueError(f"chunk size and align must be >= 1, got size={size}, align={align}")
    return chunk_bounds(local, size, start, math.lcm(block, align))


def chunk_pieces(start: int, a: int, b: int, block: int = DEFAULT_BLOCK) -> tuple[int, int]:
    """[pa, pb): the slice's pieces that chunk [a, b) of `block_chunks` covers, so that chunk's
    scales are scales[pa:pb] (and its start is start + a)."""
    first, _ = piece_span(start, 0, block)
    lo, n = piece_span(start + a, b - a, block)
    return lo - first, lo - first + n
