"""8-bit blocks on the global flat index (lomo_ds/runtime/quant8.py): stochastic rounding is
unbiased at the sizes updates have (and round-to-nearest is not), the keyed noise makes 1, 2 and 3
ZeRO-3 shards round every element of a whole block as one process does, the error bounds, the
scale rule, block-aligned chunks, and bad block sizes refused."""
import math

import pytest
import torch

from lomo_ds.runtime import quant8

CPU = torch.device("cpu")
B = quant8.DEFAULT_BLOCK


def shards(n: int, world: int) -> list[tuple[int, int]]:
    """(start, local) of each rank's slice under ZeRO-3: ceil(n/N) elements a rank."""
    part = math.ceil(n / world)
    return [(r * part, max(0, min(part, n - r * part))) for r in range(world)]


def grid(q_pieces: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights q * s exactly on an int8 grid: integers in [-120, 120], one scale per block."""
    g = torch.Generator(device=CPU).manual_seed(seed)
    q = torch.randint(-120, 121, (len(q_pieces) * B,), generator=g, device=CPU).to(torch.int8)
    scales = torch.tensor(q_pieces, dtype=torch.float32, device=CPU) * 1e-3
    return q, scales


def mean_step_in_se(mode: str, ratio: float, draws: int = 256) -> float:
    """|mean rounded update - update| in standard errors, for an update of `ratio` steps on every
    element (random signs) of 16 blocks, over `draws` roundings (each step key its own noise)."""
    q0, scales = grid(list(range(1, 17)))
    g = torch.Generator(device=CPU).manual_seed(1)
    sign = torch.randint(0, 2, q0.shape, generator=g, device=CPU).float().mul_(2).sub_(1)
    s = scales.repeat_interleave(B)
    w = q0.float() * s + sign * ratio * s
    total = torch.zeros(q0.shape, dtype=torch.float64, device=CPU)
    for step in range(draws):
        if mode == "stochastic":
            q1, s1, grown = quant8.requantize(w, scales, 0, (7, step, 3))
            assert int(grown) == 0 and torch.equal(s1, scales)
        else:
            q1, _ = quant8.quantize(w, 0, scales=scales, key=None)
        total += ((q1.float() - q0.float()) * sign).double()
    est = total.sum().item() / (draws * q0.numel())  # the mean step taken, in units of s
    se = math.sqrt(ratio * (1 - ratio) / (draws * q0.numel()))
    return abs(est - ratio) / se


@pytest.mark.parametrize("ratio", [0.01, 0.02, 0.05, 0.1])
def test_stochastic_rounding_is_unbiased_for_small_updates(ratio):
    assert mean_step_in_se("stochastic", ratio) < 4.5


@pytest.mark.parametrize("ratio", [0.01, 0.1])
def test_round_to_nearest_fails_the_same_check(ratio):
    """The check can fail: round-to-nearest drops every update under half a step."""
    assert mean_step_in_se("nearest", ratio) > 4.5


def test_noise_depends_on_the_element_and_key_alone():
    key = (11, 5, 2)
    whole = quant8.noise(key, 0, 4096, CPU)
    assert torch.equal(quant8.noise(key, 1000, 333, CPU), whole[1000:1333])
    assert float(whole.min()) >= 0.0 and float(whole.max()) < 1.0
    assert abs(float(whole.mean()) - 0.5) < 4.5 * math.sqrt(1 / 12 / whole.numel())
    other_step = quant8.noise((11, 6, 2), 0, 4096, CPU)
    other_param = quant8.noise((11, 5, 3), 0, 4096, CPU)
    for other in (other_step, other_param):
        corr = torch.corrcoef(torch.stack([whole, other]))[0, 1]
        assert abs(float(corr)) < 4.5 / math.sqrt(whole.numel())
    with pytest.raises(TypeError, match="step"):
        quant8.noise((11, torch.tensor(5), 2), 0, 8, CPU)


def sharded(x: torch.Tensor, world: int, key, scales_by_rank=None):
    out = []
    for r, (start, local) in enumerate(shards(x.numel(), world)):
        s = None if scales_by_rank is None else scales_by_rank[r]
        q, sc = quant8.quantize(x[start:start + local], start, scales=s, key=key)
        out.append((start, local, q, sc))
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_whole_blocks_round_alike_on_any_rank_count(world):
    """Element for element, a shard's whole blocks equal the one-process quantization (scale and
    integers); a cut block's piece has its own absmax scale, and its integers are the reference
    noise applied at that scale: equal to the reference on the piece holding the block's absmax."""
    n = 37 * B + 41
    x = torch.randn(n, generator=torch.Generator(device=CPU).manual_seed(3), device=CPU)
    key = (5, 9, 4)
    ref_q, ref_s = quant8.quantize(x, 0, key=key)
    u = quant8.noise(key, 0, n, CPU)
    cut_pieces = 0
    for start, local, q, sc in sharded(x, world, key):
        first, pieces = quant8.piece_span(start, local, B)
        for p in range(pieces):
            k = first + p
            a, b = max(start, k * B), min(start + local, (k + 1) * B, n)
            mine = q[a - start:b - start]
            whole = a == k * B and b == min((k + 1) * B, n)
            if whole:
                assert torch.equal(mine, ref_q[a:b]) and sc[p] == ref_s[k]
                continue
            cut_pieces += 1
            piece_s = x[a:b].abs().max() / 127
            assert sc[p] == piece_s
            expect = torch.floor(x[a:b] / piece_s + u[a:b]).clamp(-127, 127).to(torch.int8)
            assert torch.equal(mine, expect)
            if x[a:b].abs().max() == x[k * B:min((k + 1) * B, n)].abs().max():
                assert torch.equal(mine, ref_q[a:b])
    assert cut_pieces == (0 if world == 1 else 2 * (world - 1))


@pytest.mark.parametrize("world", [2, 3])
def test_whole_blocks_follow_the_reference_through_updates(world):
    """Several requantized updates on shards: every element of a block whole on its rank stays
    bitwise equal to the one-process run, scale recomputes included."""
    n = 23 * B + 5
    g = torch.Generator(device=CPU).manual_seed(4)
    x = torch.randn(n, generator=g, device=CPU)
    ref_q, ref_s = quant8.quantize(x, 0)
    parts = sharded(x, world, None)
    recomputed = 0
    for step in range(6):
        delta = torch.randn(n, generator=g, device=CPU) * (0.05 if step % 2 else 0.6)
        key = (1, step, 8)
        w = quant8.dequantize(ref_q, ref_s, 0) + delta
        ref_q, ref_s, grown = quant8.requantize(w, ref_s, 0, key)
        recomputed += int(grown)
        new_parts = []
        for start, local, q, sc in parts:
            w_r = quant8.dequantize(q, sc, start) + delta[start:start + local]
            q, sc, _ = quant8.requantize(w_r, sc, start, key)
            new_parts.append((start, local, q, sc))
        parts = new_parts
    assert recomputed > 0  # the large updates grew some blocks: the rule was exercised
    for start, local, q, sc in parts:
        first, pieces = quant8.piece_span(start, local, B)
        for p in range(pieces):
            k = first + p
            a, b = max(start, k * B), min(start + local, (k + 1) * B)
            if a == k * B and b == min((k + 1) * B, n):
                assert torch.equal(q[a - start:b - start], ref_q[a:b]) and sc[p] == ref_s[k]


def test_round_trip_error_bounds():
    x = torch.randn(10 * B + 3, generator=torch.Generator(device=CPU).manual_seed(5), device=CPU) * 3
    start = 77
    for key, bound in ((None, 0.5), ((2, 3, 4), 1.0)):
        q, sc = quant8.quantize(x, start, key=key)
        step = quant8.dequantize(torch.ones_like(q), sc, start)
        err = (quant8.dequantize(q, sc, start) - x).abs()
        assert bool((err <= step * bound * (1 + 1e-5)).all())
        if key is not None:
            assert bool((err < step).all())
    zeros, zs = quant8.quantize(torch.zeros(3 * B, device=CPU), 0, key=(1, 1, 1))
    assert not zeros.any() and not zs.any()
    assert not quant8.dequantize(zeros, zs, 0).any()


def test_dequantize_casts_once_to_the_compute_dtype():
    x = torch.randn(4 * B, generator=torch.Generator(device=CPU).manual_seed(6), device=CPU)
    q, sc = quant8.quantize(x, 0)
    assert torch.equal(quant8.dequantize(q, sc, 0, dtype=torch.bfloat16),
                       quant8.dequantize(q, sc, 0).to(torch.bfloat16))


def test_scale_kept_when_the_max_shrinks_recomputed_when_it_grows():
    x = torch.randn(6 * B, generator=torch.Generator(device=CPU).manual_seed(7), device=CPU)
    q, sc = quant8.quantize(x, 0)
    w = quant8.dequantize(q, sc, 0) * 0.5
    q2, sc2, grown = quant8.requantize(w, sc, 0, (1, 1, 1))
    assert int(grown) == 0 and torch.equal(sc2, sc)
    assert int(q2.abs().max()) <= 64  # halved values on the kept grid
    w = quant8.dequantize(q, sc, 0)
    w[2 * B + 5] = 1.5 * 127 * sc[2]  # past 127 * s in block 2 only
    w[4 * B + 9] = 127 * sc[4]  # exactly at the limit: no recompute
    q3, sc3, grown = quant8.requantize(w, sc, 0, (1, 2, 1))
    assert int(grown) == 1
    assert sc3[2] == w[2 * B:3 * B].abs().max() / 127 and int(q3[2 * B + 5]) == 127
    keep = torch.ones(6, dtype=torch.bool, device=CPU)
    keep[2] = False
    assert torch.equal(sc3[keep], sc[keep])


@pytest.mark.parametrize("start", [0, 5 * B, 5 * B + 17])
def test_block_chunks_requantize_like_the_whole_slice(start):
    local = 9 * B + 50
    chunks = quant8.block_chunks(start, local, 3 * B + 40, block=B)
    assert chunks[0][0] == 0 and chunks[-1][1] == local
    assert all(b1 == a2 for (_, b1), (a2, _) in zip(chunks, chunks[1:], strict=False))
    assert all((start + b) % (3 * B) == 0 for _, b in chunks[:-1])  # ends on the global grid
    g = torch.Generator(device=CPU).manual_seed(8)
    x = torch.randn(local, generator=g, device=CPU)
    q, sc = quant8.quantize(x, start)
    w = quant8.dequantize(q, sc, start) + torch.randn(local, generator=g, device=CPU) * 0.3
    key = (3, 4, 5)
    whole_q, whole_s, whole_n = quant8.requantize(w, sc, start, key)
    parts_q, parts_s, parts_n = [], [], 0
    for a, b in chunks:
        pa, pb = quant8.chunk_pieces(start, a, b, B)
        cq, cs, cn = quant8.requantize(w[a:b], sc[pa:pb], start + a, key)
        parts_q.append(cq)
        parts_s.append(cs)
        parts_n += int(cn)
    assert torch.equal(torch.cat(parts_q), whole_q) and torch.equal(torch.cat(parts_s), whole_s)
    assert parts_n == int(whole_n)


def test_block_chunks_with_row_alignment():
    chunks = quant8.block_chunks(0, 10_000, 1000, block=B, align=96)
    unit = math.lcm(B, 96)
    assert all(b % unit == 0 for _, b in chunks[:-1]) and chunks[-1][1] == 10_000


@pytest.mark.parametrize("block", [100, 0, -8, 12])
def test_block_not_a_multiple_of_8_is_refused(block):
    x = torch.zeros(256, device=CPU)
    with pytest.raises(ValueError, match="block size .* positive multiple of 8"):
        quant8.quantize(x, 0, block=block)
    with pytest.raises(ValueError, match="multiple of 8"):
        quant8.block_chunks(0, 256, 64, block=block)


def test_bad_scales_and_inputs_are_refused():
    x = torch.zeros(3 * B, device=CPU)
    with pytest.raises(ValueError, match="one scale per piece"):
        quant8.quantize(x, 5, scales=torch.zeros(3, device=CPU))  # 4 pieces at start 5
    with pytest.raises(ValueError, match="flat"):
        quant8.quantize(x.view(3, B), 0)
    with pytest.raises(TypeError, match="int8"):
        quant8.dequantize(x, torch.zeros(3, device=CPU), 0)


@pytest.mark.parametrize("mode", ["stochastic", "nearest"])
def test_every_element_is_unbiased(mode):
    """Per element, over 2000 step keys: the mean rounded update of each of 128 elements (updates
    from 0.01 to 0.1 of a step) is its update within 5 standard errors; round-to-nearest is not."""
    draws = 2000
    q0, scales = grid([3])
    ratio = torch.linspace(0.01, 0.1, B, device=CPU)
    w = (q0.float() + ratio) * scales
    total = torch.zeros(B, dtype=torch.float64, device=CPU)
    for step in range(draws):
        if mode == "stochastic":
            q1, _, _ = quant8.requantize(w, scales, 0, (2, step, 9))
        else:
            q1, _ = quant8.quantize(w, 0, scales=scales, key=None)
        total += (q1.float() - q0.float()).double()
    z = (total / draws - ratio.double()).abs() / (ratio * (1 - ratio) / draws).sqrt().double()
    assert bool((z < 5).all()) == (mode == "stochastic")


def _fmix32(z: int) -> int:
    z ^= z >> 16
    z = (z * 0x85EBCA6B) & 0xFFFFFFFF
    z ^= z >> 13
    z = (z * 0xC2B2AE35) & 0xFFFFFFFF
    return z ^ (z >> 16)


def _u_by_hand(key, g: int) -> float:
    """The documented hash in exact Python integers: what every device's int32 tensors must give."""
    k = quant8._mix_int(quant8.stream_key(*key) ^ (g >> 32))
    z = ((g & 0xFFFFFFFF) * 0x9E3779B9 + k) & 0xFFFFFFFF
    z = _fmix32(_fmix32(z) ^ ((k >> 32) & 0xFFFFFFFF))
    return (z >> 8) / 2**24


@pytest.mark.parametrize("first", [0, 2**31 - 3, 2**32 - 5, 3 * 2**32 + 7])
def test_noise_equals_the_hash_in_exact_integers(first):
    """Wrapping int32 arithmetic gives the exact hash, across the 2^31 sign and 2^32 word limits."""
    key = (3, 1 << 40, 12)
    u = quant8.noise(key, first, 11, CPU)
    assert [float(v) for v in u] == [_u_by_hand(key, first + i) for i in range(11)]


def recomputed_share(headroom: float, ratio: float, steps: int = 20) -> float:
    """Share of pieces recomputed a step under updates of `ratio` steps (Gaussian, random signs)."""
    g = torch.Generator(device=CPU).manual_seed(10)
    x = torch.randn(256 * B, generator=g, device=CPU)
    q, s = quant8.quantize(x, 0, headroom=headroom)
    total = 0
    for step in range(steps):
        w = quant8.dequantize(q, s, 0)
        w += torch.randn(w.shape, generator=g, device=CPU) * ratio * s.repeat_interleave(B)
        q, s, grown = quant8.requantize(w, s, 0, (0, step, 0), headroom=headroom)
        total += int(grown)
    return total / steps / s.numel()


def test_headroom_makes_scale_recomputes_rare():
    """With the absmax on 127 any growth of that one element recomputes the piece (a large share
    a step); a headroom of 1/16 leaves updates of a few percent of a step room."""
    assert recomputed_share(0.0, 0.03) > 0.1
    assert recomputed_share(1 / 16, 0.03) == 0.0


def test_headroom_scales():
    x = torch.randn(4 * B, generator=torch.Generator(device=CPU).manual_seed(11), device=CPU)
    q, s = quant8.quantize(x, 0, headroom=1 / 16)
    assert int(q.abs().max()) <= 120 and torch.allclose(s, x.view(4, B).abs().amax(dim=1) * (17 / 16) / 127)
    w = quant8.dequantize(q, s, 0)
    w[B + 3] = 200 * s[1]
    _, s2, grown = quant8.requantize(w, s, 0, (1, 1, 1), headroom=1 / 16)
    assert int(grown) == 1 and torch.allclose(s2[1], w[B:2 * B].abs().max() * (17 / 16) / 127)
    with pytest.raises(ValueError, match="headroom must be in"):
        quant8.quantize(x, 0, headroom=-0.1)


def test_empty_and_single_element_slices():
    """A rank with no element of a small parameter (n < N), and a slice of one element mid-block."""
    (_, _), (_, _), (start, local) = shards(2, 3)
    assert local == 0
    q, s = quant8.quantize(torch.zeros(0, device=CPU), start, key=(1, 1, 1))
    assert q.numel() == 0 and s.numel() == 0 and quant8.dequantize(q, s, start).numel() == 0
    q2, s2, grown = quant8.requantize(torch.zeros(0, device=CPU), s, start, (1, 2, 1))
    assert q2.numel() == 0 and s2.numel() == 0 and int(grown) == 0
    assert quant8.block_chunks(start, 0, 64) == []
    q, s = quant8.quantize(torch.tensor([0.5], device=CPU), B + 2, key=(1, 1, 1))
    assert int(q[0]) == 127 and float(quant8.dequantize(q, s, B + 2)[0]) == 0.5


@pytest.mark.parametrize("world", [1, 2, 3])
def test_chunked_shard_updates_equal_torch_sgd_on_whole_blocks(world):
    """The update's path on each rank's shard (dequantize a block-aligned chunk, SGD in fp32,
    requantize with the keyed noise) against one process running torch.optim.SGD on the whole
    dequantized parameter and requantizing it: bitwise on every block whole on its rank."""
    n, lr, wd = 29 * B + 11, 0.05, 0.01
    g = torch.Generator(device=CPU).manual_seed(12)
    x = torch.randn(n, generator=g, device=CPU)
    ref_q, ref_s = quant8.quantize(x, 0)
    parts = [(st, lo, *quant8.quantize(x[st:st + lo], st)) for st, lo in shards(n, world)]
    for step in range(4):
        grad = torch.randn(n, generator=g, device=CPU)
        key = (21, step, 6)
        p = torch.nn.Parameter(quant8.dequantize(ref_q, ref_s, 0))
        p.grad = grad.clone()
        torch.optim.SGD([p], lr=lr, weight_decay=wd, foreach=False).step()
        ref_q, ref_s, _ = quant8.requantize(p.detach(), ref_s, 0, key)
        new_parts = []
        for start, local, q, s in parts:
            qs, ss = [], []
            for a, b in quant8.block_chunks(start, local, 3 * B, block=B):
                pa, pb = quant8.chunk_pieces(start, a, b, B)
                w = quant8.dequantize(q[a:b], s[pa:pb], start + a)
                w.add_(grad[start + a:start + b].add(w, alpha=wd), alpha=-lr)
                cq, cs, _ = quant8.requantize(w, s[pa:pb], start + a, key)
                qs.append(cq)
                ss.append(cs)
            new_parts.append((start, local, torch.cat(qs), torch.cat(ss)))
        parts = new_parts
    whole_blocks = 0
    for start, local, q, s in parts:
        first, pieces = quant8.piece_span(start, local, B)
        for pi in range(pieces):
            k = first + pi
            a, b = max(start, k * B), min(start + local, (k + 1) * B)
            if a == k * B and b == min((k + 1) * B, n):
                whole_blocks += 1
                assert torch.equal(q[a - start:b - start], ref_q[a:b]) and s[pi] == ref_s[k]
    assert whole_blocks >= ref_s.numel() - (world - 1)
