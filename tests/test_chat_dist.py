"""Exports that load, for every training method, and generation spread over ZeRO-3 ranks
(tests/dist_chat_checks.py, run in the 2- and 3-rank launches of tests/dist_checks.py)."""
from __future__ import annotations

import pathlib

import pytest
import torch

from conftest import family, ok
from helpers_data import CHATML
from lomo_ds.methods import METHODS


@pytest.mark.parametrize("method", METHODS)
def test_export_of_every_method_loads_with_the_engine_logits_and_the_chat_template(dist_results, method):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    r = ok(family(dist_results, "chat")(2), f"export/{method}")
    out = pathlib.Path(r["dir"])
    saved = torch.load(out / "engine_logits.pt")
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    # every tensor has the base architecture's name: nothing missing, nothing left over (no PEFT names)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        logits = model(input_ids=saved["input_ids"]).logits
    assert torch.allclose(logits, saved["logits"], atol=1e-5), (logits - saved["logits"]).abs().max()
    assert AutoTokenizer.from_pretrained(out).chat_template == CHATML


def test_lora_exports_hold_the_merged_adapters(dist_results):
    """The LoRA exports differ from the base weights exactly where adapters were (q_proj, v_proj),
    so the logits comparison above sees the merge."""
    from safetensors.torch import load_file

    from tiny import tiny_llama

    base = tiny_llama(seed=0, layers=2, hidden=48).state_dict()
    exports = family(dist_results, "chat")(2)
    lora = load_file(pathlib.Path(ok(exports, "export/lora")["dir"]) / "model.safetensors")
    changed = sorted(k for k in lora if not torch.equal(lora[k], base[k]))
    assert changed and all(("q_proj" in k or "v_proj" in k) for k in changed), changed
    lora_lomo = load_file(pathlib.Path(ok(exports, "export/lora_lomo")["dir"]) / "model.safetensors")
    assert sum(not torch.equal(lora_lomo[k], base[k]) for k in lora_lomo) > len(changed)  # LOMO trained the rest


def test_generation_over_three_ranks_matches_each_prompt_alone(dist_results):
    r = ok(family(dist_results, "chat")(3), "generation")
    assert r["world"] == 3 and r["metrics"]["n"] == 7
    assert r["replies"] == r["reference"]
    assert r["lengths"][0] == 2 and len(set(r["lengths"])) > 1  # replies stop at different lengths


def test_packed_batch_through_the_lomo_engine(dist_results):
    """Each rank packs its own examples into fewer rows; under ZeRO-3 every example's loss from the
    packed forward equals its loss alone, and the engine trains on the packed batch."""
    import math

    r = ok(family(dist_results, "chat")(2), "packed")
    assert r["rows"] < 5 and r["max_diff"] < 1e-5 and math.isfinite(r["loss"])
