"""Every method behind the one engine interface on 2 ranks: steps, memory breakdown, resume, and
LoRA+LOMO's adapter gradients. The multi-rank checks are declared here (tests/ranks.py); what they
build and measure is tests/methods/dist_methods_checks.py."""
from __future__ import annotations

import pytest
import torch

from lomo_ds.methods import METHODS
from tests.methods import dist_methods_checks as M
from tests.ranks import LONG_TESTS, multi_rank_checks, ok

(interface, lora_lomo_two_passes, fetch_per_layer, lora_writes_before_gathers) = multi_rank_checks(
    [2], interface=lambda: {m: M.interface_and_memory(m) for m in METHODS},
    lora_lomo_two_passes=M.lora_lomo_two_passes, fetch_per_layer=M.fetch_per_layer,
    lora_writes_before_gathers=M.lora_writes_before_gathers)
# Every method resumed, accumulated and stepped on the labelled logits: a minute of the 2-rank
# launch, long checks (CI: LOMO_DS_LONG_TESTS=1); LOMO's own are in every suite (tests/engine).
resume, accumulation, labelled_logits = multi_rank_checks(
    [2] if LONG_TESTS else [], resume=M.resume_every_method, accumulation=M.accumulation_every_method,
    labelled_logits=M.labelled_logits_every_method)


@pytest.fixture(scope="module")
def results(rank_results):
    return ok(rank_results(2), interface)


@pytest.mark.parametrize("method", METHODS)
def test_interface_and_steps(results, method):
    r = results[method]
    assert r["world"] == 2
    assert r["global_step"] == 2
    for s in r["steps"]:
        assert set(s) == {"loss", "lr", "grad_norm", "skipped", "loss_scale"}
        assert s["loss"] == s["loss"] and s["loss"] > 0


@pytest.mark.parametrize("method", ["adamw", "sgd", "lora", "lora_lomo", "lomo"])
def test_training_lowers_the_loss(results, method):
    r = results[method]
    assert r["loss_after"] < r["loss_before"], r
    assert not any(s["skipped"] for s in r["steps"])


def test_which_parameters_change(results):
    full = results["adamw"]["changed"]
    assert all(full.values())
    assert all(results["lomo"]["changed"].values())
    lora = results["lora"]["changed"]
    assert any("lora_B" in n and c for n, c in lora.items())
    assert not any(c for n, c in lora.items() if "lora_" not in n), "LoRA must leave the base frozen"
    both = results["lora_lomo"]["changed"]
    assert any("lora_B" in n and c for n, c in both.items())
    assert any("q_proj.base_layer" in n and c for n, c in both.items()), "LOMO must update the base weights"
    assert not any(results["zero_shot"]["changed"].values())
    assert results["zero_shot"]["loss_before"] == pytest.approx(results["zero_shot"]["loss_after"])


def test_memory_breakdown_categories(results):
    for method, r in results.items():
        m = r["memory"]
        assert m["total"] == m["params"] + m["grads"] + m["optimizer_states"] + m["activations"], method
        assert m["params"] > 0 and m["peak_rss"] > m["total"], method
    shard = results["adamw"]["fp32_param_bytes"] / 2  # fp32 model, 2 ranks
    adamw, sgd, lomo = (results[k]["memory"] for k in ("adamw", "sgd", "lomo"))
    # DeepSpeed keeps a separate fp32 master partition (even for an fp32 model) + AdamW's two moments
    assert adamw["optimizer_states"] == pytest.approx(3 * shard, rel=0.02)
    assert sgd["optimizer_states"] == pytest.approx(shard, rel=0.02)  # master only: no momentum
    # DeepSpeed keeps a gradient shard buffer for the whole model (+ its buckets)
    assert adamw["grads"] >= shard
    # LOMO: no optimizer state, gradients bounded by the bucket (+ one parameter's gradient)
    assert lomo["optimizer_states"] == 0
    assert 0 < lomo["grads"] < 0.5 * shard
    assert lomo["activations"] > 0 and lomo["activations"] == pytest.approx(adamw["activations"], rel=0.05)
    assert results["zero_shot"]["memory"]["grads"] == 0
    assert results["lora"]["memory"]["optimizer_states"] < 0.05 * adamw["optimizer_states"]
    assert lomo["total"] < sgd["total"] < adamw["total"]



def test_every_method_is_an_engine_on_the_accelerator_device(results):
    for method, r in results.items():
        assert r["is_engine"], method
        assert r["device"] == "cpu", method  # DeepSpeed's CPU accelerator here
        assert r["supports_resume"] == (method != "zero_shot"), method
    assert "lora_grad_norm" in results["lora_lomo"]["step_keys"]


@pytest.mark.long
@pytest.mark.parametrize("method", [m for m in METHODS if m != "zero_shot"])
def test_resume_equals_an_uninterrupted_run(rank_results, method):
    """2 steps, checkpoint, a fresh engine (other LoRA adapters) loads it, 2 more steps == 4 steps
    straight. fp32 on 2 ranks: the same arithmetic in the same order, so exactly equal."""
    r = ok(rank_results(2), resume)[method]
    assert r["step_after_load"] == 2
    assert r["lrs_resumed"] == r["lrs_straight"]
    assert r["max_abs_diff"] == 0.0, r


def test_lora_lomo_adapter_gradient_is_one_unscaled_pass(rank_results):
    r = ok(rank_results(2), lora_lomo_two_passes)
    assert not r["one_pass"]["two_passes"] and r["two_passes"]["two_passes"]
    assert r["two_passes"]["loss_scale"] == 32.0
    # Before the fix the two-pass gradient was 2 passes x 32 = 64 times the one-pass one.
    assert r["two_passes"]["lora_grad_norm"] == pytest.approx(r["one_pass"]["lora_grad_norm"], rel=1e-6)


def test_missing_adapter_gradient_is_built_on_the_engine_device():
    """An adapter without .grad contributes zeros made on the engine's device, not the CPU
    (the meta device stands in for a GPU: mixing it with a CPU tensor fails like cuda would)."""
    from lomo_ds.methods.lora import one_pass_adapter_grads

    reached = torch.nn.Parameter(torch.empty(3, 2, device="meta"))
    reached.grad = torch.empty(3, 2, device="meta")
    unreached = torch.nn.Parameter(torch.empty(0, device="meta"))
    for p, shape in ((reached, (3, 2)), (unreached, (4,))):
        p.ds_shape = shape
    flat = one_pass_adapter_grads([reached, unreached], torch.device("meta"), passes=2, loss_scale=8.0)
    assert flat.device.type == "meta" and flat.shape == (10,)


def test_method_registry_matches_the_run_config():
    from lomo_ds.config import run as run_config

    assert METHODS is run_config.METHODS


@pytest.mark.parametrize("method", METHODS)
def test_every_method_fetches_as_the_config_says(rank_results, method):
    """zero_optimization.leaf_module reaches every method's DeepSpeed engine (the baselines run
    under the same fetch settings as LOMO, so their comparison stays fair), and each still trains."""
    r = ok(rank_results(2), fetch_per_layer)[method]
    assert r["leaf_modules"] == ["LlamaDecoderLayer"] and r["n_leaves"] == 2, r
    if method != "zero_shot":
        assert r["loss_after"] < r["loss_before"], r


@pytest.mark.long
@pytest.mark.parametrize("method", [m for m in METHODS if m != "zero_shot"])
def test_accumulation_equals_the_concatenated_micro_batches(rank_results, method):
    """gradient_accumulation_steps 2 (windows of 2, 1 and 2 micro-batches) equals the same method
    without accumulation on each window's micro-batches concatenated: LOMO's shard accumulator,
    DeepSpeed's own accumulation for AdamW/SGD/LoRA, LoRA+LOMO's adapters in .grad; a step every
    second call, and the epoch-end window of one micro-batch steps at once."""
    r = ok(rank_results(2), accumulation)[method]
    tol = 1e-5 if method == "adamw" else 1e-6  # AdamW's normalised step magnifies summation-order rounding
    assert r["max_abs_diff"] <= tol and r["moved"] > 100 * tol
    assert r["stepped"] == [[False, True], [True], [False, True]] and r["global_steps"] == [1, 2, 3]
    assert r["accumulation_steps"] == 2


@pytest.mark.long
def test_zero_shot_ignores_accumulation(rank_results):
    assert ok(rank_results(2), accumulation)["zero_shot"] == {"accumulation_steps": 1, "boundary": True}


@pytest.mark.long
@pytest.mark.parametrize("method", METHODS)
def test_every_method_steps_alike_on_the_labelled_logits_alone(rank_results, method):
    """The recipe asks every engine for the logits of labelled positions only (keep_labelled_logits):
    DeepSpeed's engine, peft's model and LOMO's hooks all take the trimmed batch to the same step."""
    r = ok(rank_results(2), labelled_logits)[method]
    assert r["logits_to_keep"] == 6  # 11 positions, targets from column 6 on: positions 5..10
    assert r["loss_kept"] == pytest.approx(r["loss_full"], rel=1e-6)
    tol = 1e-5 if method == "adamw" else 1e-6  # AdamW's normalised step magnifies summation-order rounding
    assert r["max_diff"] <= tol, r


def test_lora_adapter_writes_are_ordered_before_the_next_gathers(rank_results):
    """The adapters' new values are written after the LOMO step's end ordered ZeRO-3's gather
    stream; the step orders it again after them (on a GPU the next forward could otherwise gather
    adapters half-written; a CPU records the order)."""
    r = ok(rank_results(2), lora_writes_before_gathers)
    assert r["adapters_moved"] and r["orders"] >= 2
    assert r["last_order_saw_final_adapters"], r
