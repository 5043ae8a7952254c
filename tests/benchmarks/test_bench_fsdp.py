"""The FSDP2 benchmark that ships with the project (benchmarks/bench_fsdp.py) end to end on a tiny
model in the 2-rank launch: both engines do the same work (equal parameters after the same steps),
every collective is counted, the memory passes are timed, and the report prints. It proves the code
runs, not how fast it is."""
from __future__ import annotations

import contextlib
import io

import pytest
import torch

from tests.module_help import help_text
from tests.ranks import multi_rank, ok

ARGS = ["--layers", "2", "--hidden", "64", "--vocab", "128", "--seq", "16", "--micro", "2", "--steps", "2",
        "--warmup", "1", "--bucket-size", "2000"]


@multi_rank(worlds=[2])
def bench_fsdp_report() -> dict:
    from benchmarks import bench_fsdp

    out = {}
    for fetch in ("per-module", "per-layer"):
        args = bench_fsdp.parse_args([*ARGS, "--fetch", fetch])
        r = bench_fsdp.run(args)
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            if torch.distributed.get_rank() == 0:
                bench_fsdp.report(args, r)
        out[fetch] = {"stdout": text.getvalue(), "max_abs_diff": r["max_abs_diff"], "buckets": r["buckets"],
                      "leaf_modules": r["leaf_modules"], "passes": r["memory_passes"],
                      "calls": {name: m["calls"][-1] for name, m in r["measured"].items()},
                      "ops": {name: m["ops"] for name, m in r["measured"].items()}}
    return out


@pytest.mark.parametrize("fetch", ["per-module", "per-layer"])
def test_bench_fsdp_same_work_and_every_collective(rank_results, fetch):
    r = ok(rank_results(2), bench_fsdp_report)[fetch]
    assert r["max_abs_diff"] <= 1e-6, r  # lomo_ds and FSDP2 + SGD in the backward end equal
    assert r["leaf_modules"] == (["LlamaDecoderLayer"] if fetch == "per-layer" else [])
    calls, ops = r["calls"], r["ops"]
    # Every collective passes the counter: FSDP2's (torch.distributed), DeepSpeed's all-gathers,
    # lomo_ds's reduce-scatters through gloo ("lomo rs") and through shared memory ("lomo").
    assert ops["fsdp2 sgd"]["reduce_scatter"]["calls"] > 0 and ops["fsdp2 sgd"]["all_gather_into_tensor"]["calls"] > 0
    assert ops["lomo rs"]["reduce_scatter"]["calls"] == r["buckets"]
    assert ops["lomo"]["reduce_scatter"]["calls"] == r["buckets"]  # the shared-memory posts
    assert ops["lomo"]["reduce_scatter"]["bytes"] == ops["lomo rs"]["reduce_scatter"]["bytes"]
    assert ops["lomo rs"]["all_gather_into_tensor"]["calls"] > 0
    # The bound: no more collectives than FSDP2's plus one per bucket.
    assert calls["lomo rs"] <= calls["fsdp2 sgd"] + r["buckets"], calls
    # The memory passes are timed (CPU ranks).
    passes = r["passes"]
    assert passes["pack"] > 0 and passes["step"] > 0, passes
    for row in ("deepspeed floor", "fsdp2 floor", "fsdp2 sgd", "lomo rs", "max abs difference", "planner",
                "memory passes per step", "lomo / floor >="):
        assert row in r["stdout"], r["stdout"]


def test_bench_fsdp_help():
    out = help_text("benchmarks.bench_fsdp")
    assert "--fetch" in out and "torchtune" in out and "--lomo" in out, out


def test_bench_fsdp_lomo_options_reach_the_lomo_engines():
    from benchmarks.bench_fsdp import lomo_overrides, lomo_section, parse_args

    section = lomo_section(parse_args(["--lomo", "chunked_loss=off", "--lomo", "update_chunk_elements=64"]))
    assert section["chunked_loss"] == "off" and section["update_chunk_elements"] == 64
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        lomo_overrides(["chunked_loss"])
