"""The planner for long sequences (lomo_ds/planning/sequence.py): attention by implementation,
Ulysses sequence parallelism, the tiled MLP and offloaded checkpoints; the long-context goals table
in docs/memory.md is the planner's, and every row of it fits. Planner arithmetic only: no model runs."""
from __future__ import annotations

import os
from dataclasses import replace

import pytest

from lomo_ds.cli import main
from lomo_ds.planning import planner as P
from lomo_ds.planning.sequence import (
    attention_saved_bytes,
    checkpoint_bytes,
    mlp_backward_bytes,
    mlp_tiles,
    sequence_terms,
    ulysses_bytes,
)
from lomo_ds.planning.tables import LONG_CONTEXT, format_long_context_table
from tests.ranks import ROOT

MODELS = os.path.join(ROOT, "docs", "models")


def _spec(name: str) -> P.ModelSpec:
    return P.LLAMA[name] if name in P.LLAMA else P.resolve_model(os.path.join(MODELS, f"{name}.json"))


def test_sdpa_keeps_no_score_matrix():
    """Doubling the sequence doubles sdpa's layer figure (linear) and quadruples eager's scores."""
    m = P.LLAMA["7b"]
    layer = {attn: [P.layer_activation_bytes(m, P.run_spec(seq=s, attn=attn)) for s in (4096, 8192)]
             for attn in ("sdpa", "eager")}
    assert layer["sdpa"][1] == 2 * layer["sdpa"][0]
    assert layer["eager"][1] > 3 * layer["eager"][0]
    # the figure: Llama-3.1-8B at 32,768 was 225 GiB per GPU with eager's scores on 1 to 8 GPUs
    spec, run = _spec("Llama-3.1-8B"), P.run_spec(seq=32768)
    assert P.estimate(spec, "lomo", 8, replace(run, attn="eager")).total > 100 * P.GIB
    assert P.estimate(spec, "lomo", 8, run).total < 24 * P.GIB


def test_the_run_config_names_the_attention_and_the_options():
    from lomo_ds.config.run import load_run_config

    raw = {"model": {"path": "tiny", "attn_implementation": "eager", "gradient_checkpointing": True},
           "lomo": {"lr": 1e-3}, "memory": {"tiled_mlp": True, "mlp_tiles": 4, "offload_checkpoints": True}}
    run = P.run_spec_for(load_run_config(raw, check_files=False))
    assert (run.attn, run.tiled_mlp, run.mlp_tiles, run.offload_checkpoints) == ("eager", True, 4, True)
    plain = {"model": {"path": "tiny"}, "lomo": {"lr": 1e-3}}
    assert P.run_spec_for(load_run_config(plain, check_files=False)).attn == "sdpa"
    flash = {"model": {"path": "tiny", "attn_implementation": "flash_attention_2"}, "lomo": {"lr": 1e-3}}
    assert P.run_spec_for(load_run_config(flash, check_files=False)).attn == "flash"
    # train.sequence_parallel_size is the planner's sp (--dry-run plans what the run trains)
    split = {"model": {"path": "tiny"}, "lomo": {"lr": 1e-3}, "train": {"sequence_parallel_size": 2},
             "tokenizer": {"max_length": 1024}}
    run = P.run_spec_for(load_run_config(split, check_files=False))
    whole = P.run_spec_for(load_run_config({**split, "train": {}}, check_files=False))
    assert (run.sp, whole.sp) == (2, 1) and run.tokens == whole.tokens // 2 == 512


def test_sequence_parallel_divides_what_the_layers_see():
    m = _spec("Llama-3.1-8B")
    one, eight = P.run_spec(seq=131072), P.run_spec(seq=131072, sp=8)
    assert eight.tokens == one.tokens // 8 == 16384
    assert checkpoint_bytes(m, eight)[0] == checkpoint_bytes(m, one)[0] // 8
    # the whole sequence for H / sp heads inside attention: the same elements, plus the output's all-to-all
    T, d, b = eight.tokens, m.d, eight.b
    assert attention_saved_bytes(m, eight) == T * (2 * 32 + 2 * 8) * d * b + 4 * T * 32 + T * 32 * d * b
    assert ulysses_bytes(m, eight) == T * (32 + 2 * 8) * d * b and ulysses_bytes(m, one) == 0
    # fewer key-value heads than ranks: replicated to one per rank
    assert ulysses_bytes(m, P.run_spec(seq=131072, sp=16)) == (131072 // 16) * (32 + 2 * 16) * d * b


def test_tiles_and_offloaded_checkpoints():
    m = _spec("Llama-3.1-8B")
    run = P.run_spec(seq=32768, tiled_mlp=True)
    assert mlp_tiles(m, run) == 8  # ceil(32768 / 4096), DeepSpeed's choice
    assert mlp_backward_bytes(m, run) == 32768 * m.hidden * 2 + 4096 * (6 * m.intermediate + m.hidden) * 2
    assert mlp_backward_bytes(m, replace(run, tiled_mlp=False)) == 0
    assert mlp_tiles(m, replace(run, mlp_tiles=32)) == 32
    assert sequence_terms(m, run)["MLP saved per layer"] == 0
    off = replace(run, offload_checkpoints=True)
    assert checkpoint_bytes(m, off) == (2 * 32768 * m.hidden * 2, m.layers * 32768 * m.hidden * 2)
    e = P.estimate(m, "lomo", 2, off)
    assert e.checkpoints_host == m.layers * 32768 * m.hidden * 2 and e.host == 2 * e.checkpoints_host


@pytest.mark.parametrize("fields, gpus, message", [
    ({"seq": 1004, "sp": 8}, 8, "seq: 1004 is not divisible by sp = 8"),
    ({"seq": 4095, "sp": 3}, 3, "heads are not divisible by sp = 3"),
    ({"seq": 4096, "sp": 4}, 2, "need a GPU count that is a multiple of 4"),
    ({"seq": 4096, "offload_checkpoints": True, "checkpointing": False}, 1, "offload_checkpoints: needs"),
])
def test_bad_sequence_options_are_refused(fields, gpus, message):
    with pytest.raises(ValueError, match=message):
        P.estimate(P.LLAMA["7b"], "lomo", gpus, P.run_spec(**fields))


def test_cli_prints_each_term_that_grows_with_the_sequence(capsys):
    assert main(["plan", "--model", os.path.join(MODELS, "Llama-3.1-8B.json"), "--seq", "32768", "--sp", "8"]) == 0
    out = capsys.readouterr().out
    assert "sequence parallel 8 (Ulysses: 4,096 positions per rank)" in out
    assert "terms that grow with the sequence: 4,096 positions per rank" in out
    for term in ("attention saved per layer", "MLP saved per layer", "Ulysses all-to-all buffers",
                 "checkpointed inputs on the GPU", "+ tiled MLP + offloaded checkpoints"):
        assert term in out
    assert "| lomo | 1 |" not in out  # 1, 2 and 4 GPUs cannot hold 8 sequence-parallel ranks
    assert main(["plan", "--model", "7b", "--seq", "1004", "--sp", "8"]) == 2
    assert "seq: 1004 is not divisible by sp = 8" in capsys.readouterr().err
    assert main(["plan", "--model", "7b", "--seq", "4096", "--sp", "16"]) == 2
    assert "none of [1, 2, 4, 8] is (give it with --gpus)" in capsys.readouterr().err
    assert main(["plan", "--model", "7b", "--seq", "4096", "--sp", "16", "--gpus", "16"]) == 0


def test_the_long_context_goals_fit_and_the_docs_table_is_the_planners():
    table = format_long_context_table(MODELS)
    for name, gpus, seq, fields in LONG_CONTEXT:
        r = P.run_spec(batch=1, seq=seq, **fields)
        for method in P.FUSED:
            assert P.estimate(_spec(name), method, gpus, r).total <= 24 * P.GIB, (name, gpus, seq, method)
    assert table.count("| yes |") == len(LONG_CONTEXT)
    doc = open(os.path.join(ROOT, "docs", "memory.md")).read()
    assert table in doc, "docs/memory.md is out of date: regenerate it with lomo-ds plan --long-context docs/models"
