"""8-bit weight shards (memory.int8_shards) with the engine's other features, each against the
one-process reference of tests/engine/int8_checks.py (the dequantized blocks, torch.optim.SGD in
fp32 on the window's gradient, clipped by torch's clip_grad_norm_ / clip_grad_value_, requantized
with the same keyed noise): tests/engine/int8_feature_checks.py builds and measures them.

- Gradient accumulation, K = 2, with an epoch's shorter last window (start_window(1)): the
  window's K-th backward applies the step from the accumulated sum (the fused path).
- Clipping: a norm clip that bites (0.3 against norms of 0.9 to 2.4) and a value clip that bites
  (0.005: about 15% of the elements, 5% after the norm clip), with K = 2 (one pass over the
  accumulated shards after the exact global norm) and with K = 1 (a measuring backward, then the
  updating one).
- offload_param cpu: the same 8-bit run (K = 2, the norm clip) with the partitions offloaded and
  without, bit for bit. On CPU ranks host memory is the device, so this shows the 8-bit path runs
  on DeepSpeed's offloaded partitions (the host-update worker is refused: memory.host_update inline).
- Sequence parallelism, SP = 2 on 2 ranks (and SP = 2 x DP = 2 on 4 with the long checks), with K = 2
  and the norm clip, against the whole rows.

Tolerance. The engine computes its own gradient (its forward, its reduce-scatter and accumulator
sums, the norm's sum of squares over ranks), in another order than the reference's one backward,
so a weight may differ by fp32 ulps and, rarely, round to the other integer: at most FLIPS of the
integers differ, none by more than one step, and while none does every scale is within the fp32
oracles' 1e-6 (tests/engine/test_int8_engine.py's plain case; with SGD on a given gradient the
update is bit for bit, tests/engine/test_int8_update.py). The blocks rescaled are the reference's
count within 1%. The check can fail: the same engine's integers against the reference with the
feature taken away (the accumulator ignored, either clip dropped) differ by far more than FLIPS.

Bit for bit where the gradient is given: each rank's update of its 8-bit slices from a real
accumulator's sum (a window of 2, then one of 1; an fp32 buffer, and a bf16 one read chunk by chunk
with the last slice added to each), scaled by a clip coefficient and clamped by value, equals the
reference stepping torch.optim.SGD on the same sum, scaled and clamped alike.
"""
from __future__ import annotations

import pytest
import torch

from tests.engine import int8_feature_checks as F
from tests.ranks import LONG_TESTS, long_unless_declared, multi_rank, multi_rank_checks, ok

FLIPS = 1e-3  # integers that may round the other way, as a fraction (the AdaLomo oracle's)
SCALE_REL = 1e-6  # the fp32 oracles' tolerance, for the scales while no integer differs

(ACCUMULATION, CLIP_ACCUMULATED) = multi_rank_checks(
    (1, 2, 3),
    int8_accumulation=lambda: F.accumulation(lengths=(2, 2, 1)),
    int8_clip_accumulated=lambda: F.accumulation(lengths=(2, 1), clip_norm=F.CLIP_NORM, clip_value=F.CLIP_VALUE),
)
# K = 1: the measuring backward and the updating one (the default clipping path), 3 steps; on 3
# ranks where the long checks run (the 3-rank launch has the clipping already, with K = 2).
(CLIP_TWO_PASS,) = multi_rank_checks((1, 3) if LONG_TESTS else (1,), int8_clip_two_pass=lambda: F.accumulation(
    lengths=(1, 1, 1), k=1, clip_norm=F.CLIP_NORM, clip_value=F.CLIP_VALUE))


# AdaLomo (the reference AdaLomo) with K = 2 and a shorter last window; on 3 ranks with the long checks.
(ADALOMO_ACCUMULATION,) = multi_rank_checks((1, 3) if LONG_TESTS else (1,), int8_adalomo_accumulation=lambda: (
    F.accumulation(lengths=(2, 2, 1), rule="adalomo")))

# The update alone from a real accumulator's sum, on each rank's slices of the reference's gradient.
(UPDATE_ACCUMULATED, UPDATE_CLIPPED, UPDATE_BF16_SUM) = multi_rank_checks(
    (1, 2, 3),
    int8_update_accumulated=lambda: F.update_from_accumulated(lengths=(2, 2, 1)),
    int8_update_clipped=lambda: F.update_from_accumulated(lengths=(2, 1), clip_value=F.CLIP_VALUE,
                                                          norm_clip=F.CLIP_NORM),
    # memory.accumulate_dtype bf16: the sum read chunk by chunk with the last slice added to each.
    int8_update_bf16_sum=lambda: F.update_from_accumulated(lengths=(3, 1), dtype=torch.bfloat16),
)


# On 1 rank; on 2 and 3 where the long checks run (the conversion and the gather on offloaded
# partitions: the same code as resident ones on CPU ranks, whose host memory is the device).
@multi_rank(worlds=(1, 2, 3) if LONG_TESTS else (1,))
def int8_offload_param():
    return F.offload_equals_resident()


# SP = 2 on 2 ranks; SP = 2 x DP = 2 on 4 where the long checks run (the 4-rank launch is theirs).
@multi_rank(worlds=(2, 4) if LONG_TESTS else (2,))
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
@pytest.mark.parametrize("check", [UPDATE_ACCUMULATED, UPDATE_CLIPPED, UPDATE_BF16_SUM], ids=str)
def test_int8_update_from_accumulated_sum_bitwise(rank_results, world, check):
    """SGD on a given gradient is bit for bit (tests/engine/test_int8_update.py): so it stays read
    through the accumulator (a window's sum, a shorter window's single slice) and scaled and clamped
    as the clipping passes ask."""
    r = ok(rank_results(world), check)
    assert r["moved_ints"] > 0
    for s in r["steps"]:
        assert (s["ints"], s["scales"], s["cut_scales_disagree"]) == (0, 0, 0), r


@pytest.mark.parametrize("world", [1, 2, 3])
def test_int8_accumulation_near_reference(rank_results, world):
    r = ok(rank_results(world), ACCUMULATION)
    assert r["fused"], "no clipping, fp32 accumulator: the K-th backward applies the step"
    assert_near_reference(r, ("last",))


@pytest.mark.parametrize("world", [pytest.param(w, marks=long_unless_declared(ADALOMO_ACCUMULATION, w))
                                   for w in (1, 3)])
def test_int8_adalomo_accumulation_near_reference(rank_results, world):
    """AdaLomo's statistics are sums in another order again (tests/engine/test_int8_update.py): the
    same bound as SGD's through the engine."""
    r = ok(rank_results(world), ADALOMO_ACCUMULATION)
    assert r["fused"]
    assert_near_reference(r, ("last",))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_int8_clipping_with_accumulation_near_reference(rank_results, world):
    r = ok(rank_results(world), CLIP_ACCUMULATED)
    assert not r["fused"], "norm clipping: one pass over the accumulated shards after the norm"
    assert all(s["norm"] > 2 * F.CLIP_NORM and s["value_clipped"] > 0 for s in r["steps"]), r  # both clips bite
    assert_near_reference(r, ("last", "no_norm_clip", "no_value_clip"))


@pytest.mark.parametrize("world", [pytest.param(w, marks=long_unless_declared(CLIP_TWO_PASS, w)) for w in (1, 3)])
def test_int8_clipping_two_passes_near_reference(rank_results, world):
    r = ok(rank_results(world), CLIP_TWO_PASS)
    assert all(s["norm"] > 2 * F.CLIP_NORM and s["value_clipped"] > 0 for s in r["steps"]), r
    assert_near_reference(r, ("no_norm_clip", "no_value_clip"))


@pytest.mark.parametrize("world", [pytest.param(w, marks=long_unless_declared(int8_offload_param, w))
                                   for w in (1, 2, 3)])
def test_int8_offload_param_equals_resident_bitwise(rank_results, world):
    r = ok(rank_results(world), int8_offload_param)
    print(r)
    assert r["offloaded"] == "cpu" and r["int8_params"] == r["parameters"] > 0, r
    assert r["moved"] > 0
    assert r["ints"] == 0 and r["scales"] == 0, r


@pytest.mark.parametrize("world", [pytest.param(w, marks=long_unless_declared(int8_sequence_parallel, w))
                                   for w in (2, 4)])
def test_int8_sequence_parallel_near_reference(rank_results, world):
    r = ok(rank_results(world), int8_sequence_parallel)
    assert (r["sp"], r["dp"]) == (2, world // 2)
    assert all(s["norm"] > 2 * F.CLIP_NORM for s in r["steps"]), r
    assert_near_reference(r, ("no_norm_clip",))


class _Module:
    """int8_checks' sharded parameters as a module gives them (parameters, named_parameters)."""

    def __init__(self, params):
        self.params = params

    def parameters(self):
        return (p for _, p in self.params)

    def named_parameters(self):
        return iter(self.params)


def test_int8_refuses_the_host_update_worker_only_where_it_holds_shards():
    """The host-update worker issues no collective, and a cut block's scale needs one: with shards
    in host memory (offload_param cpu, or CPU ranks) and memory.host_update 'thread' the engine
    refuses 8-bit shards, naming memory.host_update ('auto' starts no worker with 8-bit shards:
    tests/engine/test_gpu_path.py). Shards on the accelerator (here on the meta device) give a
    worker nothing."""
    from lomo_ds.config.engine_config import load_config
    from lomo_ds.engine.host_updates import HostUpdates
    from lomo_ds.engine.update import ShardGeometries
    from lomo_ds.engine.update.updater import int8_path
    from tests.engine import int8_checks as c

    _, cfg = load_config({"lomo": {"lr": 0.1}, "memory": {"int8_shards": True, "int8_block": c.BLOCK}})
    model = c.shards(c.Reference("sgd"), None, 1, 0)
    module = _Module(model.params)
    worker = HostUpdates(torch.device("cpu"), str)
    with pytest.raises(ValueError, match=r"memory\.host_update: .*set memory\.host_update: inline or auto"):
        int8_path(cfg, module, ShardGeometries(), worker)
    assert int8_path(cfg, module, ShardGeometries(), None) is not None  # inline: the hook updates them
    for _, p in model.params:
        p.ds_tensor = torch.empty(p.ds_tensor.numel(), dtype=torch.int8, device="meta")
    assert int8_path(cfg, module, ShardGeometries(), worker) is not None
