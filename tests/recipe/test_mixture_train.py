"""The training program on a 3-source mixture (chat, prompt/response, text), two ranks, loaded whole
and streamed: a run stopped by SIGTERM to one rank at a random moment (the preemption path: the
ranks agree, checkpoint together and exit 75), then resumed, sees the uninterrupted run's examples
(the same loss at every later step, and the same weights to the bit), and is evaluated per source.

The runs are the training program's, in the 2-rank launch of the multi-rank checks (tests/ranks.py
run_here), as tests/recipe/test_chat_train.py's are."""
import json
import os
import pathlib

import pytest
import torch
from safetensors.torch import load_file

from lomo_ds.runtime.preemption import PREEMPTED_EXIT
from tests.data.test_mixture import write_sources
from tests.helpers_data import chatml_tokenizer
from tests.ranks import LONG_TESTS, ROOT, multi_rank, ok, run_here, work_dir
from tests.recipe.test_preemption import random_moment, signal_during_training
from tests.tiny import save_tiny_model

STEPS = 6
VARIANTS = {
    # 100 examples mixed 2:1:1 from 40 + 30 + 20 records: 50 chat and 25 text ones repeat some.
    "memory": {"train_samples": 100},
    # Streamed, packed on the fly, through a 5-record shuffle buffer; 2 micro-batches a step.
    "stream": {"streaming": True, "packing": True, "shuffle_buffer": 5},
}


def write_mixture_runs(root: pathlib.Path) -> None:
    """The tiny model and its tokenizer, the three sources and a run config per variant (rank 0)."""

    tok = chatml_tokenizer()
    save_tiny_model(root / "model", tok)
    sources = write_sources(root / "data")
    with open(os.path.join(ROOT, "ds_configs", "tiny_cpu.json")) as f:
        base = json.load(f)
    for name, data in VARIANTS.items():
        cfg = json.loads(json.dumps(base))
        cfg["model"]["path"] = str(root / "model")
        cfg["tokenizer"]["max_length"] = 64
        cfg["data"] = {"sources": sources, **data}
        cfg["train"]["seed"] = 3
        if name == "stream":
            cfg["gradient_accumulation_steps"] = 2
        cfg["train"].update({"max_steps": STEPS, "epochs": 3})
        cfg["output"].update({"checkpoint_every": 2, "export_hf": True, "keep_last": 3})
        (root / f"{name}.json").write_text(json.dumps(cfg))


def mixture_runs() -> dict:
    """Per variant: a straight run, then one stopped by a signal at a random moment and resumed."""
    from lomo_ds.recipe.train import main

    root = pathlib.Path(work_dir()) / "mixture_runs"
    if torch.distributed.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        write_mixture_runs(root)
    torch.distributed.barrier()
    out = {"root": str(root)}
    for name in VARIANTS:
        config, straight, cut = root / f"{name}.json", root / f"{name}_straight", root / f"{name}_cut"
        out[name] = {"straight": run_here(main, ["--config", str(config), "--output-dir", str(straight)])}
        with signal_during_training(random_moment(name, straight, 2)):
            out[name]["stopped"] = run_here(main, ["--config", str(config), "--output-dir", str(cut)])
        out[name]["resumed"] = run_here(main, ["--config", str(config), "--output-dir", str(cut), "--resume"])
    return out


def _metrics(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in open(path / "metrics.jsonl")]


if LONG_TESTS:  # several runs of the training program in the 2-rank launch: a long check (CI)
    mixture_runs = multi_rank(worlds=[2])(mixture_runs)


@pytest.mark.long
def test_a_resumed_mixture_run_sees_the_uninterrupted_runs_examples(rank_results):
    r = ok(rank_results(2), mixture_runs)
    root = pathlib.Path(r["root"])
    for name in VARIANTS:
        straight, stopped, resumed = r[name]["straight"], r[name]["stopped"], r[name]["resumed"]
        assert straight["rc"] == 0 and resumed["rc"] == 0, (name, straight["stdout"][-2000:], resumed["stdout"][-2000:])
        assert stopped["rc"] == PREEMPTED_EXIT, (name, stopped["stdout"][-2000:])
        (stop,) = [m for m in _metrics(root / f"{name}_cut") if m.get("phase") == "preempted"]
        at = stop["step"]
        assert 1 <= at < STEPS and f"at step {at}" in resumed["stdout"], (at, resumed["stdout"][-2000:])
        data_line = next(line for line in straight["stdout"].splitlines() if line.startswith("data: "))
        if name == "memory":
            assert data_line.count('"repeated": "1.25x"') == 2  # 50 of 40 conversations, 25 of 20 texts
        else:
            assert "streamed, 6 steps of 2 micro-batches each" in data_line
        a = {m["step"]: m["loss"] for m in _metrics(root / f"{name}_straight") if "loss" in m}
        # The cut run's rows: its steps before the stop, then the resumed run's after it.
        b = {m["step"]: m["loss"] for m in _metrics(root / f"{name}_cut") if "loss" in m}
        assert sorted(a) == list(range(1, STEPS + 1)) and sorted(b) == list(range(1, STEPS + 1)), (a, b)
        assert [b[s] for s in sorted(b)] == [a[s] for s in sorted(b)], name  # the same examples, step by step
        assert len(set(a.values())) == STEPS  # the steps' batches differ
        wa, wb = (load_file(root / f"{name}_{run}" / "hf_model" / "model.safetensors")
                  for run in ("straight", "cut"))
        assert max((wa[k] - wb[k]).abs().max().item() for k in wa) == 0.0, name
        final = next(m for m in _metrics(root / f"{name}_straight") if m.get("phase") == "final")
        assert {"eval/loss", "eval/loss/a"} <= set(final) and final["eval/loss"] == final["eval/loss/a"]
