"""The harness's memory in the planner (lomo_ds/planning/inference.py) and the refusal before training
that uses it (lomo_ds/recipe/harness_eval.py: check_memory).

With eval.harness_tasks, rank 0 loads the whole export once the engine is freed: the model in the
training dtype, beside lm-eval's batch. A model that cannot be loaded so on the run's GPU is refused
before any model is built, with that figure; on a CPU nothing is refused.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from lomo_ds.config.run import load_run_config
from lomo_ds.evaluation.harness import HarnessError
from lomo_ds.planning import inference, planner
from lomo_ds.recipe import harness_eval

GIB = planner.GIB


def _run(size: str, dtype: str | None = "bf16", harness=("builtin",), batch: int = 8):
    precision = {dtype: {"enabled": True}} if dtype in ("bf16", "fp16") else {}
    return load_run_config({**precision, "model": {"path": "not-here", "planner_size": size},
                            "train": {"method": "zero_shot"}, "tokenizer": {"max_length": 512},
                            "eval": {"harness_tasks": list(harness), "batch_size": batch}}, check_files=False)


def test_the_harness_phase_is_the_whole_model_in_the_training_dtype_beside_lm_evals_batch():
    m, ev = planner.LLAMA["7b"], inference.EvalSpec(batch=8, seq=512, harness=True)
    bf16, fp32 = (replace(planner.shipped_run("7b"), dtype=d) for d in ("bf16", "fp32"))
    h = inference.harness_estimate(m, bf16, ev)
    assert h.weights == m.n_params * 2 and inference.harness_estimate(m, fp32, ev).weights == m.n_params * 4
    tokens = 8 * 512
    assert h.logits == 2 * tokens * m.vocab * 2  # logits and log-softmax, both bf16
    assert h.kv_cache == 2 * m.layers * m.k * m.d * 2 * tokens
    assert h.total == h.weights + h.layer + h.logits + h.kv_cache
    # The evaluation's peak takes it: the harness phase is above LOMO's eval loss on 8 GPUs.
    e = inference.eval_estimate(m, bf16, 8, ev)
    assert e.harness == h and e.total == max(e.loss_phase, h.total) == h.total
    assert inference.eval_estimate(m, bf16, 8, replace(ev, harness=False)).harness is None


def test_lomo_ds_plan_reports_the_harness_phase_for_a_run_with_harness_tasks():
    cfg = _run("7b")
    p = planner.plan_for_run(cfg, 8, gpu_mem_gib=24.0)
    h = inference.harness_estimate(p.model, p.run, inference.eval_spec_for(cfg))
    text = inference.format_eval(p, inference.eval_spec_for(cfg), 8)
    assert f"harness:    {h.total / GIB:.2f} GiB on rank 0's GPU" in text, text
    assert f"the model in bf16 {h.weights / GIB:.2f}" in text and "fits in 24 GiB" in text, text
    without = inference.format_eval(p, inference.eval_spec_for(_run("7b", harness=())), 8)
    assert "harness" not in without
    # 13B in bf16 holds ~24 GiB of weights alone: out of memory on a 24 GiB GPU, saying why.
    big = _run("13b")
    p13 = planner.plan_for_run(big, 8, gpu_mem_gib=24.0)
    text = inference.format_eval(p13, inference.eval_spec_for(big), 8)
    assert "OUT OF MEMORY" in text and "eval.harness_tasks: lm-evaluation-harness loads the whole" in text, text


def test_a_model_the_gpu_cannot_hold_for_the_harness_is_refused_before_training():
    gpu = 24 * GIB
    harness_eval.check_memory(_run("7b", "bf16"), gpu)  # 7B in bf16: ~15 GiB with the batch
    with pytest.raises(HarnessError) as e:
        harness_eval.check_memory(_run("7b", "fp32"), gpu)  # the same model in fp32: ~31 GiB
    h = inference.harness_estimate(planner.LLAMA["7b"], planner.run_spec_for(_run("7b", "fp32")),
                                   inference.EvalSpec(batch=8, seq=512, harness=True))
    msg = str(e.value)
    assert f"{h.total / GIB:.2f} GiB = the model in fp32 {h.weights / GIB:.2f}" in msg, msg
    assert "more than the GPU's 24.00 GiB" in msg and "drop eval.harness_tasks" in msg, msg
    assert "the model alone is more than the GPU holds" in msg, msg
    # Only the batch over the line: the batch is what to lower.
    with pytest.raises(HarnessError, match="lower eval.batch_size"):
        harness_eval.check_memory(_run("7b", "bf16", batch=64), gpu)
    # A 30B model on an 80 GiB GPU in bf16 (~68 GiB) runs; 65B does not.
    harness_eval.check_memory(_run("30b"), 80 * GIB)
    with pytest.raises(HarnessError, match="the model alone is more than the GPU holds"):
        harness_eval.check_memory(_run("65b"), 80 * GIB)
    # On a CPU (no accelerator memory to hold it against) nothing is refused.
    harness_eval.check_memory(_run("65b", "fp32"), None)


def test_the_refusal_comes_from_the_runs_own_check_naming_the_option(monkeypatch):
    """check_runtime, before any model is built, says eval.harness_tasks and the planner's figure;
    the accelerator's memory is the one thing set here (this machine has none)."""
    from lomo_ds.config.errors import ConfigError
    from lomo_ds.recipe.train import check_runtime

    monkeypatch.setattr(harness_eval, "_accelerator_bytes", lambda: 24 * GIB)
    with pytest.raises(ConfigError, match=r"eval\.harness_tasks: lm-evaluation-harness loads the whole exported "
                                          r"model on rank 0's GPU .* more than the GPU's 24\.00 GiB"):
        check_runtime(_run("13b"))
