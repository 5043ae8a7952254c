"""The shipped benchmark (experiments/bench_step.py) and the GPU suite's newer checks
(tests/gpu/gpu_checks.py: LOMO against the floor and DeepSpeed SGD, offload_param), run tiny on
the CPU ranks of the 2-rank launch of tests/dist_checks.py: they prove the code runs end to end, not
how fast it is (tests/test_buckets.py and tests/gpu/test_helpers.py assert on what they return)."""
from __future__ import annotations

import contextlib
import io

import torch

import bench_step
import gpu_checks

BENCH_ARGS = ["--layers", "1", "--hidden", "64", "--vocab", "128", "--seq", "16", "--micro", "1",
              "--bucket-size", "2000", "--steps", "2", "--warmup", "1"]


def bench_step_report() -> dict:
    """The benchmark's printed report on a 1-layer model (rank 0's; the other ranks print nothing)."""
    args = bench_step.parse_args(BENCH_ARGS)
    base, times, parts, transports = bench_step.bench(args)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        if torch.distributed.get_rank() == 0:
            bench_step.report(args, base, torch.distributed.get_world_size(), times, parts, transports)
    return {"stdout": out.getvalue()}


def smoke_checks(world: int) -> dict:
    cpu = torch.device("cpu")
    return {"bench_step": bench_step_report,
            "gpu_step_time": lambda: gpu_checks.check_step_time(cpu, gpu_checks.STEP_MODEL["smoke"]),
            "gpu_offload": lambda: gpu_checks.check_offload(pin=False)}
