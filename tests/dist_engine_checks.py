"""Multi-rank engine checks, run once per world size by tests/test_engine_dist.py.

Launched as `torchrun --nproc_per_node N tests/dist_engine_checks.py OUT.json`; every check
builds a fresh engine, runs it, and rank 0 records figures. The pytest side asserts on them, so
one launch per world size serves every test (rank start-up is the slow part on a CPU).
"""
from __future__ import annotations

import copy
import json
import math
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deepspeed  # noqa: E402

import lomo_ds  # noqa: E402
from lomo_ds import ds_compat  # noqa: E402
from lomo_ds.comm_stats import count_comm  # noqa: E402
from tiny import ScaledLlama, global_batch, tiny_llama, tiny_llama_config  # noqa: E402

LR = 0.05
STEPS = 3


def ds_cfg(persist=0, micro=2, **lomo):
    return {"train_micro_batch_size_per_gpu": micro,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": persist,
                                  "stage3_prefetch_bucket_size": 0},
            "lomo": {"lr": LR, "bucket_size": 700, **lomo}}


def max_diff(engine, ref):
    full = engine.full_state_dict()
    if engine.rank != 0:
        return None
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    assert set(full) == set(ref_params), (sorted(full), sorted(ref_params))
    return max((full[k] - ref_params[k].detach()).abs().max().item() for k in ref_params)


def reference_step(ref, mbs, world, clip_norm=None, clip_value=None, wd=0.0, forward=None):
    forward = forward or (lambda m, b: m(**b).loss)
    opt = torch.optim.SGD(ref.parameters(), lr=LR, weight_decay=wd)
    opt.zero_grad()
    loss = sum(forward(ref, mb) for mb in mbs) / world
    loss.backward()
    norm = None
    if clip_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip_norm).item()
    if clip_value is not None:
        torch.nn.utils.clip_grad_value_(ref.parameters(), clip_value)
    opt.step()
    return loss.item(), norm


def equivalence(make_model, cfg, ref_kwargs=None, forward=None, engine_forward_batch=None, zero_init=False,
                steps=STEPS, prepare=None, batches=global_batch):
    ref_kwargs = ref_kwargs or {}
    ref = make_model()
    if zero_init:
        # Built already partitioned (no rank ever holds the whole model), then loaded from rank 0
        # the way from_pretrained loads a checkpoint under zero.Init.
        ds_conf = {k: v for k, v in cfg.items() if k != "lomo"}
        with deepspeed.zero.Init(config_dict_or_path=ds_conf):
            model = make_model()
        for p, src in zip(model.parameters(), ref.parameters()):
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                if torch.distributed.get_rank() == 0:
                    p.data.copy_(src.data)
    else:
        model = copy.deepcopy(ref)
    if prepare:
        prepare(model), prepare(ref)
    engine = lomo_ds.initialize(model, cfg)
    world, rank = engine.world, engine.rank
    losses, ref_losses, norms, ref_norms = [], [], [], []
    for step in range(steps):
        mbs = batches(step, world)
        out = engine.train_step(mbs[rank])
        rl, rn = reference_step(ref, mbs, world, forward=forward, **ref_kwargs)
        losses.append(out["loss"]), ref_losses.append(rl), norms.append(out["grad_norm"]), ref_norms.append(rn)
    diff = max_diff(engine, ref)
    return {"max_abs_diff": diff, "loss": losses, "ref_loss": ref_losses, "grad_norm": norms, "ref_grad_norm": ref_norms,
            "n_persistent": len(engine.offload.persistent_parameters), "n_params": len(engine.params)}


def scaled_forward(m, b):
    return m(**b)


def check_overflow():
    """A non-finite gradient on the last rank only: every rank skips, parameters bit-identical."""
    model = tiny_llama(3)
    cfg = ds_cfg(loss_scale={"enabled": True, "initial_scale_power": 8, "window": 2})
    engine = lomo_ds.initialize(model, cfg)
    world, rank = engine.world, engine.rank
    target = engine.module.model.layers[0].mlp.down_proj.weight
    inject = {"on": False}

    def poison(grad):
        if inject["on"] and rank == world - 1:
            return grad * float("inf")
        return grad

    target.register_hook(poison)
    record = []

    def shards():
        # Raw bytes: "bit-identical" includes the padding tail, which may hold NaN patterns.
        return [ds_compat.shard(p).clone().view(torch.uint8) for p in engine.params]

    for step in range(5):
        inject["on"] = step == 1
        before = shards()
        out = engine.train_step(global_batch(step, world)[rank])
        after = shards()
        identical = all(torch.equal(a, b) for a, b in zip(before, after))
        flags = torch.tensor([float(out["skipped"]), float(identical)])
        gathered = [torch.zeros_like(flags) for _ in range(world)]
        torch.distributed.all_gather(gathered, flags) if world > 1 else gathered.__setitem__(0, flags)
        record.append({"step": step, "skipped_all_ranks": [bool(g[0]) for g in gathered],
                       "unchanged_all_ranks": [bool(g[1]) for g in gathered],
                       "loss_scale_used": out["loss_scale"], "scale_after": engine.loss_scaler.scale})
    return {"steps": record}


def check_memory():
    """Peak bytes held during backward against the bound: shards + bucket + one layer."""
    model = tiny_llama(4, layers=4, hidden=64)
    cfg = ds_cfg(micro=2)
    cfg["zero_optimization"].update({"stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0})
    engine = lomo_ds.initialize(model, cfg)
    tracker = engine.enable_memory_tracking()
    world, rank = engine.world, engine.rank
    for step in range(2):
        tracker.reset()
        engine.train_step(global_batch(step, world)[rank])
    esize = 4
    shard_bytes = sum(ds_compat.shard(p).numel() * esize for p in engine.params)
    full_bytes = sum(ds_compat.full_numel(p) * esize for p in engine.params)
    # The largest "layer" DeepSpeed gathers at once: a module's own (direct) parameters.
    layer_bytes = max(sum(ds_compat.full_numel(p) * esize for p in m.parameters(recurse=False))
                      for m in engine.module.modules())
    block_bytes = max(sum(ds_compat.full_numel(p) * esize for p in blk.parameters())
                      for blk in engine.module.model.layers)
    bucket_cap = cfg["lomo"]["bucket_size"] * esize * world  # gradients pending + the send buffer
    largest_param = max(ds_compat.full_numel(p) for p in engine.params) * esize
    p = tracker.peak
    return {"peak": {"shard": p.shard_bytes, "gathered": p.gathered_bytes, "persistent": p.persistent_bytes,
                     "grad": p.grad_bytes, "bucket": p.bucket_bytes, "total": p.total},
            "peak_gathered_plus_grad": tracker.peak_gathered_plus_grad,
            "shard_bytes": shard_bytes, "full_model_bytes": full_bytes, "layer_bytes": layer_bytes,
            # A bucket filling (gradients, then its send buffer) while the previous one is in flight:
            # its send buffer and this rank's 1/world receive buffer.
            "block_bytes": block_bytes, "bucket_bound": (2 + 1 / world) * (bucket_cap + largest_param),
            "samples": tracker.samples}


def check_comm(two_pass: bool):
    """Bytes sent per step, by collective, against the ZeRO-3 minimum."""
    model = tiny_llama(5, layers=2)
    lomo = {"clip_grad_norm": 1e-3} if two_pass else {}
    cfg = ds_cfg(**lomo)
    # No parameter kept gathered between uses: every use is a fresh all-gather, the ZeRO-3 floor
    # for a model that does not fit gathered.
    cfg["zero_optimization"].update({"stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0})
    engine = lomo_ds.initialize(model, cfg)
    world, rank = engine.world, engine.rank
    engine.train_step(global_batch(0, world)[rank])  # first step records DeepSpeed's trace
    with count_comm() as counts:
        engine.train_step(global_batch(1, world)[rank])
    esize = 4
    padded = sum(math.ceil(ds_compat.full_numel(p) / world) * world for p in engine.params)
    nonpersistent_padded = sum(math.ceil(ds_compat.full_numel(p) / world) * world for p in engine.params
                               if not ds_compat.is_persistent(p))
    ring = (world - 1) / world
    # Each bucket's payload carries one non-finite flag element per rank besides the gradients.
    flags = world * len(engine.buckets.layout)
    return {"counts": counts.as_dict(),
            "param_padded_bytes": padded * esize, "nonpersistent_padded_bytes": nonpersistent_padded * esize,
            "expected_reduce_scatter": int(ring * (padded + flags) * esize) * (2 if two_pass else 1),
            "ring": ring, "world": world}


def check_bf16(steps=30, lr=1e-3):
    """bf16 shards with no master copy: stochastic rounding keeps the small updates that
    round-to-nearest drops. Measured as the relative error of the total parameter change
    against an fp32 reference trained on the same batches."""
    out = {}
    ref = tiny_llama(10)
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    world = torch.distributed.get_world_size()
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for step in range(steps):
        mbs = global_batch(step, world)
        opt.zero_grad()
        (sum(ref(**mb).loss for mb in mbs) / world).backward()
        opt.step()
    ref_delta = torch.cat([(p.detach() - start[n]).reshape(-1) for n, p in ref.named_parameters()])
    for mode, lomo in {"stochastic": {"stochastic_rounding": True},
                       "nearest": {"stochastic_rounding": False},
                       "fp32_master": {"stochastic_rounding": False, "fp32_master_weights": True}}.items():
        cfg = ds_cfg(**lomo)
        cfg["lomo"]["lr"] = lr
        cfg["bf16"] = {"enabled": True}
        model = tiny_llama(10)
        bf16_start = {n: p.detach().to(torch.bfloat16).float() for n, p in model.named_parameters()}
        engine = lomo_ds.initialize(model, cfg)
        for step in range(steps):
            engine.train_step(global_batch(step, world)[engine.rank])
        full = engine.full_state_dict()
        if engine.rank == 0:
            delta = torch.cat([(full[n].float() - bf16_start[n]).reshape(-1) for n, _ in ref.named_parameters()])
            # realized: the share of the reference's movement the bf16 run made (1.0 = all of
            # it, on average); round-to-nearest loses the updates below half an ulp.
            out[mode] = {"rel_error": ((delta - ref_delta).norm() / ref_delta.norm()).item(),
                         "realized": (delta @ ref_delta / (ref_delta @ ref_delta)).item(),
                         "dtype": str(next(iter(full.values())).dtype)}
    return out


def main(out_path):
    lomo_ds.init_distributed()
    rank = torch.distributed.get_rank()
    results = {}
    checks = {
        "sgd": lambda: equivalence(lambda: tiny_llama(0), ds_cfg()),
        "sgd_zero_init": lambda: equivalence(lambda: tiny_llama(0), ds_cfg(), zero_init=True),
        "clip_norm": lambda: equivalence(lambda: tiny_llama(1), ds_cfg(clip_grad_norm=0.5),
                                         {"clip_norm": 0.5}),
        "clip_norm_recompute": lambda: equivalence(lambda: tiny_llama(1), ds_cfg(clip_grad_norm=0.5,
                                                                                  two_pass_mode="recompute"),
                                                   {"clip_norm": 0.5}),
        "clip_value": lambda: equivalence(lambda: tiny_llama(2), ds_cfg(clip_grad_value=0.002),
                                          {"clip_value": 0.002}),
        "weight_decay": lambda: equivalence(lambda: tiny_llama(2), ds_cfg(weight_decay=0.3), {"wd": 0.3}),
        "tied": lambda: equivalence(lambda: tiny_llama(6, tie=True), ds_cfg()),
        "persistent": lambda: equivalence(lambda: tiny_llama(7), ds_cfg(persist=100_000)),
        "persistent_mixed": lambda: equivalence(lambda: tiny_llama(7), ds_cfg(persist=2_000, clip_grad_norm=0.5),
                                                {"clip_norm": 0.5}),
        "small_param": lambda: equivalence(lambda: ScaledLlama(8), ds_cfg(), forward=scaled_forward),
        "grad_checkpointing": lambda: equivalence(
            lambda: tiny_llama(9), ds_cfg(clip_grad_norm=0.5), {"clip_norm": 0.5},
            prepare=lambda m: m.gradient_checkpointing_enable()),
        "grad_checkpointing_reentrant": lambda: equivalence(
            lambda: tiny_llama(9), ds_cfg(clip_grad_norm=0.5), {"clip_norm": 0.5},
            prepare=lambda m: m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})),
        "overflow": check_overflow,
        "bf16": check_bf16,
        "memory": check_memory,
        "comm_one_pass": lambda: check_comm(False),
        "comm_two_pass": lambda: check_comm(True),
    }
    if int(os.environ["WORLD_SIZE"]) != 2:  # the precision and traffic figures need one world size
        for name in ("bf16", "comm_one_pass", "comm_two_pass"):
            checks.pop(name)
    only = os.environ.get("LOMO_CHECKS")
    for name, fn in checks.items():
        if only and name not in only.split(","):
            continue
        try:
            results[name] = fn()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        torch.distributed.barrier()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
