"""The harness on a run's export, and the memory beside it (lomo_ds/recipe/harness_eval.py,
lomo_ds/methods/release.py).

The harness loads the whole exported model on rank 0's device. Before it does, every rank frees what
its engine holds: the checks here train a step with each kind of engine (LOMO's with AdaLomo's state,
DeepSpeed's AdamW, LoRA+LOMO's adapters and their optimizer), release it, and read the engine's own
memory accounting (MethodEngine.memory_breakdown: its parameter shards and its optimizer state) and
every parameter's ZeRO-3 shard before and after.

The long check runs the training program with eval.harness_tasks on a bf16 run: the release comes
before the harness (the run's lines in order), and the harness loads the export in bf16, the run's
training dtype, not fp32.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib

import pytest
import torch

from lomo_ds.config.run import LOMO_METHODS
from tests.methods.dist_methods_checks import batch_for, fresh_engine, run_config
from tests.ranks import LONG_TESTS, ROOT, multi_rank, multi_rank_checks, ok, run_here, work_dir

HAVE_HARNESS = importlib.util.find_spec("lm_eval") is not None
RELEASED = ("lomo", "adamw", "lora_lomo")


def released(method: str) -> dict:
    from lomo_ds.recipe import harness_eval
    from lomo_ds.runtime import ds_compat

    eng = fresh_engine(run_config(method, **({"optimizer": "adalomo"} if method in LOMO_METHODS else {})),
                       total_steps=1)
    eng.train_step(batch_for(0, eng))
    eng.tracker = None  # the accounting of what is held now, not of a tracked peak
    shards = lambda: sum(ds_compat.shard(p).numel() for p in eng.module.parameters())  # noqa: E731
    before = {"breakdown": eng.memory_breakdown(), "shard_numel": shards()}
    line = harness_eval.release(eng)
    return {"before": before, "after": {"breakdown": eng.memory_breakdown(), "shard_numel": shards()},
            "line": line}


# LOMO's on uneven shards too (3 ranks); DeepSpeed's and LoRA's engines on one rank (seconds each).
CHECKS = [*multi_rank_checks((1, 3), released_lomo=lambda: released("lomo")),
          *multi_rank_checks((1,), **{f"released_{m}": (lambda m=m: released(m)) for m in RELEASED[1:]})]


@pytest.mark.parametrize("check, world", [(c, w) for c in CHECKS for w in c.worlds], ids=lambda x: str(x))
def test_releasing_an_engine_frees_its_shards_and_optimizer_state(rank_results, check, world):
    r = ok(rank_results(world), check)
    before, after = r["before"], r["after"]
    assert before["shard_numel"] > 0 and before["breakdown"]["params"] > 0, before
    assert before["breakdown"]["optimizer_states"] > 0, before  # AdaLomo's, AdamW's, the adapters' AdamW
    assert after["shard_numel"] == 0, after
    assert after["breakdown"]["params"] == 0 and after["breakdown"]["optimizer_states"] == 0, after
    assert "the engine's memory released first" in r["line"] and "MiB on cpu" in r["line"], r["line"]


def harness_after_training() -> dict:

    from lomo_ds.recipe.train import main
    from tests.helpers_data import byte_bpe_tokenizer
    from tests.tiny import save_tiny_model

    root = pathlib.Path(work_dir())
    if torch.distributed.get_rank() == 0:
        tok = byte_bpe_tokenizer()
        save_tiny_model(root / "harness_model", tok)
    torch.distributed.barrier()
    with open(os.path.join(ROOT, "ds_configs", "tiny_cpu.json")) as f:
        config = {**json.load(f), "bf16": {"enabled": True}}
    config["model"] = {"path": str(root / "harness_model")}
    config["output"] = {**config["output"], "export_hf": True, "dir": str(root / "harness_run")}
    config["eval"] = {**config["eval"], "harness_tasks": ["builtin"], "harness_limit": 8}
    config["train"] = {**config["train"], "max_steps": 1}
    config["data"] = {**config["data"], "train_samples": 4, "eval_samples": 8}
    with open(root / "harness_run.json", "w") as f:
        json.dump(config, f)
    run = run_here(main, ["--config", str(root / "harness_run.json")])
    return {**run, "summary": json.loads((root / "harness_run" / "summary.json").read_text())
            if torch.distributed.get_rank() == 0 else None}


if LONG_TESTS and HAVE_HARNESS:
    harness_after_training = multi_rank(worlds=(2,))(harness_after_training)


@pytest.mark.long
@pytest.mark.skipif(not HAVE_HARNESS, reason="lm-eval not installed")
def test_the_harness_loads_the_export_in_the_training_dtype_after_the_engine_is_freed(rank_results):
    r = ok(rank_results(2), harness_after_training)
    assert r["rc"] == 0, r
    lines = r["stdout"].splitlines()
    release = next(i for i, line in enumerate(lines) if "the engine's memory released first" in line)
    loaded = next(i for i, line in enumerate(lines) if "harness: the model loaded in" in line)
    assert release < loaded, lines
    assert "the model loaded in bfloat16" in lines[loaded], lines[loaded]
    assert r["summary"]["harness/lomo_builtin/n"] == 8, r["summary"]
