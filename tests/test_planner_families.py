"""The planner for any config.json (lomo_ds/planning/model_tree.py): the model's own module tree
built on the meta device (its decoder-layer class, head_dim, tied embeddings, biases, stacked MoE
experts), leaf_module "auto" resolved as lomo_ds resolves it, AdaLomo's factored expert state, and
its per-GPU figure against the memory the engine measures on tiny Qwen2, Gemma 2 and Mixtral
models (1 and 2 ranks, within 10%, as tests/test_planner.py does for LLaMA)."""
from __future__ import annotations

import pytest
import torch

from lomo_ds.config.run import load_run_config
from lomo_ds.methods import build_engine
from lomo_ds.planning import planner as P
from lomo_ds.runtime import ds_compat
from tests.families import family_config
from tests.ranks import multi_rank, ok

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
            run = load_run_config({**ds, "lomo": {"lr": 1e-3, "bucket_size": BUCKET, "optimizer": "sgd"},
                                   "model": {"path": "tiny"}}, check_files=False)
            eng = build_engine(run, model, total_steps=0)
            eng.enable_memory_tracking()
            ids = torch.randint(3, SIZES["vocab"], (MICRO, SEQ), generator=torch.Generator().manual_seed(1))
            eng.train_step({"input_ids": ids, "labels": ids.clone()})
            eng.reset_memory()
            eng.train_step({"input_ids": ids, "labels": ids.clone()})
            names = {id(m): n for n, m in eng.module.named_modules()}
            results[f"{family}/{case}"] = {"world": eng.world, **eng.memory_breakdown(),
                                           "leaf_modules": sorted(names[id(m)] for m in ds_compat.leaf_modules(eng.module))}
            del eng
    return results


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", MEASURED)
def test_planner_matches_measured_family(rank_results, world, family, case):
    r = ok(rank_results(world), measured_families)[f"{family}/{case}"]
    zero, ac = CASES[case]
    ds = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 3, **zero}}
    run = P.run_spec(**P.run_overrides_from_ds(ds), seq=SEQ, checkpointing=ac, lomo_bucket=BUCKET)
    m = spec(family)
    est = P.estimate(m, "lomo", world, run)
    detail = f"{family} {case} on {world}: measured {r}, predicted {est.gib()}"
    print(f"{family} {case} on {world} rank(s): measured {r['total']:,} B, planned {est.accounted:,.0f} B "
          f"({est.accounted / r['total'] - 1:+.1%}); activations {r['activations']:,} vs {est.activations:,.0f}")
    assert sorted(P.leaf_module_names(m, run)) == r["leaf_modules"], detail
    assert r["params"] == pytest.approx(est.params, rel=0.10), detail
    assert r["activations"] == pytest.approx(est.activations, rel=0.10), detail
    assert r["total"] == pytest.approx(est.accounted, rel=0.10), detail
