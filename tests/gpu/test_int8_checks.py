"""The GPU suite's 8-bit weight shard checks (tests/gpu/int8_checks.py) on this CPU: they are in the
GPU launch, their arguments bind and their configs load; the memory check's planner arithmetic on
the memory model leaves it something to save on 1 and 2 GPUs; the device reference is the CPU
reference's arithmetic; every bound test_gpu.py holds them to passes good figures and refuses a
figure of each way it can fail; and (long) the checks run tiny on 2 gloo ranks."""
from __future__ import annotations

import copy
import functools
import inspect

import pytest
import torch

from lomo_ds.config.engine_config import load_config
from lomo_ds.config.run import load_run_config
from tests.engine import dist_engine_checks
from tests.engine import int8_checks as c
from tests.gpu import gpu_checks
from tests.gpu import int8_checks as Q
from tests.gpu.compare import format_summary
from tests.ranks import LONG_TESTS, multi_rank_checks, ok

INT8 = {"int8_update", "int8_gather", "int8_gather_b128", "int8_race"}


def _forced(check):
    def run():
        with gpu_checks.bucket_path_forced():
            return check()
    return run


# The checks tiny, on the CPU ranks of the 2-rank launch (a long check, as test_helpers.py's): the
# same code as on the GPUs, no stream to hold back and no allocator peak here.
LAUNCH = [2] if LONG_TESTS else []
gpu_int8_update, gpu_int8_gather, gpu_int8_race = multi_rank_checks(
    LAUNCH, gpu_int8_update=functools.partial(Q.check_int8_update, torch.device("cpu"), steps=2),
    gpu_int8_gather=_forced(lambda: Q.check_int8_gather(Q.int8_cfg(block=8), torch.device("cpu"))),
    gpu_int8_race=_forced(functools.partial(Q.check_int8_race, torch.device("cpu"), 0, steps=2)))


def _bound(fn) -> list[dict]:
    """fn's arguments bound to its function's signature (raising on a wrong one), and the configs
    (dicts with a "lomo" section) among them."""
    inspect.signature(fn.func).bind(*fn.args, **fn.keywords)
    return [a for a in (*fn.args, *fn.keywords.values()) if isinstance(a, dict) and "lomo" in a]


@pytest.mark.parametrize("on_gpu, world", [(True, 1), (True, 2), (False, 1)])
def test_int8_checks_are_in_the_gpu_launch_and_their_configs_load(on_gpu, world, tmp_path):
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    with gpu_checks.bucket_path_forced():
        checks = gpu_checks.gpu_checks(device, on_gpu, world, str(tmp_path))
    assert INT8 <= set(checks) and ("int8_memory" in checks) == on_gpu
    configs = []
    for name in [n for n in checks if n.startswith("int8_")]:
        assert isinstance(checks[name], functools.partial), name
        configs += _bound(checks[name])
    assert len(configs) == 2  # the two gathers'
    for cfg in configs + [Q.int8_cfg(block=16, bf16=False, fetch={"stage3_prefetch_bucket_size": 1_000_000})]:
        assert cfg["memory"]["int8_shards"] is True
        load_config(cfg)
    assert all(cfg["comm"]["grad_reduction"] == "reduce_scatter" for cfg in configs)
    assert dist_engine_checks.LOMO_DEFAULTS == {}


@pytest.fixture(scope="module")
def memory_model(tmp_path_factory):
    sizes = gpu_checks.MEMORY_MODEL["gpu"]
    path = tmp_path_factory.mktemp("int8_memory_model")
    gpu_checks.llama_config(sizes).save_pretrained(path)
    return str(path), sizes


@pytest.mark.parametrize("world", [1, 2])
def test_int8_memory_check_has_something_to_save_and_its_bound_bites(memory_model, world):
    """The memory model's runs load; the planner's 8-bit peak is under bf16's, and what the check
    requires is at least a third of the shard bytes saved (hundreds of MiB): an 8-bit run that saves
    nothing, or one the planner is 20% off, is refused; the planner's own figures pass."""
    path, sizes = memory_model
    runs = Q.int8_memory_runs(path, sizes)
    for run in runs.values():
        load_run_config(run, check_files=False)
    assert runs["int8"]["memory"] == {"int8_shards": True, "int8_block": Q.MEMORY_BLOCK}
    p = Q.planned_saving(runs, path, world)
    assert p["predicted_int8"] < p["predicted_bf16"], p
    assert p["shards_saved"] > 100 * 2**20 and p["required"] >= p["shards_saved"] / 3, p
    good = {**p, "measured_int8": p["predicted_int8"], "measured_bf16": p["predicted_bf16"], "world": world}
    Q.assert_int8_memory(good)
    with pytest.raises(AssertionError, match="saved"):
        Q.assert_int8_memory({**good, "measured_bf16": good["measured_int8"]})  # nothing saved
    with pytest.raises(AssertionError, match="planner"):
        Q.assert_int8_memory({**good, "measured_int8": p["predicted_int8"] / 1.2,
                              "measured_bf16": p["predicted_bf16"] / 1.2})
    assert "int8_memory: peak" in format_summary({world: {"int8_memory": good}})


def test_device_reference_is_the_cpu_references_arithmetic():
    """On a CPU the device reference (fed the CPU reference's gradients) is the CPU reference, bit
    for bit, with the scales it recomputes: on a GPU only the device's arithmetic separates them."""
    ref = c.Reference("sgd")
    dev = Q.DeviceReference(ref, torch.device("cpu"))
    for step in (1, 2):
        grads = ref.gradients(step)
        ref.step(step)
        dev.step(grads, step)
        q, s = dev.on_host()
        assert all(torch.equal(q[n], ref.q[n]) and torch.equal(s[n], ref.s[n]) for n in ref.names)
    assert dev.rescaled == ref.rescaled > 0


def _update_figures() -> dict:
    step = {"cpu": {"ints": 2, "scales": 1, "scale_rel": 1.2e-7, "elements": 37480},
            "device": {"ints": 0, "scales": 0, "scale_rel": 0.0, "elements": 37480}, "cut_scales_disagree": 0}
    return {"steps": [copy.deepcopy(step) for _ in range(3)], "noise_mismatches": 0, "noise_elements": 122979,
            "rescaled": 3030, "reference_rescaled": 3030, "device_rescaled": 3030, "cut_blocks": 13,
            "moved_ints": 15767, "control_ints": 7001}


def _with(r: dict, path: tuple, value) -> dict:
    out = copy.deepcopy(r)
    target = out
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return out


@pytest.mark.parametrize("path, value", [
    (("noise_mismatches",), 1),  # the device's hash not the CPU's
    (("steps", 1, "device", "ints"), 1),  # one integer off the reference's arithmetic on the device
    (("steps", 2, "device", "scales"), 1),
    (("steps", 0, "cut_scales_disagree"), 1),  # a cut block's pieces scaled apart
    (("steps", 1, "cpu", "ints"), 38),  # more than 1e-3 of the integers off the CPU reference
    (("steps", 0, "cpu", "scale_rel"), 1e-5),
    (("device_rescaled",), 3029),  # the engine's count of rescaled blocks not the reference's
    (("moved_ints",), 0), (("cut_blocks",), 0), (("control_ints",), 0)])
def test_int8_update_bound_refuses_each_failure(path, value):
    good = _update_figures()
    Q.assert_int8_update(good, 2)
    with pytest.raises(AssertionError):
        Q.assert_int8_update(_with(good, path, value), 2)
    assert "3030 blocks rescaled" in format_summary({2: {"int8_update": good}})


def test_int8_gather_and_race_bounds_refuse_each_failure():
    gather = {"kinds": {"lm_head.weight": "int8", "model.norm.weight": "torch.bfloat16"}, "fetched_bad": [],
              "gathered_bad": [], "on_device_bad": [], "doubled_scale_seen": True}
    Q.assert_int8_gather(gather)
    for key, value in (("fetched_bad", ["lm_head.weight"]), ("gathered_bad", ["lm_head.weight"]),
                       ("on_device_bad", ["lm_head.weight"]), ("doubled_scale_seen", False),
                       ("kinds", {"lm_head.weight": "torch.bfloat16"})):
        with pytest.raises(AssertionError):
            Q.assert_int8_gather({**gather, key: value})
    same = {"ints": 0, "scales": 0, "losses_equal": True, "params": 16}
    race = {"delayed": True, "losses": [4.6], "runs": {"repeat": {**same, "held": 0},
                                                       **{w: {**same, "held": 60} for w in Q.DELAYS},
                                                       "unordered_writes": {**same, "ints": 40, "held": 48}}}
    Q.assert_int8_race(race)
    for where, change in (("repeat", {"losses_equal": False}), ("update", {"ints": 3}),
                          ("gather_dequantize", {"scales": 1}), ("gather_send", {"held": 0}),
                          ("unordered_writes", {"ints": 0}), ("update", {"params": 0})):
        with pytest.raises(AssertionError):
            Q.assert_int8_race(_with(race, ("runs", where), {**race["runs"][where], **change}))
    Q.assert_int8_race({**race, "delayed": False, "runs": {**race["runs"], "unordered_writes": same | {"held": 0}}})
    assert "unordered_writes: 40 integers" in format_summary({1: {"int8_race": race, "int8_gather": gather}})


@pytest.mark.long
def test_int8_checks_run_tiny_on_cpu_ranks(rank_results):
    """The three checks that run anywhere, on 2 gloo ranks: the bounds hold (on a CPU the device
    reference and the CPU reference are one, and no stream is held back)."""
    update = ok(rank_results(2), gpu_int8_update)
    Q.assert_int8_update(update, 2)
    assert all(s["cpu"] == s["device"] for s in update["steps"])
    Q.assert_int8_gather(ok(rank_results(2), gpu_int8_gather))
    race = ok(rank_results(2), gpu_int8_race)
    assert not race["delayed"]
    Q.assert_int8_race(race)
