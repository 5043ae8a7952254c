"""The fused CPU kernels (lomo_ds/engine/cpu_kernels.py) against the torch ops they stand in for:
the same bytes written, a sum whose finiteness is torch's, on sizes around the 16-lane blocks and on
unaligned views; and how they are built, cached, switched off and stood in for."""
import logging
import math
import os
import shutil
import tempfile

import pytest
import torch

from lomo_ds.comm import cpu_kernels

needs_compiler = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
SIZES = [0, 1, 15, 16, 17, 33, 4099, 100_003]


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """load() as in a new process, building into an empty cache."""
    monkeypatch.setattr(cpu_kernels, "_lib", False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(cpu_kernels.ENV, raising=False)
    return tmp_path


@pytest.fixture
def kernels(fresh):
    k = cpu_kernels.load()
    assert k is not None
    return k


def unaligned(n: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """n normal fp32 values starting one element past an allocation's (aligned) start."""
    return (torch.randn(n + 1, generator=gen, device="cpu") * scale)[1:]


@needs_compiler
@pytest.mark.parametrize("n", SIZES)
def test_copy_abs_sum_is_copy_and_abs_sum(kernels, n):
    gen = torch.Generator(device="cpu").manual_seed(n)
    src, dst = unaligned(n, gen), torch.full((n + 3,), 7.0, device="cpu")[3:]
    total = kernels.copy_abs_sum(dst, src)
    assert torch.equal(dst, src)
    assert total == pytest.approx(float(src.double().abs().sum()), rel=1e-5)


@needs_compiler
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("nrows", [1, 2, 3])
def test_sum_rows_equals_torch_adds_bit_for_bit(kernels, n, nrows):
    gen = torch.Generator(device="cpu").manual_seed(1000 + n)
    rows = [unaligned(n, gen, scale=10.0 ** r) for r in range(nrows)]
    out = torch.empty(n, device="cpu")
    total = kernels.sum_rows(out, rows)
    expected = rows[0].clone()
    for row in rows[1:]:
        expected = expected + row  # the transport's order: ((r0 + r1) + r2)
    assert torch.equal(out, expected)
    assert total == pytest.approx(float(expected.double().sum()), rel=1e-4, abs=1e-2 * max(1.0, math.sqrt(n)))


@needs_compiler
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("at", [0, 15, 16, 4097, 4098])  # the blocks' lanes, and the tail after the last block
def test_a_nonfinite_element_makes_the_sum_nonfinite(kernels, bad, at):
    gen = torch.Generator(device="cpu").manual_seed(at)
    src = unaligned(4099, gen)
    src[at] = bad
    assert not math.isfinite(kernels.copy_abs_sum(torch.empty(4099, device="cpu"), src))
    assert not math.isfinite(kernels.sum_rows(torch.empty(4099, device="cpu"), [src, unaligned(4099, gen)]))
    other = unaligned(4099, gen)
    other[at] = -bad if math.isinf(bad) else bad  # inf + -inf: NaN in the sum itself
    assert not math.isfinite(kernels.sum_rows(torch.empty(4099, device="cpu"), [unaligned(4099, gen), other]))


@needs_compiler
def test_sizes_must_agree(kernels):
    with pytest.raises(ValueError, match="copy_abs_sum"):
        kernels.copy_abs_sum(torch.empty(3, device="cpu"), torch.empty(4, device="cpu"))
    with pytest.raises(ValueError, match="sum_rows"):
        kernels.sum_rows(torch.empty(3, device="cpu"), [torch.empty(3, device="cpu"), torch.empty(2, device="cpu")])


def test_usable_only_on_contiguous_fp32_cpu_tensors():
    t = torch.zeros(4, 4, device="cpu")
    assert cpu_kernels.Kernels.usable(t, t[1])
    assert not cpu_kernels.Kernels.usable(t[:, 1])
    assert not cpu_kernels.Kernels.usable(t.to(torch.bfloat16))
    assert not cpu_kernels.Kernels.usable(t.double())


@needs_compiler
def test_built_once_into_the_cache(fresh):
    first = cpu_kernels.load()
    built = list((fresh / "lomo_ds" / "kernels").iterdir())
    assert [p.name for p in built] == [first.path.name]  # no temporary file left beside it
    stamp = first.path.stat().st_mtime_ns
    cpu_kernels._lib = False  # a new process: found in the cache, not compiled again
    assert cpu_kernels.load().path == first.path and first.path.stat().st_mtime_ns == stamp


@needs_compiler
def test_a_cache_that_cannot_be_written_builds_in_the_temporary_directory(fresh, monkeypatch):
    blocked = fresh / "not-a-folder"
    blocked.write_text("a file where the cache folder would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    monkeypatch.setattr(tempfile, "tempdir", str(fresh / "tmp"))
    (fresh / "tmp").mkdir()
    k = cpu_kernels.load()
    assert k is not None and k.path.parent == fresh / "tmp" / f"lomo_ds_kernels_{os.getuid()}"


def test_switched_off(fresh, monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENV, "0")
    assert cpu_kernels.load() is None
    assert not (fresh / "lomo_ds").exists(), "switched off: nothing is built"
    monkeypatch.setenv(cpu_kernels.ENV, "yes")
    with pytest.raises(ValueError, match=cpu_kernels.ENV):
        cpu_kernels.load()


def test_no_compiler_falls_back_with_one_warning(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CC", str(fresh / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.load() is None
        assert cpu_kernels.load() is None
    warnings = [r for r in caplog.records if "fused CPU kernels unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "no-such-compiler" in warnings[0].getMessage()


@needs_compiler
def test_copy_abs_sum_bounds_every_element(kernels):
    """The packing's bound (buckets._pack): an element as large as FLT_MAX / 2 shows in the sum."""
    big = torch.finfo(torch.float32).max / 2
    src = torch.full((33,), 1e-3, device="cpu")
    src[20] = -big
    assert kernels.copy_abs_sum(torch.empty(33, device="cpu"), src) >= big
    src[21] = big * 1.01  # two of them: the fp32 sum overflows, and so is not finite either
    assert not math.isfinite(kernels.copy_abs_sum(torch.empty(33, device="cpu"), src))


def torch_sgd(w, rows, lr, scale, clip_value, wd):
    """What ShardUpdater.apply does with a reduced slice: the reference of the fused step."""
    g = rows[0].clone()
    for row in rows[1:]:
        g += row
    step_scale = scale
    if clip_value is not None:
        g, step_scale = g.mul_(scale).clamp_(-clip_value, clip_value), 1.0
    if wd:
        w.mul_(1.0 - lr * wd)
    return w.add_(g, alpha=-lr * step_scale)


@needs_compiler
@pytest.mark.parametrize("n", [1, 17, 4099])
@pytest.mark.parametrize("nrows", [1, 2, 3])
@pytest.mark.parametrize("clip_value,wd", [(None, 0.0), (0.3, 0.0), (None, 0.1), (0.3, 0.1)])
def test_sgd_rows_is_the_update_of_the_summed_rows(kernels, n, nrows, clip_value, wd):
    gen = torch.Generator(device="cpu").manual_seed(7 * n + nrows)
    rows = [unaligned(n, gen) for _ in range(nrows)]
    w = unaligned(n, gen)
    expected = torch_sgd(w.clone(), rows, lr=0.05, scale=0.5, clip_value=clip_value, wd=wd)
    assert kernels.sgd_rows(w, rows, lr=0.05, scale=0.5, clip_value=clip_value, weight_decay=wd) == 0
    # fp32: the compiler may fuse a multiply-add that torch rounds twice (one ulp)
    torch.testing.assert_close(w, expected, rtol=1e-6, atol=1e-7)


@needs_compiler
@pytest.mark.parametrize("clip_value", [None, 0.3])
def test_sgd_rows_leaves_elements_whose_sum_is_not_finite(kernels, clip_value):
    big = torch.finfo(torch.float32).max
    a = torch.ones(40, device="cpu")
    b = torch.ones(40, device="cpu")
    a[3], b[3] = big, big  # overflows only once summed
    a[17], b[17] = math.inf, -math.inf  # NaN once summed
    a[39] = math.nan  # the last element: in the tail after the 16-lane blocks of the many-row loop
    w = torch.zeros(40, device="cpu")
    assert kernels.sgd_rows(w, [a, b], lr=0.1, scale=1.0, clip_value=clip_value, weight_decay=0.0) == 3
    bad = torch.zeros(40, dtype=torch.bool)
    bad[[3, 17, 39]] = True
    assert torch.equal(w[bad], torch.zeros(3)) and bool((w[~bad] < 0).all())
