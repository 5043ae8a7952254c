"""The training program with train.sequence_parallel_size 2 on 2 ranks trains as the same program
without it on the same rows: a tiny Llama (sdpa), the built-in task, 4 steps of 2 rows, norm
clipping, loss_normalization "tokens". Without SP each rank trains on one row of each step's two;
with SP both ranks train on both rows, each on half the positions (rows right-padded to an even
length). Every step's loss and grad norm agree within fp32 rounding, and so does the final accuracy."""
from __future__ import annotations

import json
import os
import pathlib

import pytest

from tests.ranks import ROOT, multi_rank, ok, run_here, work_dir


def _write(root: pathlib.Path) -> dict[str, pathlib.Path]:

    from tests.helpers_data import chatml_tokenizer
    from tests.tiny import save_tiny_model

    tok = chatml_tokenizer(template=False)
    save_tiny_model(root / "model", tok)
    with open(os.path.join(ROOT, "ds_configs", "tiny_cpu.json")) as f:
        base = json.load(f)
    configs = {}
    for name, sp, micro in (("dp", 1, 1), ("sp", 2, 2)):
        cfg = json.loads(json.dumps(base))
        cfg["train_micro_batch_size_per_gpu"] = micro
        cfg["model"].update(path=str(root / "model"), attn_implementation="sdpa")
        cfg["train"].update(sequence_parallel_size=sp, loss_normalization="tokens", clip_grad_norm=0.5, seed=5)
        configs[name] = root / f"{name}.json"
        configs[name].write_text(json.dumps(cfg))
    return configs


@multi_rank(worlds=[2])
def sp_recipe() -> dict:
    import torch

    from lomo_ds.recipe.train import main

    root = pathlib.Path(work_dir()) / "sp_recipe"
    if torch.distributed.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        _write(root)
    torch.distributed.barrier()
    out = {}
    for name in ("dp", "sp"):
        run = run_here(main, ["--config", str(root / f"{name}.json"), "--output-dir", str(root / f"out_{name}")])
        out[name] = {"rc": run["rc"], "metrics": str(root / f"out_{name}" / "metrics.jsonl")}
    return out


def _rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_sequence_parallel_run_trains_as_the_data_parallel_run(rank_results):
    r = ok(rank_results(2), sp_recipe)
    assert r["dp"]["rc"] == 0 and r["sp"]["rc"] == 0
    dp, sp = (_rows(r[name]["metrics"]) for name in ("dp", "sp"))
    steps = [(a, b) for a, b in zip(dp, sp, strict=True) if "loss" in a]
    assert len(steps) == 4
    for a, b in steps:
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    assert any(a["grad_norm"] > 0.5 for a, _ in steps)  # the clip bit
    final = [(a, b) for a, b in zip(dp, sp, strict=True) if a.get("phase") == "final"]
    assert final and final[0][1]["eval/accuracy"] == final[0][0]["eval/accuracy"]


def test_the_model_check_before_the_build_reads_the_config_or_leaves_it_to_the_engine(monkeypatch, tmp_path):
    """The recipe refuses heads that sequence parallelism cannot split from the model's config.json,
    before any rank builds the model. A GGUF model not converted yet has no config to read
    (model_config: None): the run goes on, and the engine checks the built model instead.

    Revert checked: passing the None on to the layout's check_model refuses every first run of the
    built-in GGUF model ("needs a transformers model")."""
    from transformers import LlamaConfig

    from lomo_ds.config.run import load_run_config
    from lomo_ds.recipe import preflight
    from lomo_ds.runtime.layout import ParallelLayout

    nine_heads = LlamaConfig(num_attention_heads=9, num_key_value_heads=3, hidden_size=72)
    nine_heads.save_pretrained(tmp_path)
    raw = {"model": {"path": str(tmp_path), "attn_implementation": "sdpa"}, "lomo": {"lr": 1e-3},
           "train": {"sequence_parallel_size": 2}, "tokenizer": {"max_length": 128}}
    cfg = load_run_config(raw, check_files=False)
    layout = ParallelLayout.plan(2, 2, 0)
    with pytest.raises(ValueError, match="9 attention heads are not divisible"):
        preflight.check_sequence_parallel_model(cfg, layout)
    monkeypatch.setattr(preflight, "model_config", lambda cfg: None)
    preflight.check_sequence_parallel_model(cfg, layout)  # no config yet: nothing to refuse here
