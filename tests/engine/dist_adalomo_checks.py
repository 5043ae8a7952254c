"""What the multi-rank AdaLomo checks build and measure; tests/engine/test_adalomo.py declares them
(tests/ranks.py runs them in one launch per world size) and asserts on rank 0's figures."""
from __future__ import annotations

import copy
import io

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import lomo_ds
from lomo_ds.engine.update import geometry
from lomo_ds.profiling import count_comm
from lomo_ds.runtime import ds_compat
from tests.adalomo_reference import ReferenceAdaLomo
from tests.engine.dist_engine_checks import bf16_movement, ds_cfg, host_updates_applied, inline_and_thread, max_diff
from tests.tiny import global_batch, tiny_llama

# AdaLomo steps every parameter by lr * RMS(param) whatever its gradient's size, and its update
# normalises the gradient, so a gradient entry summed in another order (over ranks instead of in
# one batch) moves by up to the step times its relative rounding error. At lr 0.01 a norm weight
# (RMS about 1.2) moves 0.012 a step and those differences stay a few fp32 ulps.
LR = 0.01
STEPS = 3


def adalomo_cfg(persist=0, lr=LR, fetch=None, **lomo):
    cfg = ds_cfg(persist=persist, fetch=fetch, optimizer="adalomo", **lomo)
    cfg["lomo"]["lr"] = lr
    return cfg


def reference_step(ref, opt, mbs, world, clip_norm=None, clip_value=None, forward=None):
    forward = forward or (lambda m, b: m(**b).loss)
    ref.zero_grad()
    loss = sum(forward(ref, mb) for mb in mbs) / world
    loss.backward()
    if clip_norm is not None:
        torch.nn.utils.clip_grad_norm_(ref.parameters(), clip_norm)
    if clip_value is not None:
        torch.nn.utils.clip_grad_value_(ref.parameters(), clip_value)
    opt.step()
    return loss.item()


def crosses_rows(engine) -> int:
    """Matrices whose slice on some rank starts mid-row: the case the partial sums exist for."""
    n = 0
    for p in engine.params:
        shape = ds_compat.full_shape(p)
        if len(shape) == 2:
            n += any(geometry(p, engine.world, r).start % shape[1] and geometry(p, engine.world, r).local
                     for r in range(engine.world))
    return n


def equivalence(make_model, cfg, clip_norm=None, clip_value=None, wd=0.0, forward=None):
    ref = make_model()
    start = [p.detach().clone() for p in ref.parameters()]
    engine = lomo_ds.initialize(copy.deepcopy(ref), cfg)
    opt = ReferenceAdaLomo(ref.parameters(), LR, weight_decay=wd)
    world, rank = engine.world, engine.rank
    losses, ref_losses = [], []
    for step in range(STEPS):
        mbs = global_batch(step, world)
        losses.append(engine.train_step(mbs[rank])["loss"])
        ref_losses.append(reference_step(ref, opt, mbs, world, clip_norm, clip_value, forward))
    moved = max((p.detach() - p0).abs().max().item() for p, p0 in zip(ref.parameters(), start, strict=True))
    return {"max_abs_diff": max_diff(engine, ref), "moved": moved, "loss": losses, "ref_loss": ref_losses,
            "crosses_rows": crosses_rows(engine), "n_persistent": len(engine.offload.persistent_parameters),
            # Slices the host-update worker applied, and the updates of slices with real elements
            # this rank made in all (every one of them goes to the worker with host_update "thread").
            "host_updates": host_updates_applied(engine),
            "slice_updates": STEPS * sum(1 for p in engine.params if engine.updater.geometry(p).local),
            "shard_devices": sorted({ds_compat.shard(p).device.type for p in engine.params}),
            "leaf_modules": sorted({type(m).__name__ for m in ds_compat.leaf_modules(engine.module)}),
            "n_params": len(engine.params)}


def check_resume(bf16: bool, warm: bool = False, **lomo):
    """2 steps, shard state saved and loaded into a fresh engine, 1 more step == 3 in a row.
    `warm`: the engine loaded into has trained a step of its own first, so that everything it
    learnt about its weights then (the host-update worker's sums of squares) is stale."""
    cfg = adalomo_cfg(clip_grad_norm=0.5, **lomo)
    if bf16:
        cfg["bf16"] = {"enabled": True}
    straight = lomo_ds.initialize(tiny_llama(11), cfg)
    world, rank = straight.world, straight.rank
    buf = io.BytesIO()
    for step in range(3):
        if step == 2:  # after 2 steps: through bytes, as a checkpoint file
            torch.save(straight.shard_state_dict(), buf)
        straight.train_step(global_batch(step, world)[rank])
    buf.seek(0)
    resumed = lomo_ds.initialize(tiny_llama(12 if warm else 11), cfg)
    if warm:
        resumed.train_step(global_batch(5, world)[rank])
    resumed.load_shard_state_dict(torch.load(buf, weights_only=False))
    resumed.train_step(global_batch(2, world)[rank])
    a, b = straight.full_state_dict(), resumed.full_state_dict()
    applied = host_updates_applied(resumed)
    if rank != 0:
        return None
    return {"max_abs_diff": max((a[k].float() - b[k].float()).abs().max().item() for k in a),
            "state_keys": sorted(resumed.shard_state_dict()["rule"]["state"])[:3], "host_updates": applied}


def check_thread_bitwise():
    """The same run with the update inline and through the host-update worker: bf16 shards with
    stochastic rounding (the worker's draws in the hook's order) and norm clipping; the shards
    must come out bit-identical (the same u, coefficients and sums of squares, wherever taken)."""
    full, applied = inline_and_thread(lambda mode: adalomo_cfg(clip_grad_norm=0.5, host_update=mode))
    if torch.distributed.get_rank() != 0:
        return None
    return {"bitwise_equal": all(torch.equal(full["inline"][k], full["thread"][k]) for k in full["inline"]),
            "moved": sum(not torch.equal(full["thread"][k].float(), v.to(torch.bfloat16).float())
                         for k, v in tiny_llama(11).state_dict().items() if k in full["thread"]),
            "thread_applied": applied}


def check_bf16(steps=15, lr=1e-3):
    """bf16 shards without masters: AdaLomo's write-back goes through stochastic rounding, so
    updates below half a bf16 ulp still land, as a share of an fp32 reference's movement. The
    bf16 forward itself moves that share (AdaLomo's normalised update flips with the sign of tiny
    gradient entries), so fp32 master weights give the yardstick."""
    world = torch.distributed.get_world_size()
    ref = tiny_llama(10)
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    opt = ReferenceAdaLomo(ref.parameters(), lr)
    for step in range(steps):
        reference_step(ref, opt, global_batch(step, world), world)
    return bf16_movement(ref, start, lambda **lomo: adalomo_cfg(lr=lr, **lomo), steps)


def llama_shaped(seed=0):
    # LLaMA-1 layout (no grouped KV heads, SwiGLU at ~2.7x hidden), scaled down.
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1376,
                                        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
                                        max_position_embeddings=64, attn_implementation="eager"))


def check_traffic():
    """Bytes each rank sends in one step, LOMO against AdaLomo, same model, data and buckets."""
    out = {}
    for name, optimizer in (("lomo", "sgd"), ("adalomo", "adalomo")):
        cfg = ds_cfg(optimizer=optimizer, bucket_size=1_000_000, grad_reduction="reduce_scatter")
        cfg["lomo"]["lr"] = 1e-3
        engine = lomo_ds.initialize(llama_shaped(), cfg)
        world, rank = engine.world, engine.rank
        engine.train_step(global_batch(0, world, vocab=1000)[rank])  # first step records DeepSpeed's trace
        with count_comm() as counts:
            engine.train_step(global_batch(1, world, vocab=1000)[rank])
        out[name] = {"counts": counts.as_dict(), "total": counts.total_bytes}
        if optimizer == "adalomo":
            out["adalomo_state_bytes"] = engine.updater.rule.state_bytes()
            out["param_bytes"] = sum(ds_compat.full_numel(p) * 4 for p in engine.params)
            out["shard_bytes"] = sum(ds_compat.shard(p).numel() * 4 for p in engine.params)
            out["n_params"] = len(engine.params)
    return out


def check_memory():
    """The memory tracker counts AdaLomo's state beside the shards."""
    engine = lomo_ds.initialize(tiny_llama(4), adalomo_cfg())
    tracker = engine.enable_memory_tracking()
    engine.train_step(global_batch(0, engine.world)[engine.rank])
    return {"peak_state_bytes": tracker.peak.state_bytes, "state_bytes": engine.updater.rule.state_bytes(),
            "shard_bytes": sum(ds_compat.shard(p).numel() * 4 for p in engine.params),
            "param_bytes": sum(ds_compat.full_numel(p) * 4 for p in engine.params)}
