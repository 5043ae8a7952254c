"""The 8-bit step benchmark's plumbing, without launching ranks (its run takes most of a minute): the
planner's terms it prints beside the measured figures, its timers' nesting, and its report on
hand-made figures."""
from __future__ import annotations

import time

import pytest

from benchmarks import int8_step


def test_planned_terms_are_the_planners_for_the_same_config():
    a = int8_step.parse_args(["--quick"])
    plan = int8_step.planned(a, 2)
    bf16, int8 = plan["bf16"], plan["int8"]
    # bf16's shards: 2 bytes a padded ZeRO-3 slice element of every non-persistent parameter
    h, kv, hd = int8_step.heads(a)
    assert (h, kv, hd) == (2, 1, 64)
    assert bf16["int8"] == bf16["scales"] == 0 and int8["bf16"] == 0
    # int8: a byte an element in whole blocks and an fp32 scale a block: about 0.52 of bf16's at B = 128
    assert (int8["int8"] + int8["scales"]) / bf16["bf16"] == pytest.approx(0.5 + 2 / a.block, abs=0.01)
    assert int8["est"].int8[int8_step.IN_FLIGHT] > 0 and int8["est"].int8[int8_step.DEQUANTIZE] > 0
    assert not bf16["est"].int8
    # the step's planned peak is the total less the shards held between steps (the persistent
    # parameters' alike in both runs)
    assert 0 < bf16["step"] < bf16["est"].total and 0 < int8["step"] < int8["est"].total
    held = {name: p["est"].total - p["step"] for name, p in plan.items()}
    assert held["int8"] - held["bf16"] == int8["int8"] + int8["scales"] - bf16["bf16"]


def test_spans_take_a_nested_calls_time_out_of_the_outer_one():
    class Owner:
        def outer(self):
            time.sleep(0.02)
            return self.inner() + 1

        def inner(self):
            time.sleep(0.05)
            return 1

    spans = int8_step.Spans()
    spans.wrap(Owner, "outer", "a")
    spans.wrap(Owner, "inner", "b")
    assert Owner().outer() == 2
    taken = spans.take()
    # counted inclusively, a would be at least 0.07 s
    assert 0.02 <= taken["a"] < 0.065 and 0.05 <= taken["b"], taken
    assert spans.take() == {} and spans.inner == []


def _memory(int8: bool) -> dict:
    held = {"int8": 1000 if int8 else 0, "scales": 40 if int8 else 0, "bf16": 0 if int8 else 2000, "persistent": 10}
    comm = {"all_gather_into_tensor": {"bytes": 1100 if int8 else 2000, "calls": 4}}
    return {"held": held, "breakdown": {"params": 3000, "activations": 500, "total": 4000},
            "persistent_whole": 5, "step_peak": 6000, "comm": comm}


def test_the_report_puts_measured_beside_planned():
    a = int8_step.parse_args(["--quick"])
    rank = {"memory": {"bf16": _memory(False), "int8": _memory(True)},
            "times": {"bf16": [1.0, 1.0], "int8": [1.2, 1.1]},
            "parts": {"bf16": [{"update: write": 0.5}] * 2,
                      "int8": [{"update: write": 0.4, "gather: dequantize": 0.1}] * 2},
            "rescaled": {"bf16": [0, 0], "int8": [3, 5]}}
    out = "\n".join(int8_step.report_memory(a, 2, [rank, rank]) + int8_step.report_speed([rank, rank]))
    assert "int8 shards + scales / bf16 shards: 0.5200" in out
    assert "the parameter gather, int8 / bf16: 0.5500" in out
    assert "int8 step / bf16 step: 1.150" in out
    assert "4.0 of its 10 scales" in out
    speed = {line.split()[1]: line.split()[2:] for line in out.splitlines() if line.startswith("  update: write")}
    assert speed == {"write": ["500.0", "50.0", "400.0", "34.8"]}
