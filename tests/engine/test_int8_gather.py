"""8-bit weight shards (memory.int8_shards) in DeepSpeed's partitions and their gather
(lomo_ds/comm/int8_gather.py, ds_compat's routing), on 1, 2 and 3 CPU ranks.

The reference is one process's: each weight cast to bf16 and quantized on the global block grid
(quant8.quantize at start 0, round to nearest), dequantized. The gathered weights (the forward's
fetch, and GatheredParameters) must equal it bitwise on every rank count: blocks cut by shard
boundaries share one scale, so no rank count rounds an element differently."""
from __future__ import annotations

import pytest
import torch

from tests.ranks import multi_rank_checks, ok
from tests.tiny import engine_sections, global_batch, tiny_llama

WORLDS = [1, 2, 3]


def _cfg(int8=True, block=8, persist=100, hidden=40):
    return {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": persist,
                                  "stage3_prefetch_bucket_size": 0, "stage3_max_live_parameters": 0,
                                  "stage3_max_reuse_distance": 0},
            **engine_sections({"lr": 0.01, "int8_shards": int8, "int8_block": block})}


def _reference(weight: torch.Tensor, block: int) -> torch.Tensor:
    from lomo_ds.runtime import quant8

    flat = weight.detach().to(torch.bfloat16).reshape(-1)
    q, s = quant8.quantize(flat, 0, block=block)
    return quant8.dequantize(q, s, 0, block=block, dtype=torch.bfloat16).view(weight.shape)


def check_gather(block=8, zero_init=False):
    import deepspeed

    import lomo_ds
    from lomo_ds.runtime import ds_compat
    from tests.engine.int8_checks import fetched_weights

    ref = tiny_llama(3)
    cfg = _cfg(block=block)
    if zero_init:  # partitioned at construction, loaded from rank 0 as from_pretrained does
        with deepspeed.zero.Init(config_dict_or_path={k: v for k, v in cfg.items() if k not in ("lomo", "memory")}):
            model = tiny_llama(4)
    else:
        model = tiny_llama(3)
    engine = lomo_ds.initialize(model, cfg)
    if zero_init:  # the weights written after the conversion: requantized from the whole weight
        for p, src in zip(engine.module.parameters(), ref.parameters(), strict=True):
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                if torch.distributed.get_rank() == 0:
                    p.data.copy_(src.data)
    refs = {n: _reference(p, block) for n, p in ref.named_parameters()}
    plain = {n: p.detach().to(torch.bfloat16) for n, p in ref.named_parameters()}
    kinds, mismatched = {}, []
    for n, p in engine.module.named_parameters():
        kinds[n] = "int8" if ds_compat.int8_shard(p) is not None else str(ds_compat.shard(p).dtype)
    fetched = fetched_weights(engine, global_batch(0, engine.world)[engine.rank])
    for n, w in fetched.items():
        want = refs[n] if kinds[n] == "int8" else plain[n]
        if w.dtype != torch.bfloat16 or not torch.equal(w, want):
            mismatched.append(n)
    gathered_bad = []
    for n, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            want = refs[n] if kinds[n] == "int8" else plain[n]
            if not torch.equal(p.data, want):
                gathered_bad.append(n)
    return {"kinds": kinds, "fetched": sorted(fetched), "mismatched": mismatched, "gathered_bad": gathered_bad,
            "failing_case": _a_wrong_scale_is_seen(engine, refs), "world": engine.world}


def _a_wrong_scale_is_seen(engine, refs) -> bool:
    """The comparison can fail: one doubled scale on the first rank shows in the gathered weight."""
    import deepspeed

    from lomo_ds.runtime import ds_compat

    n, p = next((n, p) for n, p in engine.module.named_parameters() if ds_compat.int8_shard(p) is not None)
    _, scales = ds_compat.int8_shard(p)
    if torch.distributed.get_rank() == 0:
        scales[0] *= 2
    with deepspeed.zero.GatheredParameters([p]):
        differs = not torch.equal(p.data, refs[n])
    if torch.distributed.get_rank() == 0:
        scales[0] /= 2
    return differs


def check_bytes(block=128):
    """The forward's parameter all-gather bytes with 8-bit shards against bf16's, counted."""
    import lomo_ds
    from lomo_ds.comm import shm_all_gather
    from lomo_ds.profiling import count_comm
    from lomo_ds.runtime import ds_compat

    out = {}
    for int8 in (False, True):
        engine = lomo_ds.initialize(tiny_llama(5, hidden=128), _cfg(int8=int8, block=block, persist=0))
        batch = global_batch(0, engine.world)[engine.rank]
        shm = shm_all_gather.transport()
        with torch.no_grad():
            engine.eval_forward(batch)  # DeepSpeed records its trace
            calls = shm.calls if shm is not None else 0
            with count_comm() as counts:
                engine.eval_forward(batch)
        out["int8" if int8 else "bf16"] = counts.as_dict().get("all_gather_into_tensor", {}).get("bytes", 0)
        # Between CPU ranks of one node the shared-memory route carries the 8-bit gathers too.
        out["route"] = str(engine.param_gather.value)
        out[f"shm_calls_{'int8' if int8 else 'bf16'}"] = (shm.calls - calls) if shm is not None else 0
        out["shards_int8" if int8 else "shards_bf16"] = sum(
            ds_compat.shard(p).numel() * ds_compat.shard(p).element_size()
            + (ds_compat.int8_shard(p)[1].numel() * 4 if ds_compat.int8_shard(p) is not None else 0)
            for p in engine.module.parameters())
        engine.release()
    return out


GATHER, GATHER_BLOCK128, ZERO_INIT = multi_rank_checks(
    WORLDS, int8_gather=lambda: check_gather(8), int8_gather_b128=lambda: check_gather(128),
    int8_zero_init_write=lambda: check_gather(8, zero_init=True))
BYTES, = multi_rank_checks([2, 3], int8_gather_bytes=check_bytes)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("check", [GATHER, GATHER_BLOCK128, ZERO_INIT], ids=str)
def test_gathered_weights_are_the_shards_dequantized(rank_results, world, check):
    r = ok(rank_results(world), check)
    assert r["mismatched"] == [] and r["gathered_bad"] == []
    assert len(r["fetched"]) == len(r["kinds"])  # every parameter went through a fetch
    kinds = r["kinds"]
    # Norms (40 elements, under the persistence threshold of 100) stay whole in bf16; the rest is 8-bit.
    assert {k for n, k in kinds.items() if "norm" in n} == {"torch.bfloat16"}
    assert {k for n, k in kinds.items() if "norm" not in n} == {"int8"}
    assert r["failing_case"], "a doubled scale went unseen: the comparison cannot fail"


@pytest.mark.parametrize("world", [2, 3])
def test_gather_moves_about_half_of_bf16s_bytes(rank_results, world):
    r = ok(rank_results(world), BYTES)
    assert r["bf16"] > 0
    ratio = r["int8"] / r["bf16"]
    # 1 byte an element plus an fp32 scale per 128 (and the pieces a shard boundary cuts): 0.52x.
    assert 0.5 < ratio < 0.56, r
    assert 0.5 < r["shards_int8"] / r["shards_bf16"] < 0.56, r
    if r["route"] == "shared_memory":
        assert r["shm_calls_int8"] > 0, r
