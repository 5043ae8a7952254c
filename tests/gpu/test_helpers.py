"""The GPU suite's device-independent parts, on this CPU: the planner comparison arithmetic, the
summary, the imports test_gpu.py makes, and the new checks run tiny (gloo) so their code is known
to run before a GPU ever sees it."""
from __future__ import annotations

import json

import pytest
import torch

from lomo_ds.planning.planner import RunSpec, estimate, run_spec, spec_from_hf_config
from tests.gpu import gpu_checks
from tests.gpu.compare import (
    MEMORY_TOLERANCE,
    format_summary,
    memory_run_config,
    predicted_peak_bytes,
    relative_gap,
    step_time_table,
    summarize_dir,
    within_tolerance,
)
from tests.ranks import multi_rank_checks, ok

# The GPU suite's newer checks (LOMO against the floor and DeepSpeed SGD; offload_param), tiny, on the
# CPU ranks of the 2-rank launch: they prove the code runs end to end, not how fast it is.
gpu_step_time, gpu_offload = multi_rank_checks(
    [2], gpu_step_time=lambda: gpu_checks.check_step_time(torch.device("cpu"), gpu_checks.STEP_MODEL["smoke"]),
    gpu_offload=lambda: gpu_checks.check_offload(pin=False))


def test_test_gpu_imports_exist():
    # test_gpu.py is skipped at module level here, before its imports: they are checked here instead.
    from tests.dist_engine_checks import assert_bf16_rounding, assert_overflow_recovers  # noqa: F401
    from tests.ranks import ROOT, launch, ok  # noqa: F401


def test_memory_prediction_is_the_planners_for_the_same_run(tmp_path):
    sizes = gpu_checks.MEMORY_MODEL["gpu"]
    gpu_checks.llama_config(sizes).save_pretrained(tmp_path)
    run = memory_run_config(str(tmp_path), sizes["micro"], sizes["seq"])
    with open(tmp_path / "config.json") as f:
        spec = spec_from_hf_config(json.load(f))
    # the run config's settings, DeepSpeed's defaults for the ZeRO keys it leaves out
    want = run_spec(seq=sizes["seq"], batch=sizes["micro"], dtype="bf16", checkpointing=True, persistence=100_000)
    for world in (1, 2, 8):
        est = estimate(spec, "lomo", world, want)
        assert predicted_peak_bytes(run, world) == est.total
    # On one GPU the model states and the update's temporaries are nearly all of it: a 10% check
    # bounds them, not activation noise.
    one = estimate(spec, "lomo", 1, want)
    assert (one.params + one.grads + one.update) / one.total > 0.9
    assert one.update > 0 and want != RunSpec()


def test_tolerance_arithmetic():
    assert MEMORY_TOLERANCE == 0.10
    assert relative_gap(100.0, 110.0) == pytest.approx(0.10)
    assert within_tolerance(100.0, 109.0) and within_tolerance(100.0, 91.0)
    assert not within_tolerance(100.0, 111.0) and not within_tolerance(100.0, 89.0)


def test_step_time_table():
    table = step_time_table({"floor": [1.0, 3.0, 2.0], "lomo": [2.1, 2.2, 2.3], "deepspeed_sgd": [2.5, 2.6, 2.4]})
    assert list(table) == ["floor", "lomo", "deepspeed_sgd"]
    assert table["lomo"] == {"median_s": 2.2, "x_floor": pytest.approx(1.1)}
    assert table["deepspeed_sgd"]["x_floor"] == pytest.approx(1.25)


def test_summary_names_every_check(tmp_path):
    results = {1: {"sgd": {"max_abs_diff": 3e-7, "loss": [1.0]},
                   "bf16": {m: {"realized": r}
                            for m, r in (("stochastic", 1.01), ("nearest", 0.4), ("fp32_master", 1.0))},
                   "overflow": {"steps": [{"skipped_all_ranks": [s], "scale_after": c} for s, c in
                                          ((False, 256.0), (True, 128.0), (False, 128.0))]},
                   "memory": {"measured": 1.0 * 2**30, "predicted": 1.05 * 2**30},
                   "offload": {"error": "Traceback ...\nRuntimeError: boom\n"}},
               2: {"step_time": {"table": step_time_table({"floor": [1.0], "lomo": [1.04], "deepspeed_sgd": [1.2]})}}}
    text = format_summary(results)
    assert "[1 GPU(s)] sgd: max |LOMO - torch.optim.SGD| = 3.00e-07" in text
    assert "stochastic 1.010, nearest 0.400" in text
    assert "skipped per step False True False, scale 256 -> 128 -> 128" in text
    assert "1.000 GiB measured, 1.050 GiB predicted (+5.0%)" in text
    assert "offload: ERROR RuntimeError: boom" in text
    assert "lomo 1040.0 ms (1.04x floor)" in text
    for world, r in results.items():
        (tmp_path / f"results_{world}.json").write_text(json.dumps(r))
    (tmp_path / "train_builtin.json").write_text(json.dumps({"losses": [2.0, 1.5], "peak_measured": 2**30,
                                                             "peak_predicted": 2**29}))
    assert summarize_dir(str(tmp_path)) == text + "\n[1 GPU] launch/train.py builtin, bf16 + clip_grad_norm, 2 " \
        "steps: loss 2.000 -> 1.500; peak 1.000 GiB (model loading included), planner 0.500 GiB"


def test_new_checks_run_tiny_on_cpu(rank_results):
    """The step-time comparison (LOMO, the floor, DeepSpeed SGD) and the offload check, tiny, on
    the 2 gloo ranks of the CPU suite's launch."""
    offload, step_time = ok(rank_results(2), gpu_offload), ok(rank_results(2), gpu_step_time)
    assert offload["max_abs_diff"] <= 1e-6 and offload["shard_device"] == "cpu"
    assert list(step_time["table"]) == ["floor", "lomo", "deepspeed_sgd"]
    assert all(len(t) == 2 and min(t) > 0 for t in step_time["times"].values())
