"""8-bit shards saved on the global grid (lomo_ds/runtime/quant8_grid.py) and read on 1, 2 and 3
ranks: the same rank count, or a one-process save, reads back bitwise; a block cut on the saver
and not on the reader is re-rounded within one step, unbiased."""
import itertools
import math

import pytest
import torch

from lomo_ds.runtime import quant8
from lomo_ds.runtime.quant8_grid import piece_starts, read_slice

CPU = torch.device("cpu")
B = quant8.DEFAULT_BLOCK
N_ELEMENTS = 19 * B + 77


def shards(n: int, world: int) -> list[tuple[int, int]]:
    part = math.ceil(n / world)
    return [(r * part, max(0, min(part, n - r * part))) for r in range(world)]


def trained(world: int):
    """Each rank's (start, local, q, scales) after a load and three keyed updates, some of which
    grow blocks: scales that are not the fresh absmax ones."""
    g = torch.Generator(device=CPU).manual_seed(0)
    x = torch.randn(N_ELEMENTS, generator=g, device=CPU)
    deltas = [torch.randn(N_ELEMENTS, generator=g, device=CPU) * 0.4 for _ in range(3)]
    out = []
    for start, local in shards(N_ELEMENTS, world):
        q, s = quant8.quantize(x[start:start + local], start)
        for step, d in enumerate(deltas):
            w = quant8.dequantize(q, s, start) + d[start:start + local]
            q, s, _ = quant8.requantize(w, s, start, (4, step, 1))
        out.append((start, local, q, s))
    return out


def save(parts):
    q = torch.cat([p[2] for p in parts])
    starts = torch.cat([piece_starts(st, lo, B, device=CPU) for st, lo, _, _ in parts])
    scales = torch.cat([p[3] for p in parts])
    return q, starts, scales


def per_element(starts, scales, n):
    idx = torch.searchsorted(starts, torch.arange(n, device=CPU), right=True) - 1
    return scales[idx]


def test_one_process_save_is_one_scale_per_block():
    _, starts, scales = save(trained(1))
    assert torch.equal(starts, torch.arange(0, N_ELEMENTS, B, device=CPU))
    assert scales.numel() == math.ceil(N_ELEMENTS / B)


@pytest.mark.parametrize("saver,reader", list(itertools.product([1, 2, 3], repeat=2)))
def test_read_on_any_rank_count(saver, reader):
    q_saved, starts, seg_scales = save(trained(saver))
    values = q_saved.float() * per_element(starts, seg_scales, N_ELEMENTS)
    key = (4, 3, 1)
    for start, local in shards(N_ELEMENTS, reader):
        q, s = read_slice(q_saved, starts, seg_scales, start, local, key, B)
        assert s.numel() == quant8.piece_span(start, local, B)[1]
        got = quant8.dequantize(q, s, start)
        mine = values[start:start + local]
        if saver == reader or saver == 1:
            assert torch.equal(q, q_saved[start:start + local]) and torch.equal(got, mine)
        step = quant8.dequantize(torch.ones_like(q), s, start)
        assert bool(((got - mine).abs() < step).all())
        # an element whose reader piece lies in one saved segment keeps its integer
        seg = torch.searchsorted(starts, torch.arange(start, start + local, device=CPU), right=True) - 1
        piece = torch.arange(start, start + local, device=CPU) // B
        one = torch.zeros(local, dtype=torch.bool, device=CPU)
        for p in piece.unique():
            mask = piece == p
            one[mask] = seg[mask].unique().numel() == 1
        assert torch.equal(q[one], q_saved[start:start + local][one])


def test_rerounding_across_saved_segments_is_unbiased():
    """A 2-rank save read by one process: each re-rounded element of the cut block averages to
    its saved value over many keys (a chi-square over those elements, 5 of its standard
    deviations above its mean), and some were re-rounded."""
    q_saved, starts, seg_scales = save(trained(2))
    values = q_saved.float() * per_element(starts, seg_scales, N_ELEMENTS)
    draws, total = 400, torch.zeros(N_ELEMENTS, dtype=torch.float64, device=CPU)
    for step in range(draws):
        q, s = read_slice(q_saved, starts, seg_scales, 0, N_ELEMENTS, (9, step, 2), B)
        total += quant8.dequantize(q, s, 0).double()
    s_el = s.repeat_interleave(B)[:N_ELEMENTS].double()
    frac = (values.double() / s_el) % 1
    # re-rounded elements with at least ~8 expected round-ups or downs: near-normal means
    moved = (per_element(starts, seg_scales, N_ELEMENTS) != s_el) & (frac * (1 - frac) > 0.02)
    k = int(moved.sum())
    assert k > 10
    var = s_el.pow(2) * frac * (1 - frac) / draws
    chi2 = ((total / draws - values.double()).pow(2) / var)[moved].sum()
    assert float(chi2) < k + 5 * math.sqrt(2 * k)


def test_bad_segment_table_is_refused():
    q = torch.zeros(4 * B, dtype=torch.int8, device=CPU)
    with pytest.raises(ValueError, match="ascending from 0"):
        read_slice(q, torch.tensor([0, 256, 128], device=CPU), torch.ones(3, device=CPU), 0, 4 * B, (1, 1, 1))
    with pytest.raises(ValueError, match="equal length"):
        read_slice(q, torch.tensor([0, 128], device=CPU), torch.ones(3, device=CPU), 0, 4 * B, (1, 1, 1))
