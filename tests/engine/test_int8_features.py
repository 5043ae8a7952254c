"""8-bit weight shards (memory.int8_shards) with the engine's other features, each against the
one-process reference of tests/engine/int8_checks.py (the dequantized blocks, torch.optim.SGD in
fp32 on the window's gradient, clipped by torch's clip_grad_norm_ / clip_grad_value_, requantized
with the same keyed noise): tests/engine/int8_feature_checks.py builds and measures them.

- Gradient accumulation, K = 2, with an epoch's shorter last window (start_window(1)): the
  window's K-th backward applies the step from the accumulated sum (the fused path).
- Clipping: a norm clip that bites (0.3 against norms of 0.9 to 2.4) and a value clip that bites
  (0.005: about 15% of the elements, 5% after the norm clip), with K = 2 (one pass over the accumulated shards after
  the exact global norm) and with K = 1 (a measuring backward, then the updating one).
- offload_param cpu: the same 8-bit run with the partitions offloaded and without, bit for bit.
- Sequence parallelism, SP = 2 on 2 ranks, with K = 2 and the norm clip, against the whole rows.

Tolerance. The engine computes its own gradient (its forward, its reduce-scatter and accumulator
sums, the norm's sum of squares over ranks), in another order than the reference's one backward,
so a weight may differ by fp32 ulps and, rarely, round to the other integer: at most FLIPS of the
integers differ, none by more than one step, and while none does every scale is within the fp32
oracles' 1e-6 (tests/engine/test_int8_engine.py's plain case; with SGD on a given gradient the
update is bit for bit, tests/engine/test_int8_update.py). The blocks rescaled are the reference's
count within 1%. The check can fail: the same engine's integers against the reference with the
feature taken away (the accumulator ignored, either clip dropped) differ by far more than FLIPS.
"""
from __future__ import annotations

import pytest

from tests.engine import int8_feature_checks as F
from tests.ranks import multi_rank, multi_rank_checks, ok

FLIPS = 1e-3  # integers that may round the other way, as a fraction (the AdaLomo oracle's)
SCALE_REL = 1e-6  # the fp32 oracles' tolerance, for the scales while no integer differs

(ACCUMULATION, CLIP_ACCUMULATED) = multi_rank_checks(
    (1, 2, 3),
    int8_accumulation=lambda: F.accumulation(lengths=(2, 2, 1)),
    int8_clip_accumulated=lambda: F.accumulation(lengths=(2, 1), clip_norm=F.CLIP_NORM, clip_value=F.CLIP_VALUE),
)
# K = 1: the measuring backward and the updating one (the default clipping path), 3 steps.
(CLIP_TWO_PASS,) = multi_rank_checks((1, 3), int8_clip_two_pass=lambda: F.accumulation(
    lengths=(1, 1, 1), k=1, clip_norm=F.CLIP_NORM, clip_value=F.CLIP_VALUE))


@multi_rank(worlds=(1, 2, 3))
def int8_offload_param():
    return F.offload_equals_resident()


@multi_rank(worlds=(2,))
def int8_sequence_parallel():
    return F.sequence_parallel(sp=2)


def assert_near_reference(r: dict, controls: tuple[str, ...]) -> None:
    print({k: v for k, v in r.items() if k != "steps"})
    assert r["start_ints"] == 0, r  # the conversion is the reference's round to nearest
    assert r["moved"] > FLIPS * r["elements"] * 10, "the reference's integers barely moved: the check could not fail"
    assert r["ints"] <= FLIPS * r["elements"], r
    assert r["max_flip"] <= 1, r
    if r["ints"] == 0:
        assert r["scale_rel"] <= SCALE_REL, r
    assert abs(r["rescaled"] - r["reference_rescaled"]) <= 1e-2 * r["reference_rescaled"], r
    assert sorted(r["control_ints"]) == sorted(controls), r
    for name, ints in r["control_ints"].items():
        assert ints > FLIPS * r["elements"], (f"the reference without {name} is as near: the check cannot tell", r)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_int8_accumulation_near_reference(rank_results, world):
    r = ok(rank_results(world), ACCUMULATION)
    assert r["fused"], "no clipping, fp32 accumulator: the K-th backward applies the step"
    assert_near_reference(r, ("last",))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_int8_clipping_with_accumulation_near_reference(rank_results, world):
    r = ok(rank_results(world), CLIP_ACCUMULATED)
    assert not r["fused"], "norm clipping: one pass over the accumulated shards after the norm"
    assert all(s["norm"] > 2 * F.CLIP_NORM and s["value_clipped"] > 0 for s in r["steps"]), r  # both clips bite
    assert_near_reference(r, ("last", "no_norm_clip", "no_value_clip"))


@pytest.mark.parametrize("world", [1, 3])
def test_int8_clipping_two_passes_near_reference(rank_results, world):
    r = ok(rank_results(world), CLIP_TWO_PASS)
    assert all(s["norm"] > 2 * F.CLIP_NORM and s["value_clipped"] > 0 for s in r["steps"]), r
    assert_near_reference(r, ("no_norm_clip", "no_value_clip"))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_int8_offload_param_equals_resident_bitwise(rank_results, world):
    r = ok(rank_results(world), int8_offload_param)
    print(r)
    assert r["offloaded"] == "cpu" and r["int8_params"] == r["parameters"] > 0, r
    assert r["moved"] > 0
    assert r["ints"] == 0 and r["scales"] == 0, r


@pytest.mark.parametrize("world", [2])
def test_int8_sequence_parallel_near_reference(rank_results, world):
    r = ok(rank_results(world), int8_sequence_parallel)
    assert (r["sp"], r["dp"]) == (2, 1)
    assert all(s["norm"] > 2 * F.CLIP_NORM for s in r["steps"]), r
    assert_near_reference(r, ("no_norm_clip",))
