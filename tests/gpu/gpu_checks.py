"""The multi-rank GPU checks, run once per world size by tests/gpu/test_gpu.py (NCCL, one GPU per rank).

    python -m torch.distributed.run --nproc_per_node N -m tests.gpu.gpu_checks OUT.json
    ... -m tests.gpu.gpu_checks OUT.json --smoke --only step_time,offload   # the same code, tiny, on a CPU

Each check builds its own engines and rank 0 records figures; the pytest side asserts on them. The
equivalence, bf16 and overflow checks are the CPU suite's (tests/dist_engine_checks.py) run on CUDA;
new here: parameter offload, peak memory against the planner, and step time against the floor and
DeepSpeed's own ZeRO-3 SGD. --smoke runs the new ones with tiny sizes on whatever device there is,
so a CPU proves they run.
"""
from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import lomo_ds
from experiments.common import FloorEngine
from lomo_ds.methods.deepspeed_optim import DeepSpeedOptimizerEngine
from lomo_ds.runtime import ds_compat
from tests import dist_accumulation_checks as A
from tests.dist_engine_checks import check_bf16, check_overflow, ds_cfg, equivalence
from tests.gpu.compare import memory_run_config, predicted_peak_bytes, step_time_table
from tests.ranks import run_checks
from tests.tiny import tiny_llama

# Model sizes: (GPU, --smoke). The memory model's states (0.9 GB bf16 + the update's 0.35 GB) dwarf
# the allocator's fixed costs; its activations (checkpointed, 2 x 256 tokens) stay small, so the
# planner's conservative sum of peaks that do not quite coincide is tested where it matters.
MEMORY_MODEL = {"gpu": dict(vocab_size=8192, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                            num_attention_heads=16, micro=2, seq=256)}
STEP_MODEL = {"gpu": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                          num_attention_heads=16, micro=4, seq=512, warmup=3, steps=10),
              "smoke": dict(vocab_size=97, hidden_size=40, intermediate_size=83, num_hidden_layers=2,
                            num_attention_heads=4, micro=2, seq=16, warmup=1, steps=2)}


def llama_config(sizes: dict) -> LlamaConfig:
    arch = {k: v for k, v in sizes.items() if k not in ("micro", "seq", "warmup", "steps")}
    return LlamaConfig(**arch, max_position_embeddings=sizes["seq"], tie_word_embeddings=False, use_cache=False)


def llama(sizes: dict, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(sizes))


def random_batch(sizes: dict, device: torch.device, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, sizes["vocab_size"], (sizes["micro"], sizes["seq"]), generator=g)
    return {"input_ids": ids.to(device), "labels": ids.to(device)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    torch.distributed.barrier()


def check_offload(pin: bool):
    """offload_param: cpu. The update must follow the shard to the host and still equal SGD."""
    cfg = ds_cfg()
    cfg["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": pin}
    result = equivalence(lambda: tiny_llama(0), cfg)
    engine = lomo_ds.initialize(tiny_llama(0), cfg)
    result["shard_device"] = ds_compat.shard(engine.params[0]).device.type
    return result


def check_memory(device: torch.device, workdir: str):
    """torch.cuda.max_memory_allocated over a steady-state step against the planner's prediction for
    the same run config (plan_for_run, as --dry-run prints it)."""
    sizes = MEMORY_MODEL["gpu"]
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    model_dir = os.path.join(workdir, "memory_model")
    if rank == 0:
        llama_config(sizes).save_pretrained(model_dir)  # the planner reads the architecture from it
    torch.distributed.barrier()
    run = memory_run_config(model_dir, sizes["micro"], sizes["seq"])
    # cuBLAS keeps a workspace per thread (the autograd thread's included) once it has multiplied:
    # make both exist before the baseline, so the measured peak is this run's own memory.
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.ones(64, 64, device=device, dtype=dtype, requires_grad=True)
        (a @ a).sum().backward()
    del a
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    model = llama(sizes)
    model.gradient_checkpointing_enable()  # as lomo_ds.storage.models.load_model does for the run config
    engine = lomo_ds.initialize(model, {k: v for k, v in run.items() if k not in ("model", "tokenizer")})
    batch = random_batch(sizes, device, seed=rank)
    engine.train_step(batch)  # the first step records DeepSpeed's module trace
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    engine.train_step(batch)
    sync(device)
    measured = torch.cuda.max_memory_allocated(device) - base
    per_rank = [None] * world
    torch.distributed.all_gather_object(per_rank, measured)
    del engine, model
    gc.collect()
    torch.cuda.empty_cache()
    return {"measured": max(per_rank), "per_rank": per_rank, "predicted": predicted_peak_bytes(run, world),
            "base": base}


def check_step_time(device: torch.device, sizes: dict):
    """LOMO, the floor and DeepSpeed ZeRO-3 SGD on the same model and batches, taking turns step by
    step (so drifts in clocks and neighbours hit all three alike); per-step times, and medians."""
    ds = {"train_micro_batch_size_per_gpu": sizes["micro"], "zero_optimization": {"stage": 3}}
    if device.type == "cuda":
        ds["bf16"] = {"enabled": True}
    engines = {"floor": FloorEngine(llama(sizes), ds),
               "lomo": lomo_ds.initialize(llama(sizes), {**ds, "lomo": {"lr": 1e-3}}),
               "deepspeed_sgd": DeepSpeedOptimizerEngine(llama(sizes), ds, "sgd", "sgd", lr=1e-3, clip=None,
                                                          total_steps=0, warmup_steps=0)}
    rank = torch.distributed.get_rank()
    batches = [random_batch(sizes, device, seed=1000 * step + rank) for step in range(sizes["warmup"] + sizes["steps"])]
    times = {name: [] for name in engines}
    for step, batch in enumerate(batches):
        for name, engine in engines.items():
            sync(device)
            t0 = time.perf_counter()
            engine.train_step(batch)
            sync(device)
            if step >= sizes["warmup"]:
                times[name].append(time.perf_counter() - t0)
    return {"times": times, "table": step_time_table(times), "model": sizes,
            "world": torch.distributed.get_world_size()}


def check_offload_overlap(device: torch.device, sizes: dict):
    """offload_param: cpu with the shards' updates on the host-update thread (slices staged in pinned
    memory, the CPU update overlapped with the backward) against the same updates inside the hook
    (lomo.host_update inline: the serialised path) and against no offload, taking turns step by
    step. Per-step times, medians, and the updates the worker applied; on the serialised path the
    worker applies none ("applied" 0, which tests/dist_engine_checks.host_updates_applied refuses)
    and "thread" saves nothing over "inline" ("saved_s")."""
    import statistics

    on_gpu = device.type == "cuda"
    ds = {"train_micro_batch_size_per_gpu": sizes["micro"], "zero_optimization": {"stage": 3}}
    if on_gpu:
        ds["bf16"] = {"enabled": True}

    def engine(host_update):
        zero = dict(ds["zero_optimization"])
        if host_update:
            zero["offload_param"] = {"device": "cpu", "pin_memory": on_gpu}
        return lomo_ds.initialize(llama(sizes), {**ds, "zero_optimization": zero,
                                                 "lomo": {"lr": 1e-3, "host_update": host_update or "auto"}})

    engines = {"no_offload": engine(None), "offload_thread": engine("thread"), "offload_inline": engine("inline")}
    rank = torch.distributed.get_rank()
    batches = [random_batch(sizes, device, seed=1000 * step + rank) for step in range(sizes["warmup"] + sizes["steps"])]
    times = {name: [] for name in engines}
    for step, batch in enumerate(batches):
        for name, e in engines.items():
            sync(device)
            t0 = time.perf_counter()
            e.train_step(batch)
            sync(device)
            if step >= sizes["warmup"]:
                times[name].append(time.perf_counter() - t0)
    medians = {name: statistics.median(t) for name, t in times.items()}
    threaded = engines["offload_thread"].host_updates
    return {"times": times, "median_s": medians, "model": sizes, "world": torch.distributed.get_world_size(),
            "applied": threaded.applied if threaded is not None else 0,
            "saved_s": medians["offload_inline"] - medians["offload_thread"],
            "x_no_offload": {name: m / medians["no_offload"] for name, m in medians.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: proves the new checks run")
    ap.add_argument("--only", default=None, help="comma-separated check names")
    args = ap.parse_args()

    on_gpu = torch.cuda.is_available() and not args.smoke
    if on_gpu:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    lomo_ds.init_distributed()
    world = torch.distributed.get_world_size()
    workdir = os.path.dirname(os.path.abspath(args.out)) or tempfile.gettempdir()
    checks = {
        "sgd": lambda: equivalence(lambda: tiny_llama(0), ds_cfg()),
        "clip_norm": lambda: equivalence(lambda: tiny_llama(1), ds_cfg(clip_grad_norm=0.5), {"clip_norm": 0.5}),
        "bf16": check_bf16,
        "overflow": lambda: check_overflow(fp16=True),
        "offload": lambda: check_offload(pin=on_gpu),
        "memory": lambda: check_memory(device, workdir),
        "step_time": lambda: check_step_time(device, STEP_MODEL["gpu" if on_gpu else "smoke"]),
        # Gradient accumulation on the GPU: the accumulator beside the shards, and in pinned host
        # memory (lomo.accumulate_on cpu: slices copied over without blocking, the sum copied back),
        # fused into the K-th backward and as one pass after it (norm clipping).
        "accumulation": lambda: A.equivalence(lambda: tiny_llama(0), A.acc_cfg()),
        "accumulation_host": lambda: A.equivalence(lambda: tiny_llama(0), A.acc_cfg(accumulate_on="cpu")),
        "accumulation_host_clip_norm": lambda: A.equivalence(
            lambda: tiny_llama(1), A.acc_cfg(accumulate_on="cpu", clip_grad_norm=0.5), clip_norm=0.5),
    }
    if not on_gpu:  # DeepSpeed refuses fp16 on a CPU, and only CUDA reports allocator peaks
        checks.pop("overflow"), checks.pop("memory")
    if world < 2 and not args.smoke:
        checks.pop("step_time")  # side by side on 2+ GPUs: one GPU has no reduction to overlap
    run_checks(checks, args.out, only=args.only)


if __name__ == "__main__":
    main()
