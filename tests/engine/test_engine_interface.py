"""The engine's public interface and the parts its step is handed (lomo_ds/engine/lomo_engine.py,
loss_weights.py, window_close.py).

Code outside lomo_ds/engine/ uses a LomoEngine through the names its class docstring lists: a reach
into its updater, accumulator, buckets or ZeRO-3's offload object would tie that code to how the
engine is built inside. The step's parts are checked here on the numbers the oracles depend on
(the seed weight a power of two, the divisors, the clipping coefficient as torch's).
"""
from __future__ import annotations

import ast
import math
import pathlib

import pytest
import torch

from lomo_ds.engine.loss_weights import LossWeights
from lomo_ds.engine.window_close import StepCounters, clipped

ROOT = pathlib.Path(__file__).resolve().parents[2]
# What a LomoEngine keeps to itself (set in its constructor): nothing outside lomo_ds/engine/ names them.
INTERNALS = {"updater", "accumulator", "offload", "buckets", "host_updates", "staging", "slice_route", "closer",
             "steps", "loss_weights", "batch_loss", "step_sums", "window", "loss_scaler", "param_gather"}
# The names LOMO's engine goes by in the code that holds one.
HOLDERS = {"engine", "lomo_engine"}


def _reaches(text: str, label: str) -> list[str]:
    """Each `engine.X` or `....lomo_engine.X` in `text` with X one of INTERNALS or private."""
    found = []
    for node in ast.walk(ast.parse(text, filename=label)):
        if not isinstance(node, ast.Attribute):
            continue
        holder = node.value
        name = holder.id if isinstance(holder, ast.Name) else holder.attr if isinstance(holder, ast.Attribute) else None
        if name in HOLDERS and (node.attr in INTERNALS or node.attr.startswith("_")):
            found.append(f"{label}:{node.lineno}: {name}.{node.attr}")
    return found


def test_no_code_outside_the_engine_reaches_past_its_interface():
    package = ROOT / "lomo_ds"
    outside = [p for p in package.rglob("*.py") if (package / "engine") not in p.parents]
    assert outside, "no module of lomo_ds found outside lomo_ds/engine/"
    found = [hit for p in sorted(outside) for hit in _reaches(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, "reaches past LomoEngine's public interface (its class docstring lists it):\n" + "\n".join(found)


def test_the_reach_check_sees_a_reach():
    """The scan above must be able to fail: a reach of each kind it looks for is found."""
    code = ("def f(engine, self):\n"
            "    engine.updater.geometry(p)\n"
            "    self.lomo_engine._backward(x)\n"
            "    engine.params, self.engine.geometry(p)\n")
    assert sorted(_reaches(code, "x.py")) == ["x.py:2: engine.updater", "x.py:3: lomo_engine._backward"]


@pytest.mark.parametrize("tokens, world, expected", [(0, 2, 1.0), (1, 1, 1.0), (96, 2, 2.0**-5), (100, 3, 2.0**-5),
                                                     (2.0**20, 1, 2.0**-20)])
def test_token_weight_is_a_power_of_two_near_one_over_the_tokens_per_rank(tokens, world, expected):
    weights = LossWeights("tokens", dp_size=world, sp_size=1, world=world, step_sums=None)
    assert weights.token_weight(tokens) == expected
    assert LossWeights("mean", world, 1, world, None).token_weight(tokens) == 1.0


def test_normalizer_divides_by_replicas_or_tokens():
    # Under SP the "mean" divisor is the data-parallel replicas, not the ranks.
    assert LossWeights("mean", dp_size=2, sp_size=2, world=4, step_sums=None).normalizer(3, 1234.0) == 6
    assert LossWeights("tokens", dp_size=2, sp_size=2, world=4, step_sums=None).normalizer(3, 1234.0) == 1234.0


def test_backward_loss_weighs_the_token_sum_and_zeroes_an_unlabelled_rank():
    loss = torch.tensor(2.5, device="cpu", requires_grad=True)
    by_tokens = LossWeights("tokens", 1, 1, 1, None)
    assert float(by_tokens.backward_loss(loss, True, 8, 4.0, per_token=0.125).detach()) == 2.5 * 8 * 0.125 * 4.0
    assert float(LossWeights("mean", 1, 1, 1, None).backward_loss(loss, True, 8, 4.0).detach()) == 2.5 * 4.0
    # An unlabelled rank still runs its backward (ZeRO-3's collectives) and adds a zero gradient.
    zero = by_tokens.backward_loss(loss, False, 0, 4.0)
    zero.backward()
    assert float(zero) == 0.0 and float(loss.grad) == 0.0


def test_clipped_matches_torch_clip_grad_norm():
    grads = [torch.full((3,), 2.0, device="cpu"), torch.full((4,), -1.0, device="cpu")]
    params = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    total = float(sum(g.pow(2).sum() for g in grads))
    norm, coefficient = clipped(total, 0.5)
    torch_norm = float(torch.nn.utils.clip_grad_norm_(params, 0.5))
    assert norm == pytest.approx(torch_norm, rel=1e-6)
    assert torch.allclose(params[0].grad, grads[0] * coefficient, rtol=1e-6)
    assert clipped(total, None) == (math.sqrt(total), 1.0)
    assert clipped(math.inf, 0.5) == (math.inf, 1.0) and clipped(math.nan, 0.5)[0] == math.inf


def test_step_counters_round_trip_and_read_an_older_state():
    counters = StepCounters(global_step=7, skipped_steps=2, consecutive_skips=1)
    again = StepCounters()
    again.load_state_dict(counters.state_dict())
    assert again == counters
    older = StepCounters()
    older.load_state_dict({"global_step": 3, "skipped_steps": 0})  # written before consecutive_skips was kept
    assert older == StepCounters(3, 0, 0)
