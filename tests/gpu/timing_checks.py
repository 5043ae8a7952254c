"""The GPU suite's timed checks (tests/gpu/gpu_checks.py runs them, tests/gpu/test_helpers.py runs
them tiny on CPU ranks): step time against the floor and DeepSpeed's ZeRO-3 SGD, and the host-update
thread's overlap with the backward. Engines take turns step by step, so that drifts in clocks and
neighbours hit them alike; the bounds on the figures are tests/gpu/compare.py's."""
from __future__ import annotations

import statistics
import time

import torch

import lomo_ds
from devkit.floor import FloorEngine
from lomo_ds.methods.deepspeed_optim import DeepSpeedOptimizerEngine
from tests.gpu.compare import step_time_table
from tests.gpu.models import llama, random_batch, sync


def steps_in_turns(engines: dict, device: torch.device, sizes: dict, after=None) -> dict:
    """Every engine steps on the same batches, taking turns step by step, each step timed between
    device syncs; the warm-up steps untimed. `after(name, engine, timed)`: called after each step."""
    rank = torch.distributed.get_rank()
    batches = [random_batch(sizes, device, seed=1000 * step + rank) for step in range(sizes["warmup"] + sizes["steps"])]
    times = {name: [] for name in engines}
    for step, batch in enumerate(batches):
        for name, engine in engines.items():
            sync(device)
            t0 = time.perf_counter()
            engine.train_step(batch)
            sync(device)
            timed = step >= sizes["warmup"]
            if timed:
                times[name].append(time.perf_counter() - t0)
            if after is not None:
                after(name, engine, timed)
    return times


def check_step_time(device: torch.device, sizes: dict):
    """LOMO, the floor and DeepSpeed ZeRO-3 SGD on the same model and batches; per-step times, and medians."""
    ds = {"train_micro_batch_size_per_gpu": sizes["micro"], "zero_optimization": {"stage": 3}}
    if device.type == "cuda":
        ds["bf16"] = {"enabled": True}
    engines = {"floor": FloorEngine(llama(sizes), ds),
               "lomo": lomo_ds.initialize(llama(sizes), {**ds, "lomo": {"lr": 1e-3}}),
               "deepspeed_sgd": DeepSpeedOptimizerEngine(llama(sizes), ds, "sgd", "sgd", lr=1e-3, clip=None,
                                                          total_steps=0, warmup_steps=0)}
    times = steps_in_turns(engines, device, sizes)
    return {"times": times, "table": step_time_table(times), "model": sizes,
            "world": torch.distributed.get_world_size()}


def time_worker(host_updates) -> list[float]:
    """Seconds each update the host-update worker applies takes, on its own thread (appended as they
    run): its busy time, which the backward is to hide. The update's own arithmetic only, not its
    waits for the staging copies."""
    spans: list[float] = []
    submit = host_updates.submit

    def timed_submit(items, finite, apply):
        def timed_apply(param, g, flag):
            t0 = time.perf_counter()
            try:
                return apply(param, g, flag)
            finally:
                spans.append(time.perf_counter() - t0)

        return submit(items, finite, timed_apply)

    host_updates.submit = timed_submit
    return spans


def check_offload_overlap(device: torch.device, sizes: dict, optimizer: str = "sgd"):
    """offload_param: cpu with the shards' updates on the host-update thread (slices staged in pinned
    memory, the CPU update overlapped with the backward) against the same updates inside the hook
    (memory.host_update inline: the serialised path), against no offload, and the floor's forward and
    backward gathering from host memory (no update), taking turns step by step.

    Figures: per-step times and medians; the updates the worker applied (0 on the serialised path,
    which tests/engine/dist_engine_checks.host_updates_applied refuses); the worker's busy time a step
    ("worker_busy_s": its updates' arithmetic, timed on its thread); the floor's backward
    ("floor_backward_s": the most the backward can hide); and what the thread saves over inline
    ("saved_s"), which compare.assert_offload_overlapped holds against the least of the two.
    `optimizer` "adalomo": the worker gets AdaLomo's host part (its statistics and collectives stay
    in the hook, on the GPU)."""
    on_gpu = device.type == "cuda"
    ds = {"train_micro_batch_size_per_gpu": sizes["micro"], "zero_optimization": {"stage": 3}}
    if on_gpu:
        ds["bf16"] = {"enabled": True}
    offloaded = {**ds, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": on_gpu}}}

    def engine(host_update):
        return lomo_ds.initialize(llama(sizes), {**(offloaded if host_update else ds),
                                                 "lomo": {"lr": 1e-3, "optimizer": optimizer},
                                                 "memory": {"host_update": host_update or "auto"}})

    engines = {"no_offload": engine(None), "offload_thread": engine("thread"), "offload_inline": engine("inline"),
               "floor_offload": FloorEngine(llama(sizes), offloaded)}
    threaded = engines["offload_thread"].host_updates
    busy = time_worker(threaded) if threaded is not None else []
    per_step, backward = [], []

    def after(name, eng, timed):
        # The worker is joined at the end of each backward: what it did since is this step's.
        if name == "offload_thread":
            if timed:
                per_step.append(sum(busy))
            busy.clear()
        elif name == "floor_offload" and timed:
            backward.append(eng.last_step_seconds()["backward"])

    times = steps_in_turns(engines, device, sizes, after=after)
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {"times": times, "median_s": medians, "model": sizes, "world": torch.distributed.get_world_size(),
            "applied": threaded.applied if threaded is not None else 0,
            "saved_s": medians["offload_inline"] - medians["offload_thread"],
            "worker_busy_s": statistics.median(per_step) if per_step else 0.0,
            "floor_backward_s": statistics.median(backward) if backward else 0.0,
            "x_no_offload": {name: m / medians["no_offload"] for name, m in medians.items() if name != "floor_offload"}}
