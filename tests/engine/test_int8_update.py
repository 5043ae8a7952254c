"""The fused update on 8-bit shards (memory.int8_shards; lomo_ds/engine/update/int8.py) against its
oracle, on 1, 2 and 3 ranks: a single-process reference that dequantizes the same blocks, steps
torch.optim.SGD in fp32 on the whole parameters with the same global-batch gradient, and requantizes
with the same keyed noise (runtime/quant8.py). Blocks of 16 and chunks of 48 elements, so that shard
boundaries cut blocks of every matrix and chunks split every slice.

- SGD: every integer and every scale equal the reference's, bit for bit, at every step, and the
  pieces of each cut block hold one scale on every rank.
- AdaLomo (the reference AdaLomo, tests/adalomo_reference.py): its statistics are sums in another
  order than the reference's (over ranks and chunks), so a weight may differ by fp32 ulps and, rarely,
  round to the other integer or give its block a scale an ulp apart; the integers equal the
  reference's but for a few.
- The oracle can fail: noise seeded per rank (the bf16 path's) breaks it on every rank count, and
  cut blocks scaled per piece (no agreement) break it wherever a block is cut.
- A checkpoint (the integers cut by ranks, the scales on the global grid) written by 3 ranks and
  resumed on 2, and written by 2 and resumed on 1 and on 3, continues as the uninterrupted 3-rank run
  did, bit for bit.
"""
from __future__ import annotations

import os

import pytest
import torch

from lomo_ds.runtime.shard_geometry import PIECES
from lomo_ds.storage.engine_state import read_engine_state, save_engine_state
from tests.engine import int8_checks as c
from tests.ranks import multi_rank, ok, work_dir


@multi_rank(worlds=(1, 2, 3))
def int8_sgd_matches_reference():
    return c.train_against_reference("sgd")


@multi_rank(worlds=(1, 3))
def int8_adalomo_near_reference():
    return c.train_against_reference("adalomo")


@multi_rank(worlds=(1, 3))
def int8_per_rank_noise_fails():
    return c.train_against_reference("sgd", steps=1, int8_class=c.PerRankNoise)


@multi_rank(worlds=(3,))
def int8_per_piece_scales_fail():
    return c.train_against_reference("sgd", steps=3, int8_class=c.PerPieceScales)


def _state(up, model, group) -> dict:
    state = up.state_dict(model, [p for _, p in model.params])
    return {**state, "world": torch.distributed.get_world_size(group), "rank": torch.distributed.get_rank(group)}


def _resume(folder: str, ref: c.Reference, group, grads: dict, step: int):
    """A fresh run on `group` (its shards the reference's start) that reads `folder` and takes `step`."""
    world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    fresh = c.Reference("sgd", seed=4)  # another start: the read must replace every value
    model = c.shards(fresh, group, world, rank)
    up = c.updater(model)
    template = _state(up, model, group)
    params = [p for _, p in model.params]
    state = read_engine_state(folder, template, lambda s: up.check_state(s, model, params), 60.0, group=group)
    up.load_state_dict(state, model, params)
    loaded = c.gathered(model, group)
    c.sharded_step(up, model, grads, step)
    return up, model, loaded


@multi_rank(worlds=(3,))
def int8_checkpoint_moves_between_rank_counts():
    rank = torch.distributed.get_rank()
    world_group = torch.distributed.group.WORLD
    two = torch.distributed.new_group([0, 1], backend="gloo")
    one = torch.distributed.new_group([0], backend="gloo")
    ref = c.Reference("sgd")
    model = c.shards(ref, world_group, 3, rank)
    up = c.updater(model)
    for step in (1, 2):
        c.sharded_step(up, model, ref.gradients(step), step)
        ref.step(step)
    by_three = os.path.join(work_dir(), "int8_by_3")
    state3 = _state(up, model, world_group)
    save_engine_state(by_three, state3, 60.0)
    at_save = c.gathered(model, world_group)
    grads = ref.gradients(3)
    c.sharded_step(up, model, grads, 3)
    ref.step(3)
    straight = c.gathered(model, world_group)
    out = {"declared": sorted("/".join(p) for p in state3[PIECES]),
           "scales_saved": sorted(state3.get("int8_scales", {}))}
    by_two = os.path.join(work_dir(), "int8_by_2")
    if rank < 2:  # 3 -> 2, then the 2-rank state saved: 2 -> 1 and 2 -> 3
        up2, model2, loaded = _resume(by_three, ref, two, grads, 3)
        out["read_by_two"] = c.mismatches(_as_ref(at_save), loaded[0], loaded[1])
        out["two_after_step"] = c.mismatches(_as_ref(straight), *c.gathered(model2, two)[:2])
        # The 2-rank run's state at step 2: the straight run's, as 2 ranks cut it.
        fresh = c.shards(c.Reference("sgd", seed=4), two, 2, rank, q=at_save[0], s=at_save[1])
        fresh_up = c.updater(fresh)
        save_engine_state(by_two, _state(fresh_up, fresh, two), 60.0, group=two)
    torch.distributed.barrier()
    if rank == 0:
        _, model1, _ = _resume(by_two, ref, one, grads, 3)
        out["one_after_step"] = c.mismatches(_as_ref(straight), *c.gathered(model1, one)[:2])
    torch.distributed.barrier()
    _, model3, _ = _resume(by_two, ref, world_group, grads, 3)
    out["three_after_step"] = c.mismatches(_as_ref(straight), *c.gathered(model3, world_group)[:2])
    out["straight_vs_reference"] = c.mismatches(ref, *straight[:2])
    return out if rank == 0 else None


def _as_ref(g) -> c.Reference:
    """A gathered state as mismatches() compares against it."""
    holder = c.Reference.__new__(c.Reference)
    holder.q, holder.s = g[0], g[1]
    holder.names = sorted(g[0])
    return holder


@pytest.mark.parametrize("world", [1, 2, 3])
def test_int8_sgd_equals_reference_bitwise(rank_results, world):
    r = ok(rank_results(world), int8_sgd_matches_reference)
    assert r["moved_ints"] > 0, "the reference's integers never moved: the check would pass on anything"
    if world > 1:
        assert r["cut_blocks"] > 0, "no block is cut: the shared-scale case is not exercised"
    for s in r["steps"]:
        assert (s["ints"], s["scales"], s["cut_scales_disagree"]) == (0, 0, 0), r
    assert r["rescaled"] == r["reference_rescaled"] > 0


@pytest.mark.parametrize("world", [1, 3])
def test_int8_adalomo_near_reference(rank_results, world):
    r = ok(rank_results(world), int8_adalomo_near_reference)
    print(r)
    for s in r["steps"]:
        assert s["cut_scales_disagree"] == 0
        assert s["ints"] <= 1e-3 * s["elements"], r
        assert s["scale_rel"] <= 1e-6, r  # a recomputed scale from a maximum some fp32 ulps apart


@pytest.mark.parametrize("world", [1, 3])
def test_int8_oracle_fails_with_per_rank_noise(rank_results, world):
    r = ok(rank_results(world), int8_per_rank_noise_fails)
    assert r["steps"][0]["ints"] > 0


@pytest.mark.parametrize("world", [3])
def test_int8_oracle_fails_with_per_piece_scales(rank_results, world):
    r = ok(rank_results(world), int8_per_piece_scales_fail)
    assert any(s["cut_scales_disagree"] > 0 or s["scales"] > 0 for s in r["steps"]), r


@pytest.mark.parametrize("world", [3])
def test_int8_checkpoint_resumes_on_other_rank_counts_bitwise(rank_results, world):
    r = ok(rank_results(world), int8_checkpoint_moves_between_rank_counts)
    assert r["scales_saved"] and not any(p.startswith("int8_scales") for p in r["declared"])
    for key in ("read_by_two", "two_after_step", "one_after_step", "three_after_step", "straight_vs_reference"):
        assert r[key]["ints"] == 0 and r[key]["scales"] == 0, (key, r)
