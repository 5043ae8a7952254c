"""The update in chunks (memory.update_chunk_elements): fp32 results bit for bit the unchunked ones,
bf16 stochastic rounding still unbiased, and the engine the same on 1, 2 and 3 ranks."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from lomo_ds.config.lomo_section import AdaLomoConfig
from lomo_ds.engine.accumulation import ShardAccumulator
from lomo_ds.engine.update import AdaLomo, PassSettings, ShardGeometries, ShardUpdater, chunk_bounds
from tests.ranks import multi_rank_checks, ok

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SHAPES = [(61, 37), (37,), (29, 61), (5, 3, 7)]


def make_params(weights: str, seed: int = 0):
    """One-rank ZeRO-3 parameters (the attributes the update reads: lomo_ds.runtime.ds_compat)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    module, params = torch.nn.Module(), []
    for i, shape in enumerate(SHAPES):
        n = math.prod(shape)
        p = torch.nn.Parameter(torch.empty(0, dtype=DTYPES[weights]))
        p.ds_tensor = torch.randn(n, generator=gen, dtype=torch.float32, device="cpu").to(DTYPES[weights])
        p.ds_numel, p.ds_shape, p.ds_id = n, torch.Size(shape), i
        module.register_parameter(f"p{i}", p)
        params.append(p)
    return module, params


def grads_for(params, dtype: str, seed: int = 1):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(p.ds_numel, generator=gen, dtype=torch.float32, device="cpu").to(DTYPES[dtype])
            for p in params]


def run_updates(chunk: int, weights: str = "fp32", grads: str = "fp32", adalomo: bool = False, master=False,
                rounding=True, rule=None, accumulated: bool = False, steps: int = 3):
    """`steps` update passes; returns the shards, masters and, per pass, the measuring pass's norm."""
    module, params = make_params(weights)
    geometries = ShardGeometries()
    ada = AdaLomo(AdaLomoConfig(), module, params, None, geometries) if adalomo else None
    updater = ShardUpdater(rounding, 7, torch.device("cpu"), geometries, ada, params if master else (), chunk=chunk)
    rule = rule or PassSettings(lr=0.05, grad_scale=0.5, clip_value=0.7, weight_decay=0.1)
    norms = []
    for step in range(steps):
        gs = grads_for(params, grads, seed=10 + step)
        measure = updater.begin_pass(rule, measure=True, step=step)
        updater.apply_bucket([(p, g.clone()) for p, g in zip(params, gs, strict=True)], measure)
        norms.append(measure.sum_sq.item())
        stats = updater.begin_pass(rule, step=step)
        if accumulated:
            items = accumulated_sums(params, gs, torch.float32)
        else:
            items = [(p, g.clone()) for p, g in zip(params, gs, strict=True)]
        if adalomo:
            updater.apply_bucket(items, stats)
        else:
            for p, g in items:
                updater.apply(p, g, stats.finite)
    return [p.ds_tensor.clone() for p in params], [m.clone() for m in updater.masters.values()], norms


def accumulated_sums(params, gs, dtype: torch.dtype) -> list:
    """(param, sum) of a window of two micro-batches, each of gradient `gs`, as the engine's
    accumulator hands it to the update: the first added into a `dtype` buffer, the last one given
    with it (lazy_total)."""
    acc = ShardAccumulator(params, lambda p: p.ds_numel, dtype, on_host=False)
    for p, g in zip(params, gs, strict=True):
        acc.add(p, g.clone())
    return [(p, acc.lazy_total(p, torch.device("cpu"), g.clone())) for p, g in zip(params, gs, strict=True)]


def test_chunk_bounds_tile_the_slice_and_keep_rows_whole():
    assert chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(10, 100) == [(0, 10)]
    # A slice starting at flat element 5 of a matrix with rows of 3: ends at multiples of 6 (two rows).
    assert chunk_bounds(14, 7, start=5, align=3) == [(0, 1), (1, 7), (7, 13), (13, 14)]
    assert chunk_bounds(5, 2, align=3) == [(0, 3), (3, 5)]  # never less than one row
    assert chunk_bounds(0, 4) == []


@pytest.mark.parametrize("case", [
    dict(),  # fp32 shards, fp32 gradients
    dict(grads="bf16"),  # an fp32 copy of each chunk of a bf16 gradient
    dict(weights="bf16", master=True),  # fp32 masters
    dict(rule=PassSettings(lr=0.05, grad_scale=0.5)),  # no clipping, no decay
    dict(accumulated=True),  # the accumulator's sum (and the window's last slice)
    dict(adalomo=True),
    dict(adalomo=True, accumulated=True),
    dict(adalomo=True, weights="bf16", master=True),
], ids=str)
def test_fp32_results_are_bit_identical_to_the_unchunked_update(case):
    whole = run_updates(1 << 30, **case)
    chunked = run_updates(7, **case)
    for a, b in zip(whole[0] + whole[1], chunked[0] + chunked[1], strict=True):
        assert torch.equal(a, b)
    if case.get("grads", "fp32") == "fp32":
        assert whole[2] == chunked[2]  # the clipping norm too
    else:  # a bf16 gradient's norm is summed chunk by chunk (fp64 across chunks): equal to rounding
        assert whole[2] == pytest.approx(chunked[2], rel=1e-6)


def test_bf16_chunks_on_a_cpu_draw_the_unchunked_noise():
    # On a CPU the generator hands out its draws element after element: chunked draws are the same.
    whole = run_updates(1 << 30, weights="bf16")[0]
    chunked = run_updates(7, weights="bf16")[0]
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked, strict=True))


@pytest.mark.parametrize("grads", ["bf16", "fp32"])
@pytest.mark.parametrize("accumulated", [None, "fp32", "bf16"], ids=["reduced", "acc_fp32", "acc_bf16"])
@pytest.mark.parametrize("chunk", [1 << 30, 50], ids=["whole", "chunked"])
def test_bf16_adalomo_is_the_reference_on_the_same_weights(grads, chunk, accumulated):
    """bf16 weights without masters, against the reference AdaLomo computed in fp32 from the same
    bf16 weights and rounded to nearest: within one bf16 ulp. Each of AdaLomo's three passes reads
    the gradient again; a pass that wrote a view of it (the received slice, the accumulator) fed its
    writes to the next, hundreds of ulps off. The accumulated sum is the buffer plus the
    window's last slice, which must be added once however often the passes read it."""
    from tests.adalomo_reference import ReferenceAdaLomo

    module, params = make_params("bf16")
    before = [p.ds_tensor.float() for p in params]
    rule = PassSettings(lr=0.05, grad_scale=0.5, clip_value=0.7, weight_decay=0.1)
    geometries = ShardGeometries()
    updater = ShardUpdater(False, 7, torch.device("cpu"), geometries,
                           AdaLomo(AdaLomoConfig(), module, params, None, geometries), chunk=chunk)
    gs = grads_for(params, grads, seed=10)
    items = (accumulated_sums(params, gs, DTYPES[accumulated]) if accumulated
             else [(p, g.clone()) for p, g in zip(params, gs, strict=True)])
    updater.apply_bucket(items, updater.begin_pass(rule, step=0))

    shadow = [torch.nn.Parameter(w.clone().view(p.ds_shape)) for w, p in zip(before, params, strict=True)]
    for s, g in zip(shadow, gs, strict=True):
        total = g.float() if not accumulated else g.to(DTYPES[accumulated]).float() + g.float()
        s.grad = (total * rule.grad_scale).clamp(-rule.clip_value, rule.clip_value).view(s.shape)
    ReferenceAdaLomo(shadow, rule.lr, weight_decay=rule.weight_decay).step()
    for p, s, w in zip(params, shadow, before, strict=True):
        mine, ref = p.ds_tensor.float(), s.detach().view(-1).to(torch.bfloat16).float()
        assert (mine != w).float().mean() > 0.5, "the update must move the weights"
        ulp = torch.exp2(torch.floor(torch.log2(torch.maximum(ref.abs(), w.abs()).clamp(min=1e-30))) - 7)
        assert ((mine - ref).abs() / ulp).max() <= 1.0


@pytest.mark.parametrize("grads", ["bf16", "fp32"])
def test_chunked_adalomo_of_bf16_slices_matches_the_whole_slice(grads):
    # bf16 weights: the three passes run chunk by chunk (sums in another order): equal to
    # rounding, the stochastic noise the same on a CPU.
    whole = run_updates(1 << 30, weights="bf16", grads=grads, adalomo=True, rounding=False)[0]
    chunked = run_updates(50, weights="bf16", grads=grads, adalomo=True, rounding=False)[0]
    for a, b in zip(whole, chunked, strict=True):
        # at most one bf16 ulp apart where the unrounded values straddle a rounding boundary
        assert torch.allclose(a.float(), b.float(), rtol=2**-7, atol=1e-6)
        assert (a != b).float().mean() < 0.01


def test_chunked_stochastic_rounding_is_unbiased():
    """Every weight 1.0 in bf16, every update a quarter of a bf16 ulp (2^-7 at 1.0): rounded
    chunk by chunk, the mean moves by exactly the update (within 6 standard errors), and the chunks
    draw different noise (a generator restarted per chunk would repeat one chunk's pattern)."""
    n, chunk = 200_003, 4096
    p = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16))
    p.ds_tensor, p.ds_numel, p.ds_id = torch.ones(n, dtype=torch.bfloat16), n, 0
    updater = ShardUpdater(True, 3, torch.device("cpu"), chunk=chunk)
    stats = updater.begin_pass(PassSettings(lr=1.0), step=0)
    updater.apply(p, torch.full((n,), -(2**-9), dtype=torch.float32), stats.finite)  # w - lr g = 1 + 2^-9
    r = p.ds_tensor.float()
    assert set(r.unique().tolist()) == {1.0, 1.0 + 2**-7}
    exact, p_up = 1.0 + 2**-9, 0.25
    stderr = 2**-7 * math.sqrt(p_up * (1 - p_up) / n)
    assert abs(r.mean().item() - exact) < 6 * stderr
    ups = (r > 1.0).view(-1)[:(n // chunk) * chunk].view(-1, chunk)
    assert not torch.equal(ups[0], ups[1])
    # each chunk is unbiased on its own too (4096 draws: within 6 standard errors)
    per_chunk = ups.float().mean(dim=1)
    assert (per_chunk - p_up).abs().max() < 6 * math.sqrt(p_up * (1 - p_up) / chunk)


# ----------------------------------------------------------------------------- the engine, 1-3 ranks
def _engine_pair(optimizer: str, **lomo):
    import lomo_ds
    from tests.engine.dist_engine_checks import ds_cfg
    from tests.tiny import global_batch, tiny_llama

    out = {}
    for chunk in (1 << 30, 5):
        cfg = ds_cfg(update_chunk_elements=chunk, optimizer=optimizer, **lomo)
        engine = lomo_ds.initialize(copy.deepcopy(tiny_llama(3)), cfg)
        norms = []
        for step in range(4):
            mbs = global_batch(step, engine.world)
            norms.append(engine.train_step(mbs[engine.rank])["grad_norm"])
        out[chunk] = (engine.full_state_dict(), norms)
    (whole, n_whole), (chunked, n_chunked) = out[1 << 30], out[5]
    if whole is None:
        return {}
    return {"equal": all(torch.equal(whole[k], chunked[k]) for k in whole), "norms_equal": n_whole == n_chunked,
            "norms": n_whole}


ENGINE = multi_rank_checks(
    (1, 2, 3),
    sgd_chunked=lambda: _engine_pair("sgd", clip_grad_norm=0.5, weight_decay=0.1),
    sgd_chunked_accumulated=lambda: _engine_pair("sgd", accumulation_steps=2, clip_grad_value=0.01),
    adalomo_chunked=lambda: _engine_pair("adalomo", clip_grad_norm=0.5, weight_decay=0.1),
)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("check", ENGINE, ids=str)
def test_engine_in_chunks_is_bit_identical(rank_results, world, check):
    r = ok(rank_results(world), check)
    assert r["equal"] and r["norms_equal"], r
