"""A rank's 8-bit shards (memory.int8_shards) as the engine holds them on CPU ranks, against the
planner's terms for the same tiny run (lomo_ds/planning/int8_shards.py), on 1, 2 and 3 ranks: the
storage behind the int8 shards and their fp32 scales at most the planner's figures (the most pieces
any rank keeps, in whole blocks) and at least the padded slices' bytes and one piece a parameter
fewer, the same before and after two steps (the update writes the shards in place), and the
persistent parameters in the compute dtype exactly (their shards, and their whole copies through a
step)."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from lomo_ds.config.run import load_run_config
from lomo_ds.planning import int8_shards as I8
from lomo_ds.planning.planner import ModelSpec, run_spec_for
from lomo_ds.runtime import ds_compat
from tests.ranks import multi_rank, ok
from tests.tiny import engine_sections

# The planner's measured model (tests/planning/test_planner.py TINY): odd sizes, so that shard
# boundaries cut blocks of 128 on 2 and 3 ranks; norms (128 elements) under the persistence threshold.
TINY = dict(hidden=128, layers=2, intermediate=344, vocab=256, heads=4, kv_heads=2, head_dim=32)
SEQ, MICRO, BLOCK = 16, 2, 128
ZERO = {"stage": 3, "stage3_param_persistence_threshold": 1000, "stage3_max_live_parameters": 30_000,
        "stage3_max_reuse_distance": 30_000, "stage3_prefetch_bucket_size": 0}
MISSING = "8-bit shards are not wired into the engine yet (lomo_ds.runtime.ds_compat.int8_shard is missing)"
NOT_CONVERTED = ("8-bit shards are not wired into the engine yet: with memory.int8_shards the engine converted no "
                 "shard (lomo_ds.comm.int8_gather.install_int8_shards, called by LomoEngine)")


def _config(world_extra: dict | None = None):
    ds = {"train_micro_batch_size_per_gpu": MICRO, "bf16": {"enabled": True}, "zero_optimization": ZERO}
    options = {"lr": 1e-3, "optimizer": "sgd", "int8_shards": True, "int8_block": BLOCK, **(world_extra or {})}
    return load_run_config({**ds, **engine_sections(options), "model": {"path": "tiny"},
                            "tokenizer": {"max_length": SEQ}}, check_files=False)


def _held_bytes(engine) -> dict:
    """This rank's bytes of parameter storage between steps: the 8-bit shards, their scales, and the
    compute-dtype tensors of every other parameter (shards, and whole copies where gathered, each
    storage once)."""
    q_bytes = s_bytes = other = 0
    seen: set[int] = set()
    converted = 0
    for p in engine.params:
        pair = ds_compat.int8_shard(p)
        if pair is not None:
            q, s = pair
            assert q.dtype == torch.int8 and s.dtype == torch.float32
            q_bytes += q.untyped_storage().nbytes()
            s_bytes += s.untyped_storage().nbytes()
            converted += 1
            continue
        for t in (ds_compat.shard(p), p.data):
            st = t.untyped_storage()
            if st.nbytes() and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                other += st.nbytes()
    return {"int8": q_bytes, "scales": s_bytes, "persistent": other, "converted": converted}


@multi_rank(worlds=(1, 2, 3))
def int8_shard_bytes() -> dict:
    """Every rank's parameter bytes after the conversion and after one step, gathered to rank 0."""
    if getattr(ds_compat, "int8_shard", None) is None:
        return {"missing": MISSING}
    from transformers import LlamaConfig, LlamaForCausalLM

    from lomo_ds.methods import build_engine

    cfg = LlamaConfig(vocab_size=TINY["vocab"], hidden_size=TINY["hidden"], intermediate_size=TINY["intermediate"],
                      num_hidden_layers=TINY["layers"], num_attention_heads=TINY["heads"],
                      num_key_value_heads=TINY["kv_heads"], head_dim=TINY["head_dim"], max_position_embeddings=64,
                      attn_implementation="eager", use_cache=False, torch_dtype=torch.bfloat16)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    engine = build_engine(_config(), model, total_steps=0)
    before = _held_bytes(engine)
    if not before["converted"]:
        return {"missing": NOT_CONVERTED}
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, TINY["vocab"], (MICRO, SEQ), generator=g, device="cpu")
    # The first step records DeepSpeed's module trace (the persistent parameters are gathered for
    # good from the second on); the second is the steady state the planner predicts.
    engine.train_step({"input_ids": ids, "labels": ids.clone()})
    tracker = engine.enable_memory_tracking()
    engine.train_step({"input_ids": ids, "labels": ids.clone()})
    after = _held_bytes(engine)
    # the persistent parameters' whole copies through the forward and the backward (on one rank the
    # shard is the parameter): the engine's tracker samples them at every gradient hook
    after["persistent_whole"] = tracker.peak.persistent_bytes
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    ranks = [None] * world
    if world > 1:
        torch.distributed.all_gather_object(ranks, {"before": before, "after": after})
    else:
        ranks = [{"before": before, "after": after}]
    return {"world": world, "ranks": ranks}


def _planned(world: int):
    spec = ModelSpec("tiny", TINY["hidden"], TINY["layers"], TINY["intermediate"], TINY["vocab"], TINY["heads"],
                     TINY["kv_heads"], TINY["head_dim"])
    run = run_spec_for(_config())
    assert (run.int8_shards, run.int8_block, run.persistence, run.dtype) == (True, BLOCK, 1000, "bf16")
    return spec, replace(run, attn="eager")


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_ranks_8bit_shards_are_the_planners(rank_results, world):
    r = ok(rank_results(world), int8_shard_bytes)
    if "missing" in r:
        pytest.skip(r["missing"])
    assert r["world"] == world
    spec, run = _planned(world)
    q, s = I8.shard_bytes(spec, run, world)
    big = [x for x in spec.param_numels() if x > run.persistence]
    slices = sum(-(-x // world) for x in big)  # the padded ZeRO-3 slices, a byte an element
    persistent = I8.persistent_bytes(spec, run, world)
    for rank, figures in enumerate(r["ranks"]):
        for when in ("before", "after"):
            m = figures[when]
            detail = f"rank {rank} of {world}, {when} the steps: measured {m}, planned int8 {q}, scales {s}, " \
                     f"persistent {persistent}"
            assert m["converted"] == len(big), detail
            assert slices <= m["int8"] <= q, detail
            # the planner's pieces are the most any rank keeps of each parameter: a rank keeps at
            # most one piece a parameter fewer
            assert s - 4 * len(big) <= m["scales"] <= s, detail
        # the persistent parameters' shards between steps, and their whole copies during the step
        after = figures["after"]
        assert after["persistent"] + after["persistent_whole"] == persistent, detail
    if world == 1:  # one slice a parameter: ceil(x / B) pieces, the planner's count
        assert r["ranks"][0]["before"]["scales"] == s
    # 0.52x of the compute dtype's shard bytes at B = 128
    assert (q + s) / (2 * q) == pytest.approx(1 / 2 + 2 / BLOCK, abs=0.01)


CHUNK = 2 * BLOCK  # a dequantization chunk far below the parts of TINY's largest parameter


@multi_rank(worlds=(1, 3))
def int8_gather_transients() -> dict:
    """The allocations of one 8-bit gather of the largest parameter (its own unit), beyond the
    gathered weight itself, as lomo_ds's gather makes them (comm/int8_gather.py)."""
    try:
        from lomo_ds.comm.int8_gather import gather_int8
    except ImportError:
        return {"missing": MISSING}
    from transformers import LlamaConfig, LlamaForCausalLM

    from lomo_ds.methods import build_engine
    from tests.planning.test_planner import _NewStorageBytes

    cfg = LlamaConfig(vocab_size=TINY["vocab"], hidden_size=TINY["hidden"], intermediate_size=TINY["intermediate"],
                      num_hidden_layers=TINY["layers"], num_attention_heads=TINY["heads"],
                      num_key_value_heads=TINY["kv_heads"], head_dim=TINY["head_dim"], max_position_embeddings=64,
                      attn_implementation="eager", use_cache=False)
    torch.manual_seed(0)
    engine = build_engine(_config(), LlamaForCausalLM(cfg).to(torch.bfloat16), total_steps=0)
    converted = [p for p in engine.params if ds_compat.int8_shard(p) is not None]
    if not converted:
        return {"missing": NOT_CONVERTED}
    p = max(converted, key=ds_compat.full_numel)
    counter = _NewStorageBytes([t for q in converted for t in ds_compat.int8_shard(q)])
    with counter:
        handle = gather_int8([p])
        handle.wait()
        weight = p.data.untyped_storage().nbytes()
    # The dequantization alone, of the same received buffers (whatever the transport allocated):
    # each rank's part at once, then CHUNK elements at a time.
    import lomo_ds.comm.int8_gather as gather_module
    recv_q, recv_s = handle.recv_q.to(handle.device), handle.recv_s.to(handle.device)
    known = [t for q in converted for t in ds_compat.int8_shard(q)] + [recv_q, recv_s, p.data]
    dequantized = {}
    for name, chunk in (("whole", -(-ds_compat.full_numel(p) // BLOCK) * BLOCK), ("chunked", CHUNK)):
        gather_module.INT8_DEQUANTIZE_CHUNK = chunk
        alone = _NewStorageBytes(known)
        with alone:
            out = handle._dequantized(p, recv_q, recv_s, *handle.layout[0])
        dequantized[name] = [alone.peak - out.untyped_storage().nbytes(), torch.equal(out, p.data.reshape(-1))]
        del out
    del handle
    return {"numel": ds_compat.full_numel(p), "peak": counter.peak, "weight": weight, "dequantize": dequantized}


@pytest.mark.parametrize("world", [1, 3])
def test_the_gathers_transients_are_the_planners(rank_results, world):
    """The planner's gather terms for a unit of one parameter x: the send buffer and the all-gather's
    output with their scales, and one rank's part in fp32 and its cast (the gathered weight, b x, is
    the working set's)."""
    r = ok(rank_results(world), int8_gather_transients)
    if "missing" in r:
        pytest.skip(r["missing"])
    x = r["numel"]
    spec = ModelSpec("one", hidden=1, layers=0, intermediate=1, vocab=x, heads=1, tie=True)
    _, run = _planned(world)
    assert spec.param_numels() == [x, 1] and r["weight"] == 2 * x
    planned = I8.gather_buffer_bytes(spec, run, world) + I8.dequantize_bytes(spec, run, world)
    detail = f"{world} ranks, {x} elements: measured {r['peak'] - r['weight']} beyond the weight, planned {planned}"
    # The planner counts one scale slot a buffer more than a slice on whole blocks needs. On CPU
    # ranks the shared-memory all-gather has let its send buffer go before the dequantization,
    # which the planner keeps (an accelerator's asynchronous all-gather may hold it).
    part = -(-x // world)
    send = part + 4 * (math.ceil(part / BLOCK) + 1) if world > 1 else 0
    slots = 4 * (world + 1 if world > 1 else 1)
    assert planned - send - slots <= r["peak"] - r["weight"] <= planned, detail
    # The dequantization alone: the same weight whole or CHUNK elements at a time, each within the
    # planner's term for it, and the chunk's transient a fraction of the part's.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(I8, "INT8_DEQUANTIZE_CHUNK", x)
        whole = I8.dequantize_bytes(spec, run, world)
        mp.setattr(I8, "INT8_DEQUANTIZE_CHUNK", CHUNK)
        chunked = I8.dequantize_bytes(spec, run, world)
    (at_once, same_whole), (by_chunk, same_chunked) = r["dequantize"]["whole"], r["dequantize"]["chunked"]
    detail = f"{world} ranks: dequantized at once {at_once} (planned {whole}), by chunks {by_chunk} (planned {chunked})"
    assert same_whole and same_chunked, detail
    assert at_once <= whole and by_chunk <= chunked < whole / 4, detail
    assert by_chunk < at_once / 4, detail
