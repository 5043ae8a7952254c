"""Exports that load, for every training method; generation spread over ZeRO-3 ranks; a packed
batch through the LOMO engine. Multi-rank checks (tests/ranks.py) declared beside their assertions:

  export/<method>   every training method trains 2 steps, exports with export_hf (LoRA merged, the
                    tokenizer's chat template beside the weights) and saves the engine's logits on a
                    fixed batch; the test loads the export with transformers and compares (2 ranks)
  packed            a packed batch through the LOMO engine under ZeRO-3 (2 ranks): each example's
                    loss from the packed logits against its loss alone, and a training step on it
  generation        greedy replies spread over 3 ranks under ZeRO-3 (7 prompts: 3/2/2 per rank,
                    replies of different lengths) against the unpartitioned model answering each
                    prompt alone
"""
from __future__ import annotations

import math
import os
import pathlib

import pytest
import torch

from lomo_ds.evaluation.generation import evaluate_generation, generate_ids
from lomo_ds.methods import METHODS
from lomo_ds.storage.checkpoint import export_hf
from tests.helpers_data import CHATML, chatml_tokenizer
from tests.methods.dist_methods_checks import batch_for, fresh_engine, run_config
from tests.ranks import LONG_TESTS, long_unless_declared, multi_rank, multi_rank_checks, ok, work_dir
from tests.tiny import tiny_llama

PROBE = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38], [2, 71, 82, 81, 82, 84, 59, 4, 5, 23]])


def export_method(method: str) -> dict:
    out_dir = os.path.join(work_dir(), f"export_{method}")
    steps = 0 if method == "zero_shot" else 2
    eng = fresh_engine(run_config(method), total_steps=max(steps, 1))
    for s in range(steps):
        eng.train_step(batch_for(s, eng))
    export_hf(eng, chatml_tokenizer(), out_dir, 600.0)
    logits = eng.eval_forward({"input_ids": PROBE}).logits
    if eng.rank == 0:
        torch.save({"input_ids": PROBE, "logits": logits}, os.path.join(out_dir, "engine_logits.pt"))
    return {"dir": out_dir, "steps": steps}


def prompts() -> list[dict]:
    g = torch.Generator(device="cpu").manual_seed(5)
    return [{"prompt_ids": torch.randint(3, 90, (n,), generator=g, device="cpu").tolist(), "messages": [],
             "reference": ""} for n in (4, 9, 6, 12, 5, 7, 3)]


@multi_rank(worlds=(3,))
def generation() -> dict:
    import lomo_ds

    full = tiny_llama(21).eval()  # built outside ZeRO-3: this rank's whole copy, the reference
    ps = prompts()
    unstopped = [generate_ids(full, [p["prompt_ids"]], stop_ids=[], pad_id=0, max_new_tokens=8,
                              device=torch.device("cpu"))[0] for p in ps]
    stop = unstopped[0][2]  # prompt 0 stops after 2 tokens; the others when they meet it, or at 8
    reference = [generate_ids(full, [p["prompt_ids"]], stop_ids=[stop], pad_id=0, max_new_tokens=8,
                              device=torch.device("cpu"))[0] for p in ps]
    engine = lomo_ds.initialize(tiny_llama(21), {"train_micro_batch_size_per_gpu": 1,
                                                 "zero_optimization": {"stage": 3,
                                                                       "stage3_param_persistence_threshold": 0},
                                                 "lomo": {"lr": 0.01}})

    class Ids:  # the replies as token-id strings, so they can be compared exactly
        @staticmethod
        def decode(ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    metrics, rows = evaluate_generation(engine.module, ps, Ids, stop_ids=[stop], pad_id=0, max_new_tokens=8,
                                        batch_size=2, rank=engine.rank, world=engine.world, device=engine.device)
    return {"world": engine.world, "metrics": metrics, "replies": None if rows is None else [r["reply"] for r in rows],
            "reference": [" ".join(map(str, r)) for r in reference], "lengths": [len(r) for r in reference]}


@multi_rank(worlds=(2,))
def packed_through_the_engine() -> dict:
    import lomo_ds
    from lomo_ds.data.collate import collate
    from lomo_ds.data.packing import collate_packed, pack

    model = tiny_llama(4)
    model.config._attn_implementation = "sdpa"
    engine = lomo_ds.initialize(model, {"train_micro_batch_size_per_gpu": 2, "lomo": {"lr": 0.01},
                                        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    g = torch.Generator(device="cpu").manual_seed(8 + engine.rank)
    examples = []
    for n in (7, 12, 5, 9, 6):
        ids = torch.randint(0, 90, (n,), generator=g, device="cpu").tolist()
        examples.append({"input_ids": ids, "labels": [-100, -100] + ids[2:]})
    rows = pack(examples, max_length=24, seed=engine.rank)
    batch = collate_packed(rows, pad_id=0)

    def loss(logits, labels):
        return torch.nn.functional.cross_entropy(logits[0, :-1].float(), labels[0, 1:], ignore_index=-100).item()

    logits = engine.eval_forward(batch).logits
    packed, alone = [], []
    for r, row in enumerate(rows):
        start = 0
        for n in row["lengths"]:
            packed.append(loss(logits[r:r + 1, start:start + n], batch["labels"][r:r + 1, start:start + n]))
            one = collate([{"input_ids": row["input_ids"][start:start + n],
                            "labels": row["labels"][start:start + n]}], 0)
            alone.append(loss(engine.eval_forward({"input_ids": one["input_ids"]}).logits, one["labels"]))
            start += n
    step = engine.train_step(batch)
    diff = max(abs(a - b) for a, b in zip(packed, alone, strict=True))
    return {"rows": len(rows), "max_diff": diff, "loss": step["loss"]}

# The DeepSpeed-optimizer baselines' exports (AdamW, SGD: the same export path as LoRA's without
# adapters) with the long checks (CI); the others in every suite.
EXPORTS = [multi_rank_checks([2] if LONG_TESTS or m not in ("adamw", "sgd") else [],
                             **{m: lambda m=m: export_method(m)})[0] for m in METHODS]


@pytest.mark.parametrize("check", [pytest.param(c, marks=long_unless_declared(c)) for c in EXPORTS],
                         ids=str)
def test_export_of_every_method_loads_with_the_engine_logits_and_the_chat_template(rank_results, check):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    r = ok(rank_results(2), check)
    out = pathlib.Path(r["dir"])
    saved = torch.load(out / "engine_logits.pt")
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    # every tensor has the base architecture's name: nothing missing, nothing left over (no PEFT names)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        logits = model(input_ids=saved["input_ids"]).logits
    assert torch.allclose(logits, saved["logits"], atol=1e-5), (logits - saved["logits"]).abs().max()
    assert AutoTokenizer.from_pretrained(out).chat_template == CHATML


def test_lora_exports_hold_the_merged_adapters(rank_results):
    """The LoRA exports differ from the base weights exactly where adapters were (q_proj, v_proj),
    so the logits comparison above sees the merge."""
    from safetensors.torch import load_file

    base = tiny_llama(seed=0, layers=2, hidden=48).state_dict()
    exports = {str(c): ok(rank_results(2), c) for c in EXPORTS if str(c) in ("lora", "lora_lomo")}
    lora = load_file(pathlib.Path(exports["lora"]["dir"]) / "model.safetensors")
    changed = sorted(k for k in lora if not torch.equal(lora[k], base[k]))
    assert changed and all(("q_proj" in k or "v_proj" in k) for k in changed), changed
    lora_lomo = load_file(pathlib.Path(exports["lora_lomo"]["dir"]) / "model.safetensors")
    assert sum(not torch.equal(lora_lomo[k], base[k]) for k in lora_lomo) > len(changed)  # LOMO trained the rest


@pytest.mark.parametrize("world", [3])  # the 3-rank launch's group (tests/conftest.py)
def test_generation_over_three_ranks_matches_each_prompt_alone(rank_results, world):
    r = ok(rank_results(world), generation)
    assert r["world"] == 3 and r["metrics"]["n"] == 7
    assert r["replies"] == r["reference"]
    assert r["lengths"][0] == 2 and len(set(r["lengths"])) > 1  # replies stop at different lengths


def test_packed_batch_through_the_lomo_engine(rank_results):
    """Each rank packs its own examples into fewer rows; under ZeRO-3 every example's loss from the
    packed forward equals its loss alone, and the engine trains on the packed batch."""
    r = ok(rank_results(2), packed_through_the_engine)
    assert r["rows"] < 5 and r["max_diff"] < 1e-5 and math.isfinite(r["loss"])
