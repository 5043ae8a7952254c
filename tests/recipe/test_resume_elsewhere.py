"""A run that moves between rank counts as a cluster's free GPUs come and go: checkpointed on 2
ranks, resumed on 3, then 2, 1, 4 and 1 again, the global batch kept at 12 examples a step
(micro-batches of 6, 4, 6, 12, 3, 12), ends within 1e-6 of an uninterrupted run, AdaLomo's state
cut again at every move. Then a checkpoint of another model is refused by name. A long check (seven
launches; LOMO_DS_LONG_TESTS=1, as CI runs it). Where each element goes for every N -> M of 1-3 is
tests/storage/test_engine_state.py's, in every suite."""
import json

import pytest
import torch
from safetensors.torch import load_file

from devkit.launch_local import run_local
from tests.helpers_data import byte_bpe_tokenizer
from tests.ranks import ROOT
from tests.recipe.test_train import TRAIN_SCRIPT, train_args, write_tiny_run
from tests.tiny import tiny_llama_config

GLOBAL_BATCH = 12
HOPS = [2, 3, 2, 1, 4, 1]  # the rank count of each leg; every leg trains 2 steps
STEPS_PER_HOP = 2
# A constant learning rate: a leg's --max-steps (where it stops) is then not part of its schedule.
COMMON = ["--set", "lomo.optimizer=adalomo", "--set", "train.scheduler.type=constant",
          "--set", "train.scheduler.warmup_ratio=0", "--set", "eval.at_end=false", "--epochs", "3",
          "--set", "output.checkpoint_every=null"]


def _run(config, out, world, max_steps, *extra):
    args = train_args(TRAIN_SCRIPT, config, out, "--max-steps", str(max_steps), *COMMON,
                      "--set", f"train_micro_batch_size_per_gpu={GLOBAL_BATCH // world}", *extra)
    proc = run_local(args, world, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


@pytest.mark.ranks
@pytest.mark.long
def test_a_run_moved_between_rank_counts_ends_where_an_uninterrupted_one_does(tmp_path):
    config = write_tiny_run(tmp_path)
    total = STEPS_PER_HOP * len(HOPS)
    _run(config, tmp_path / "straight", 1, total)  # one rank: the cheapest launch, the same global batch
    moved = tmp_path / "moved"
    for i, world in enumerate(HOPS):
        out = _run(config, moved, world, STEPS_PER_HOP * (i + 1), *(["--resume"] if i else []))
        if i:
            assert f"at step {STEPS_PER_HOP * i}" in out, out[-2000:]
            if world != HOPS[i - 1]:
                assert f"checkpointed on {HOPS[i - 1]}: the same global batch ({GLOBAL_BATCH}" in out, out[-2000:]
                assert "warning: train.loss_normalization is 'mean'" in out, out[-2000:]
    a = load_file(tmp_path / "straight" / "hf_model" / "model.safetensors")
    b = load_file(moved / "hf_model" / "model.safetensors")
    assert a.keys() == b.keys()
    diffs = {k: (a[k] - b[k]).abs().max().item() for k in a}
    print(f"max |moved - uninterrupted| = {max(diffs.values()):.2e} over legs on {HOPS} ranks")
    assert max(diffs.values()) <= 1e-6, diffs
    _refuses_another_model(tmp_path, config, moved)


def _refuses_another_model(tmp_path, config, run_dir):
    """The same parameter names, another width: refused in one line before any shard is written, on
    another rank count than the one that wrote the checkpoint (the same-count path runs the same check,
update/shard.py check_shapes)."""
    from transformers import LlamaForCausalLM

    wider = tmp_path / "wider"
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config(vocab=len(byte_bpe_tokenizer()), hidden=48)).save_pretrained(wider)
    byte_bpe_tokenizer().save_pretrained(wider)
    raw = json.loads(config.read_text())
    raw["model"]["path"] = str(wider)
    other = tmp_path / "other.json"
    other.write_text(json.dumps(raw))
    for world in (1,):  # another rank count than the checkpoint's (one rank: the cheapest launch)
        args = train_args(TRAIN_SCRIPT, other, run_dir, "--max-steps", "20", *COMMON, "--resume",
                          "--set", f"train_micro_batch_size_per_gpu={GLOBAL_BATCH // world}")
        proc = run_local(args, world, timeout=900, cwd=ROOT)
        assert proc.returncode != 0
        (line,) = [x for x in proc.stderr.splitlines() if x.startswith("checkpoint error:")]
        assert "has shape" in line and "a checkpoint of another model (model.path)" in line, line



@pytest.mark.parametrize("normalization", ["mean", "tokens"])
def test_a_move_under_mean_normalization_warns_that_micro_batches_weigh_rows(monkeypatch, normalization):
    """The warning is said only where it is true: under 'mean' another rank count changes which rows
    share a micro-batch's mean; under 'tokens' it does not (tests/engine's token-weighing oracles)."""
    from types import SimpleNamespace

    from lomo_ds.recipe import resume
    from lomo_ds.storage import checkpoint

    said = []

    class Run(resume.Resume):
        resume_requested, world, dp_world = True, 3, 3
        engine = SimpleNamespace(supports_resume=True)
        cfg = SimpleNamespace(output=SimpleNamespace(dir="out"), micro_batch=4, accumulation_steps=1,
                              train=SimpleNamespace(loss_normalization=normalization))
        say = staticmethod(said.append)

    monkeypatch.setattr(checkpoint, "latest_checkpoint", lambda d: "out/checkpoints/step_2")
    monkeypatch.setattr(checkpoint, "load_checkpoint", lambda c, e: {"step": 2, "world": 2, "global_batch": 12})
    assert Run().resume_point() == 2
    warned = [m for m in said if m.startswith("warning: train.loss_normalization is 'mean'")]
    assert len(warned) == (normalization == "mean"), said
