"""The LOMO engine's memory, measured by its own tracker on small runs, for tests/test_planner.py to
hold the planner's prediction against (within 10%). tests/dist_checks.py runs it on 1 and 2 ranks."""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lomo_ds.methods import build_engine
from lomo_ds.config.run import load_run_config

# The measured model: LLaMA-style, odd sizes, model states comparable to activations.
TINY = dict(hidden=128, layers=4, intermediate=344, vocab=256, heads=4, kv_heads=2, head_dim=32)
SEQ, MICRO, BUCKET = 32, 2, 20_000
CASES = {  # name -> (DeepSpeed zero_optimization extras, activation checkpointing)
    "default": ({}, False),
    "ac_small_live": ({"stage3_max_live_parameters": 30_000, "stage3_max_reuse_distance": 30_000,
                       "stage3_prefetch_bucket_size": 0, "stage3_param_persistence_threshold": 1000}, True),
}


def measure() -> dict:
    """Each case's steady-state memory breakdown, as the engine's tracker measured it on this rank."""
    results = {}
    for name, (zero_extra, ac) in CASES.items():
        cfg = LlamaConfig(vocab_size=TINY["vocab"], hidden_size=TINY["hidden"], intermediate_size=TINY["intermediate"],
                          num_hidden_layers=TINY["layers"], num_attention_heads=TINY["heads"],
                          num_key_value_heads=TINY["kv_heads"], head_dim=TINY["head_dim"], max_position_embeddings=64,
                          tie_word_embeddings=False, attn_implementation="eager", use_cache=False)
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        ds = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 3, **zero_extra}}
        if ac:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
        run = load_run_config({**ds, "lomo": {"lr": 1e-3, "bucket_size": BUCKET}, "model": {"path": "tiny"}},
                              check_files=False)
        eng = build_engine(run, model, total_steps=0)
        eng.enable_memory_tracking()
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, TINY["vocab"], (MICRO, SEQ), generator=g)
        # The first step records DeepSpeed's module trace (no prefetch, no reuse); the second is
        # the steady state the planner predicts.
        eng.train_step({"input_ids": ids, "labels": ids.clone()})
        eng.reset_memory()
        eng.train_step({"input_ids": ids, "labels": ids.clone()})
        results[name] = {"world": eng.world, **eng.memory_breakdown(),
                         "tracker_total": eng.tracker.peak.total}
        del eng
    return results


def planner_checks(world: int) -> dict:
    return {"measured": measure}


