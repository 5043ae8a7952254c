"""The planner for any config.json (lomo_ds/planning/model_tree.py): the model's own module tree
built on the meta device (its decoder-layer class, head_dim, tied embeddings, biases, stacked MoE
experts), leaf_module "auto" resolved as lomo_ds resolves it, AdaLomo's factored expert state, and
its per-GPU figure against the memory the engine measures on tiny Qwen2, Gemma 2 and Mixtral
models (1 and 2 ranks, within 10%, as tests/planning/test_planner.py does for LLaMA)."""
from __future__ import annotations

import math
import os

import pytest
import torch

from lomo_ds.config.run import load_run_config
from lomo_ds.methods import build_engine
from lomo_ds.planning import planner as P
from lomo_ds.runtime import ds_compat
from tests.families import family_config
from tests.ranks import ROOT, multi_rank, ok

MEASURED = ("qwen2", "gemma2", "mixtral")
SIZES = dict(layers=4, hidden=128, vocab=256)
SEQ, MICRO, BUCKET = 32, 2, 20_000
CASES = {  # name -> (zero_optimization extras, activation checkpointing)
    "default": ({"leaf_module": "auto"}, False),
    "ac_small_live": ({"stage3_max_live_parameters": 30_000, "stage3_max_reuse_distance": 30_000,
                       "stage3_prefetch_bucket_size": 0, "stage3_param_persistence_threshold": 1000,
                       "leaf_module": "auto"}, True),
}


def spec(family: str) -> P.ModelSpec:
    return P.spec_from_hf_config(family_config(family, **SIZES).to_dict(), family)


@multi_rank(worlds=[1, 2])
def measured_families() -> dict:
    """Each family's and case's memory breakdown, as the engine's tracker measured it (second step)."""
    results = {}
    for family in MEASURED:
        for case, (zero, ac) in CASES.items():
            torch.manual_seed(0)
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_config(family_config(family, **SIZES))
            if ac:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
            ds = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 3, **zero}}
            run = load_run_config({**ds, "lomo": {"lr": 1e-3, "optimizer": "sgd"}, "comm": {"bucket_size": BUCKET},
                                   "model": {"path": "tiny"}}, check_files=False)
            eng = build_engine(run, model, total_steps=0)
            eng.enable_memory_tracking()
            ids = torch.randint(3, SIZES["vocab"], (MICRO, SEQ), generator=torch.Generator().manual_seed(1))
            eng.train_step({"input_ids": ids, "labels": ids.clone()})
            eng.reset_memory()
            eng.train_step({"input_ids": ids, "labels": ids.clone()})
            names = {id(m): n for n, m in eng.module.named_modules()}
            leaves = sorted(names[id(m)] for m in ds_compat.leaf_modules(eng.module))
            results[f"{family}/{case}"] = {"world": eng.world, **eng.memory_breakdown(), "leaf_modules": leaves}
            del eng
    return results


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", MEASURED)
def test_planner_matches_measured_family(rank_results, world, family, case):
    r = ok(rank_results(world), measured_families)[f"{family}/{case}"]
    zero, ac = CASES[case]
    ds = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 3, **zero}}
    run = P.run_spec(**P.run_overrides_from_ds(ds), seq=SEQ, checkpointing=ac, lomo_bucket=BUCKET, attn="eager")
    m = spec(family)
    est = P.estimate(m, "lomo", world, run)
    detail = f"{family} {case} on {world}: measured {r}, predicted {est.gib()}"
    print(f"{family} {case} on {world} rank(s): measured {r['total']:,} B, planned {est.accounted:,.0f} B "
          f"({est.accounted / r['total'] - 1:+.1%}); activations {r['activations']:,} vs {est.activations:,.0f}")
    assert sorted(P.leaf_module_names(m, run)) == r["leaf_modules"], detail
    assert r["params"] == pytest.approx(est.params, rel=0.10), detail
    assert r["activations"] == pytest.approx(est.activations, rel=0.10), detail
    assert r["total"] == pytest.approx(est.accounted, rel=0.10), detail


# ----------------------------------------------------------------------------- any config.json
# The architectures' published sizes (config.json fields), written out for the planner.
REAL = {
    "qwen2.5-7b": {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                   "tie_word_embeddings": False},
    "gemma-2-9b": {"model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336, "num_hidden_layers": 42,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 256000,
                   "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 256},
    "mixtral-8x7b": {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2,
                     "tie_word_embeddings": False},
}
LAYER = {"qwen2.5-7b": "Qwen2DecoderLayer", "gemma-2-9b": "Gemma2DecoderLayer", "mixtral-8x7b": "MixtralDecoderLayer"}


@pytest.fixture(scope="module")
def real_configs(tmp_path_factory):
    import json

    folder = tmp_path_factory.mktemp("configs")
    paths = {}
    for name, cfg in REAL.items():
        (folder / name).mkdir()
        (folder / name / "config.json").write_text(json.dumps(cfg))
        paths[name] = str(folder / name)
    return paths


@pytest.mark.parametrize("name", list(REAL))
def test_plan_prints_the_models_own_decoder_layer(real_configs, name, capsys):
    from lomo_ds.cli import main

    assert main(["plan", "--model", real_configs[name]]) == 0
    out = capsys.readouterr().out
    layer = LAYER[name]
    print("\n".join(line for line in out.splitlines() if layer in line or line.startswith("#")))
    assert f"decoder layer {layer}" in out and f"fetch leaf_module {layer}" in out
    assert f"coarsest fetch that fits: per decoder layer (leaf_module {layer})" in out or "fits: none" in out
    assert "LlamaDecoderLayer" not in out


def test_real_shapes_from_the_meta_model(real_configs):
    qwen, gemma, mixtral = (P.resolve_model(real_configs[n]) for n in REAL)
    assert qwen.n_params == pytest.approx(7.62e9, rel=0.005)  # Qwen2.5-7B: q/k/v biases, untied head
    assert (3584,) in qwen.param_shapes() and (512,) in qwen.param_shapes()  # q and k/v biases
    assert gemma.n_params == pytest.approx(9.24e9, rel=0.005) and gemma.tie  # Gemma-2-9B: tied, head_dim 256
    assert (16 * 256, 3584) in gemma.param_shapes()  # q_proj: heads x head_dim, not hidden
    assert mixtral.n_params == pytest.approx(46.70e9, rel=0.005) and mixtral.experts == 8
    assert (8, 2 * 14336, 4096) in mixtral.param_shapes() and (8, 4096, 14336) in mixtral.param_shapes()


def test_adalomo_state_of_stacked_experts(real_configs):
    """AdaLomo's state for Mixtral-8x7B: each expert tensor factored (rows + columns of every expert)
    instead of a full fp32 second moment of every expert weight (the state before stacked tensors
    were factored)."""
    m = P.resolve_model(real_configs["mixtral-8x7b"])
    gpus = 8
    after = P.adalomo_state_bytes(m, gpus)
    before = sum(4 * (s[0] + s[1]) if len(s) == 2 else -(-4 * math.prod(s) // gpus) for s in m.param_shapes()) \
        + 8 * len(m.param_shapes())
    experts = sum(math.prod(s) for s in m.param_shapes() if len(s) == 3)
    print(f"Mixtral-8x7B AdaLomo state per GPU on {gpus}: {before / P.GIB:.2f} GiB with a full second moment of "
          f"the experts, {after / 2**20:.1f} MiB factored ({experts / 1e9:.1f}B expert parameters)")
    assert before - after == pytest.approx(4 * experts / gpus, rel=0.01)
    assert after < 2**30 / 10 < before
    e = P.estimate(m, "adalomo", gpus, P.run_spec())
    assert e.optimizer_states == after


def test_eval_plan_counts_kv_cache_and_logits():
    """llama7b_chat.json's evaluation on one GPU: the KV cache of 8 x (2048 + 256) tokens (2 L K d b a
    token) and the eval batch's logits, beside the weights."""
    from lomo_ds.planning import inference

    cfg = load_run_config(os.path.join(ROOT, "ds_configs", "llama7b_chat.json"), check_files=False)
    p = P.plan_for_run(cfg, 1)
    ev = inference.eval_spec_for(cfg)
    e = inference.eval_estimate(p.model, p.run, 1, ev, "adalomo")
    assert e.kv_cache == 2 * 32 * 32 * 128 * 2 * 8 * (2048 + 256)  # 9.66 GB
    assert e.loss == 8 * 2048 * 32000 * (2 + 8)  # 5.2 GB
    assert e.weights == pytest.approx(6.74e9 * 2, rel=0.01)
    assert e.total == e.generation_phase and e.total < 24 * P.GIB
    text = inference.format_eval(p, ev, 1, "adalomo")
    print(text)
    assert "KV cache 9.00" in text and "fits in 24 GiB" in text


@pytest.mark.parametrize("name, layer", [("llama3.1_8b_chat.json", "LlamaDecoderLayer"),
                                         ("qwen2.5_7b_chat.json", "Qwen2DecoderLayer")])
def test_shipped_chat_configs_fit_the_gpus_they_name(name, layer, capsys):
    """The configs name 1 x 24 GB (docs/configs.md): training and evaluation fit there."""
    from lomo_ds.planning import inference
    from lomo_ds.recipe.train import print_eval_plan

    cfg = load_run_config(os.path.join(ROOT, "ds_configs", name), check_files=False)
    assert cfg.ds["zero_optimization"]["leaf_module"] == "auto"
    p = P.plan_for_run(cfg, 1)
    assert p.run.leaf_classes == (layer,) and p.min_gpus["adalomo"] == 1
    assert inference.eval_estimate(p.model, p.run, 1, inference.eval_spec_for(cfg), "adalomo").total < 24 * P.GIB
    print_eval_plan(cfg, p, 1)
    print(P.format_plan(p, 1))
    out = capsys.readouterr().out
    assert "evaluation peak" in out and "fits in 24 GiB" in out and f"leaf_module {layer}" in out
