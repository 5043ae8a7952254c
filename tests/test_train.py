"""The training program end to end on a tiny LLaMA: kill a rank mid-run and resume to the same
parameters as an uninterrupted run; the exported directory loads in transformers with the
engine's logits; dry-run and error paths."""
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, family, free_port, ok
from helpers_data import byte_bpe_tokenizer
from tiny import tiny_llama_config

TRAIN = os.path.join(ROOT, "launch", "train.py")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny LLaMA + tokenizer saved as a Hugging Face directory, and a run config for it."""
    root = tmp_path_factory.mktemp("tiny_run")
    tok = byte_bpe_tokenizer()
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(vocab=len(tok)))
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    with open(os.path.join(ROOT, "ds_configs", "tiny_cpu.json")) as f:
        cfg = json.load(f)
    cfg["model"]["path"] = str(root / "model")
    cfg["train"].update({"max_steps": 6, "epochs": 1})
    cfg["data"].update({"train_samples": 40, "eval_samples": 8})
    cfg["output"].update({"checkpoint_every": 2, "export_hf": True, "keep_last": 2})
    path = root / "run.json"
    path.write_text(json.dumps(cfg))
    return root, path


TRAIN_SCRIPT = [TRAIN]  # deepspeed launch/train.py ...
TRAIN_CLI = ["-m", "lomo_ds.cli", "train"]  # lomo-ds train ...


def train_cmd(entry, config, out_dir, *extra):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), *entry, "--config", str(config), "--output-dir", str(out_dir), *extra]


def run_train(entry, config, out_dir, *extra):
    proc = subprocess.run(train_cmd(entry, config, out_dir, *extra), cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc


def logged_steps(out_dir) -> list[int]:
    path = out_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if '"loss"' in line]


def run_and_kill_rank1(config, out_dir, after_step: int):
    """Start a 2-rank run and SIGKILL rank 1's process as soon as metrics.jsonl shows `after_step`
    done (rank 0 logs a step once both ranks have finished it: the loss is a rank mean)."""
    import psutil

    with open(out_dir.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(train_cmd(TRAIN_SCRIPT, config, out_dir), cwd=ROOT, stdout=log, stderr=log,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        deadline = time.monotonic() + 600
        while after_step not in logged_steps(out_dir):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before the kill"
            time.sleep(0.005)
        ranks = {p.environ().get("RANK"): p for p in psutil.Process(proc.pid).children(recursive=True)}
        ranks["1"].send_signal(signal.SIGKILL)
        return proc.wait(timeout=300)


def test_killed_run_resumes_to_identical_parameters(tiny_run):
    root, config = tiny_run
    straight, interrupted = root / "straight", root / "interrupted"
    out = run_train(TRAIN_SCRIPT, config, straight)
    # Rank 0 alone reports; a DeepSpeed start-up warning shows once, not once per rank.
    assert out.stdout.count("data: ") == 1 and out.stdout.count("[final] step 6") == 1
    assert (out.stdout + out.stderr).count("Setting accelerator to CPU") <= 1
    assert re.search(r"eval: +\d+%\|", out.stderr)  # the evaluation's progress bar
    # Rank 1 dies right after step 5 (checkpoints every 2 steps, 6 in all): the step-4 checkpoint
    # was sealed before step 5 began, and the next one is only written after step 6 and the final
    # evaluation, long after the kill.
    assert run_and_kill_rank1(config, interrupted, after_step=5) != 0
    ckpts = sorted(os.listdir(interrupted / "checkpoints"))
    assert "step_00000004" in ckpts and "step_00000006" not in ckpts
    assert (interrupted / "checkpoints" / "latest").read_text() == "step_00000004"
    assert not (interrupted / "hf_model").exists()
    resumed = run_train(TRAIN_CLI, config, interrupted, "--resume")  # the console command's entry point
    assert "resumed from" in resumed.stdout and "at step 4" in resumed.stdout
    a = load_file(straight / "hf_model" / "model.safetensors")
    b = load_file(interrupted / "hf_model" / "model.safetensors")
    assert a.keys() == b.keys()
    diffs = {k: (a[k] - b[k]).abs().max().item() for k in a}
    assert max(diffs.values()) == 0.0, diffs
    # The steps after the resume logged the same losses as the uninterrupted run.
    def losses(d):
        rows = [json.loads(line) for line in open(d / "metrics.jsonl")]
        return {r["step"]: r["loss"] for r in rows if "loss" in r}
    la, lb = losses(straight), losses(interrupted)
    assert all(la[s] == lb[s] for s in (5, 6))
    # keep_last=2: only the two newest complete checkpoints remain
    assert sorted(os.listdir(straight / "checkpoints")) == ["latest", "step_00000004", "step_00000006"]


@pytest.mark.parametrize("tie", ["untied", "tied"])
def test_export_loads_in_transformers_with_engine_logits(dist_results, tie):
    """tests/dist_export_checks.py, run in the 2-rank launch of tests/dist_checks.py: 2 steps, then
    the sharded export, and the engine's logits on a fixed batch."""
    from transformers import AutoModelForCausalLM

    r = ok(family(dist_results, "export")(2), tie)
    out, max_shard = pathlib.Path(r["dir"]), r["max_shard_size"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert sorted(f for f in os.listdir(out) if f.endswith(".safetensors")) == shards
    for shard in shards:
        tensors = load_file(out / shard)
        assert set(tensors) == {k for k, v in index["weight_map"].items() if v == shard}
        # a shard may pass the limit only when it holds a single tensor bigger than the limit
        assert sum(t.numel() * t.element_size() for t in tensors.values()) <= max_shard or len(tensors) == 1
    # a tied LM head is stored once, as the input embedding
    assert ("lm_head.weight" in index["weight_map"]) == (tie == "untied")
    saved = torch.load(out / "engine_logits.pt")
    model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        logits = model(input_ids=saved["input_ids"]).logits
    assert torch.allclose(logits, saved["logits"], atol=1e-5), (logits - saved["logits"]).abs().max()


def test_dry_run_prints_config_and_memory_plan():
    out = subprocess.run([sys.executable, TRAIN, "--config", "ds_configs/llama65b.json", "--dry-run"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert '"lomo"' in out.stdout and "65" in out.stdout
    assert "GB" in out.stdout or "GiB" in out.stdout


def test_bad_config_fails_before_any_model(tmp_path):
    bad = tmp_path / "bad.json"
    cfg = json.load(open(os.path.join(ROOT, "ds_configs", "tiny_cpu.json")))
    cfg["lomo"]["lr"] = "fast"
    bad.write_text(json.dumps(cfg))
    out = subprocess.run([sys.executable, TRAIN, "--config", str(bad)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert "lomo.lr" in out.stderr and "expected a number" in out.stderr
