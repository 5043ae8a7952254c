"""ZeRO-3's parameter all-gather through shared memory (comm.param_gather, lomo_ds/comm/shm_all_gather.py)
on 1, 2 and 3 ranks (3: uneven shards): LOMO and the DeepSpeed floor give the same bits through it
as through gloo, with fp32 and with bf16 + fp32 parameters fetched together; every gather of a
step goes through it, and is counted (the count fails when the route is not installed)."""
import copy
import os
from unittest import mock

import pytest
import torch

from lomo_ds.comm import shm_all_gather
from lomo_ds.profiling import count_comm
from lomo_ds.runtime import ds_compat
from tests.engine import dist_engine_checks as E
from tests.ranks import multi_rank_checks, ok
from tests.tiny import global_batch, tiny_llama

WORLDS = [1, 2, 3]
TOL = 1e-6  # fp32 against torch.optim.SGD, as the engine's equivalence tests
# The shipped CPU config's fetch unit: a decoder layer's bf16 norms and fp32 linears in one fetch,
# which ZeRO-3 splits into one gather per dtype.
LAYER_FETCH = {"leaf_module": {"classes": ["LlamaDecoderLayer"]}}


def mixed_llama(seed: int):
    """The tiny LLaMA with its RMSNorm weights in bf16 (the norm multiplies in fp32, so it runs)."""
    model = tiny_llama(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data = p.data.to(torch.bfloat16)
    return model


def _gathers(step) -> dict:
    """Run `step()` counting its collectives; how many all-gathers count_comm saw and how many the
    shared-memory transport carried."""
    shm = shm_all_gather.transport()
    before = shm.calls if shm else 0
    with count_comm() as counts:
        step()
    return {"counted": counts.calls_by_op.get("all_gather_into_tensor", 0),
            "carried": (shm.calls - before) if shm else 0}


def _floor_run(FloorEngine, mode: str) -> dict:
    model = mixed_llama(5)
    grads = []
    # Registered before FloorEngine's own hook, which drops the gradient: this one sees it first.
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: grads.append(p.grad.detach().float().clone().view(-1)))
    cfg = E.ds_cfg(fetch=LAYER_FETCH)
    cfg.pop("lomo")
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    engine = FloorEngine(model, cfg, param_gather=mode if world > 1 else "auto")
    counts = [_gathers(lambda s=s: engine.train_step(global_batch(s, world)[rank])) for s in range(2)]
    return {"grads": torch.cat(grads), "counts": counts, "resolved": engine.param_gather}


def check_floor() -> dict:
    """The DeepSpeed floor (devkit's FloorEngine, as the benchmark builds it) on the mixed
    model under the layer fetch: the gradients every rank computes, bit for bit, through gloo and
    through shared memory."""
    from devkit.floor import FloorEngine

    runs = {mode: _floor_run(FloorEngine, mode) for mode in ("torch", "shared_memory")}
    a, b = runs["torch"], runs["shared_memory"]
    return {"same_grads": float(torch.equal(a["grads"], b["grads"])), "n_grads": a["grads"].numel(),
            "resolved": [a["resolved"], b["resolved"]], "counts_torch": a["counts"], "counts_shm": b["counts"],
            "dtypes": sorted({str(p.dtype) for p in mixed_llama(5).parameters()})}


def check_lomo(mixed: bool) -> dict:
    """LOMO under the layer fetch, through gloo and through shared memory: the same shards bit for
    bit; fp32 also against torch.optim.SGD."""
    import lomo_ds

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    runs = {}
    for mode in ("torch", "shared_memory"):
        ref = None if mixed else tiny_llama(6)
        model = mixed_llama(6) if mixed else copy.deepcopy(ref)
        engine = lomo_ds.initialize(model, E.ds_cfg(fetch=LAYER_FETCH, param_gather=mode if world > 1 else "auto"))
        counts = []
        for step in range(E.STEPS):
            mbs = global_batch(step, world)
            counts.append(_gathers(lambda b=mbs[rank], e=engine: e.train_step(b)))
            if ref is not None:
                E.reference_step(ref, mbs, world)
        runs[mode] = {"resolved": engine.param_gather, "counts": counts,
                      "diff": E.max_diff(engine, ref) if ref is not None else None,
                      "shards": [ds_compat.shard(p).clone().view(torch.uint8) for p in engine.params],
                      "dtypes": sorted({str(p.dtype) for p in engine.params})}
    a, b = runs["torch"], runs["shared_memory"]
    return {"resolved": [a["resolved"], b["resolved"]], "counts_torch": a["counts"], "counts_shm": b["counts"],
            "same_shards": float(len(a["shards"]) == len(b["shards"])
                                 and all(torch.equal(x, y) for x, y in zip(a["shards"], b["shards"], strict=True))),
            "diff_torch": a["diff"], "diff_shm": b["diff"], "dtypes": a["dtypes"]}


def check_refused() -> dict:
    """shared_memory where the ranks share no memory (LOCAL_SIZE not the world size) is refused,
    naming the option; on one rank every choice comes to torch (ZeRO-3 gathers nothing)."""
    error = None
    with mock.patch.dict(os.environ, {"LOCAL_SIZE": str(10 * torch.distributed.get_world_size())}):
        try:
            shm_all_gather.resolve("shared_memory")
        except ValueError as e:
            error = str(e)
    return {"refused": error, "auto": shm_all_gather.resolve("auto")}


floor, lomo_fp32, lomo_mixed, refused = multi_rank_checks(
    WORLDS, floor=check_floor, lomo_fp32=lambda: check_lomo(False), lomo_mixed=lambda: check_lomo(True),
    refused=check_refused)


def _assert_carried(r: dict, world: int) -> None:
    """Through shared memory every gather of a step is carried by the transport and counted once
    (it fails with 0 carried when the route is not installed); through gloo none is."""
    if world == 1:  # one rank: ZeRO-3 gathers nothing
        assert r["resolved"] == ["torch", "torch"]
        return
    assert r["resolved"] == ["torch", "shared_memory"]
    for step in r["counts_shm"]:
        assert step["counted"] > 0 and step["carried"] == step["counted"], r["counts_shm"]
    for step in r["counts_torch"]:
        assert step["carried"] == 0 and step["counted"] > 0, r["counts_torch"]


@pytest.mark.parametrize("world", WORLDS)
def test_floor_gradients_are_the_same_bits(rank_results, world):
    r = ok(rank_results(world), floor)
    assert r["dtypes"] == ["torch.bfloat16", "torch.float32"]
    assert r["same_grads"] == 1.0 and r["n_grads"] > 0
    _assert_carried(r, world)
    if world > 1:  # one gather per dtype per fetch: the bf16 and the fp32 parameters both went through it
        assert r["counts_shm"][0]["counted"] >= 2


@pytest.mark.parametrize("world", WORLDS)
def test_lomo_fp32_matches_sgd_either_way(rank_results, world):
    r = ok(rank_results(world), lomo_fp32)
    if r["diff_torch"] is not None:  # rank 0's figure (None on a rank that has no full copy)
        assert r["diff_torch"] <= TOL and r["diff_shm"] <= TOL
    assert r["same_shards"] == 1.0
    _assert_carried(r, world)


@pytest.mark.parametrize("world", WORLDS)
def test_lomo_mixed_dtypes_are_the_same_bits(rank_results, world):
    r = ok(rank_results(world), lomo_mixed)
    assert r["dtypes"] == ["torch.bfloat16", "torch.float32"]
    assert r["same_shards"] == 1.0
    _assert_carried(r, world)


@pytest.mark.parametrize("world", WORLDS)
def test_shared_memory_refused_across_nodes(rank_results, world):
    r = ok(rank_results(world), refused)
    if world == 1:
        assert r["refused"] is None and r["auto"] == "torch"
    else:
        assert "comm.param_gather" in r["refused"] and "LOCAL_SIZE" in r["refused"]
        assert r["auto"] == "shared_memory"
