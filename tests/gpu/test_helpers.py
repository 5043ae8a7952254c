"""The GPU suite's device-independent parts, on this CPU: the planner comparison arithmetic, the
summary, the imports test_gpu.py makes, every check's arguments bound and its config validated
without running it, and the checks only the GPU suite has run tiny (gloo) so their code is known
to run before a GPU ever sees it (the others are the CPU suite's own checks)."""
from __future__ import annotations

import functools
import inspect
import json

import pytest
import torch

from lomo_ds.config.lomo import load_config
from lomo_ds.planning.planner import RunSpec, estimate, run_spec, spec_from_hf_config
from tests import dist_engine_checks
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


def forced(check):
    """`check` run as the GPU launch runs it: the bucket path forced on every engine it builds."""
    def run():
        with gpu_checks.bucket_path_forced():
            return check()
    return run


# The checks only the GPU suite has, tiny, on the CPU ranks of the 2-rank launch (one torch thread
# each: a 1-rank launch's two threads fight over a loaded machine's cores on ops this small), forced
# onto the bucket path as the GPU launch is: they prove the code runs end to end, not how fast it is.
# One rank's one-rank reduce-scatter is the CPU suite's own (tests/engine/test_buckets.py).
(gpu_step_time, gpu_offload, gpu_bucket_path, gpu_evaluation, gpu_generation, gpu_offload_two_devices,
 gpu_offload_overlap, gpu_delayed_window_tail) = multi_rank_checks(
    [2], gpu_step_time=lambda: gpu_checks.check_step_time(torch.device("cpu"), gpu_checks.STEP_MODEL["smoke"]),
    gpu_offload=lambda: gpu_checks.check_offload(pin=False),
    gpu_bucket_path=forced(gpu_checks.check_bucket_path), gpu_evaluation=forced(gpu_checks.check_evaluation),
    # 3 prompts (one generate call per rank) instead of the GPU's 7: the same code, a CPU's share.
    gpu_generation=forced(functools.partial(gpu_checks.check_generation, lengths=(4, 9, 6))),
    gpu_offload_two_devices=forced(gpu_checks.check_offload_two_devices),
    gpu_offload_overlap=lambda: gpu_checks.check_offload_overlap(torch.device("cpu"), gpu_checks.STEP_MODEL["smoke"]),
    gpu_delayed_window_tail=forced(functools.partial(gpu_checks.check_delayed_window_tail, torch.device("cpu"),
                                                     gpu_checks.DELAYED_MODEL["smoke"])))


def bind_everything(fn) -> list[dict]:
    """Bind a check (a partial, its arguments partials too) to its function's signature, raising on
    a wrong argument; returns the configs (dicts with a "lomo" section) it was given."""
    configs = []
    if isinstance(fn, functools.partial):
        inspect.signature(fn.func).bind(*fn.args, **fn.keywords)
        for arg in (*fn.args, *fn.keywords.values()):
            configs += bind_everything(arg)
    elif isinstance(fn, dict) and "lomo" in fn:
        configs.append(fn)
    return configs


@pytest.mark.parametrize("on_gpu, world", [(True, 1), (True, 2), (False, 1)])
def test_every_gpu_check_binds_and_its_configs_load(on_gpu, world, tmp_path):
    """The GPU launch's checks, as built for it, without running them: each one's arguments fit its
    function and every config lomo_ds would refuse is found here, not on a GPU. Every engine the
    launch builds from ds_cfg names the reduce-scatter transport (the bucket path on one GPU)."""
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    with gpu_checks.bucket_path_forced():
        checks = gpu_checks.gpu_checks(device, on_gpu, world, str(tmp_path))
        assert dist_engine_checks.ds_cfg()["lomo"]["grad_reduction"] == "reduce_scatter"
    assert dist_engine_checks.LOMO_DEFAULTS == {}, "the forcing must end with its block"
    new = {"bucket_path", "sgd_direct", "clip_norm_recompute", "reduce_dtype_bf16", "adalomo", "adalomo_clip_norm",
           "adalomo_offload", "lora_lomo",
           "fetch_per_layer", "experts", "evaluation", "generation", "offload_two_devices",
           "offload_overlap", "adalomo_offload_overlap", "delayed_window_tail", "host_memory"}
    assert new <= set(checks)
    assert ("overflow" in checks) == ("memory" in checks) == ("host_syncs" in checks) == on_gpu
    assert ("step_time" in checks) == ("reduction_overflow" in checks) == (world > 1)
    configs = []
    for name, check in checks.items():
        assert isinstance(check, functools.partial), name
        configs += bind_everything(check)
    for cfg in configs:
        load_config(cfg)
    direct = checks["sgd_direct"].args[1]
    assert direct["lomo"]["grad_reduction"] == "auto"
    assert all(cfg["lomo"]["grad_reduction"] == "reduce_scatter" for cfg in configs if cfg is not direct)


def test_test_gpu_imports_exist():
    # test_gpu.py is skipped at module level here, before its imports: they are checked here instead.
    from tests.dist_engine_checks import (  # noqa: F401
        assert_bf16_rounding,
        assert_overflow_recovers,
        assert_reduction_overflow_skips,
    )
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
                   "offload": {"error": "Traceback ...\nRuntimeError: boom\n"},
                   "fetch_per_layer": {"lora": {"loss_before": 2.5, "loss_after": 2.25}}},
               2: {"step_time": {"table": step_time_table({"floor": [1.0], "lomo": [1.04], "deepspeed_sgd": [1.2]})}}}
    text = format_summary(results)
    assert "[1 GPU(s)] sgd: max |LOMO - torch.optim.SGD| = 3.00e-07" in text
    assert "stochastic 1.010, nearest 0.400" in text
    assert "skipped per step False True False, scale 256 -> 128 -> 128" in text
    assert "1.000 GiB measured, 1.050 GiB predicted (+5.0%)" in text
    assert "offload: ERROR RuntimeError: boom" in text
    assert "loss before -> after one step: lora 2.5000 -> 2.2500" in text
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


def test_gpu_launchs_own_checks_run_tiny_on_cpu_ranks(rank_results):
    """The GPU launch's own checks on 2 gloo ranks, forced onto the bucket path as there: a
    reduce-scatter per bucket, evaluation and generation on the engine after a step equal to the
    unpartitioned model's, offload with persistent parameters, the host-update thread timed (what
    test_gpu.py asserts; on a CPU no side stream, no events, one device)."""
    r = ok(rank_results(2), gpu_bucket_path)
    assert (r["backend"], r["world"], r["transport"], r["device_per_rank"]) == ("gloo", 2, "reduce_scatter", [0, 0])
    assert r["buckets"] > 1 and r["reduce_scatters"] == r["buckets"] and not r["skipped"]
    assert not r["side_stream"] and not r["timers_on_accelerator"] and r["spans"]["pack"] > 0
    ev = ok(rank_results(2), gpu_evaluation)
    got, want = ev["engine"], ev["reference"]  # forward_calls differ: the engine's are per rank
    assert got["accuracy"]["n"] == want["accuracy"]["n"] == 11
    assert got["accuracy"]["accuracy"] == want["accuracy"]["accuracy"]
    assert ev["engine"]["loss"]["loss"] == pytest.approx(ev["reference"]["loss"]["loss"], rel=1e-6)
    gen = ok(rank_results(2), gpu_generation)
    assert gen["replies"] == gen["reference"] and gen["lengths"][0] == 2 and len(set(gen["lengths"])) > 1
    two = ok(rank_results(2), gpu_offload_two_devices)  # one device here: the code runs, SGD's and AdaLomo's
    assert two["shard_devices"] == two["bf16_moved_on"] == ["cpu"]
    assert two["sgd"]["max_abs_diff"] <= 1e-6 and two["adalomo"]["max_abs_diff"] <= 1e-6
    overlap = ok(rank_results(2), gpu_offload_overlap)  # the host-update thread ("thread" on a CPU too)
    assert overlap["applied"] > 0 and all(len(t) == 2 for t in overlap["times"].values())
    text = format_summary({2: {"bucket_path": r, "evaluation": ev, "generation": gen, "offload_two_devices": two,
                               "offload_overlap": overlap}})
    assert "gloo, reduce_scatter, side stream False" in text and "3 of 3 replies" in text
    assert "shards on ['cpu']" in text and "updates on it" in text


def test_delayed_window_tail_runs_tiny_on_cpu_ranks(rank_results):
    """The GPU suite's delayed-device accumulation check, tiny on 2 gloo ranks (no device to hold
    back here): the host accumulator's one-pass step with norm clipping equals SGD's."""
    r = ok(rank_results(2), gpu_delayed_window_tail)
    assert r["max_abs_diff"] <= 1e-6 and not r["fused"] and not r["delayed"]
    for got, want in r["norms"]:
        assert got == pytest.approx(want, rel=1e-5)


def test_every_gpu_test_is_collected_on_a_cpu():
    """The GPU suite's tests collect here, as on 2 GPUs (each skipped without CUDA): a test that
    would not even import or parametrize on a GPU machine shows on the CPU first."""
    import os
    import re
    import subprocess
    import sys

    from tests.ranks import ROOT

    path = os.path.join(ROOT, "tests", "gpu", "test_gpu.py")
    with open(path) as f:
        names = set(re.findall(r"^def (test_\w+)", f.read(), flags=re.M))
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", path],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "LOMO_GPU_COLLECT": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    collected = set(re.findall(r"::(test_\w+)", proc.stdout))
    assert collected == names, sorted(names - collected)
    assert "[2]" in proc.stdout, "parametrized as on 2 GPUs"
