"""The training program end to end on a tiny LLaMA: kill a rank mid-run and resume to the same
parameters as an uninterrupted run; the exported directory loads in transformers with the
engine's logits; dry-run and error paths."""
import importlib.util
import json
import os
import pathlib
import re
import signal
import time

import pytest
import torch
from safetensors.torch import load_file

import lomo_ds
from devkit.launch_local import local_ranks, run_local
from lomo_ds.storage.checkpoint import export_hf
from tests.helpers_data import byte_bpe_tokenizer
from tests.host_memory import assert_checkpoint_and_export_host_memory, checkpoint_and_export_host_memory
from tests.ranks import LONG_TESTS, ROOT, long_unless_declared, multi_rank, multi_rank_checks, ok, run_here, work_dir
from tests.tiny import global_batch, save_tiny_model, tiny_llama, tiny_llama_config

TRAIN = os.path.join(ROOT, "launch", "train.py")


def write_tiny_run(root: pathlib.Path) -> pathlib.Path:
    """A tiny LLaMA + tokenizer saved as a Hugging Face directory under `root`, and a run config for it."""
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
    return path


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny LLaMA + tokenizer saved as a Hugging Face directory, and a run config for it."""
    root = tmp_path_factory.mktemp("tiny_run")
    return root, write_tiny_run(root)


TRAIN_SCRIPT = [TRAIN]  # deepspeed launch/train.py ...
TRAIN_CLI = ["-m", "lomo_ds.cli", "train"]  # lomo-ds train ...


def train_args(entry, config, out_dir, *extra):
    return [*entry, "--config", str(config), "--output-dir", str(out_dir), *extra]


def run_train(entry, config, out_dir, *extra):
    proc = run_local(train_args(entry, config, out_dir, *extra), 2, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc


def logged_steps(out_dir) -> list[int]:
    path = out_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if '"loss"' in line]


def run_and_kill_rank1(config, out_dir, after_step: int, extra=()):
    """Start a 2-rank run and SIGKILL rank 1's process as soon as metrics.jsonl shows `after_step`
    done (rank 0 logs a step once both ranks have finished it: the loss is a rank mean)."""
    import psutil

    with open(out_dir.with_suffix(".log"), "w") as log, \
            local_ranks(train_args(TRAIN_SCRIPT, config, out_dir, *extra), 2, cwd=ROOT, stdout=log, stderr=log) as proc:
        deadline = time.monotonic() + 600
        while after_step not in logged_steps(out_dir):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before the kill"
            time.sleep(0.005)
        ranks = {p.environ().get("RANK"): p for p in psutil.Process(proc.pid).children(recursive=True)}
        ranks["1"].send_signal(signal.SIGKILL)
        return proc.wait(timeout=300)


# gradient_accumulation_steps 3 over 40 examples on 2 ranks with micro-batch 2: 10 micro-batches an
# epoch, so 4 optimizer steps (windows of 3, 3, 3 and the epoch's last window of 1, applied with its
# own 1/k) per epoch, 8 in two. One uninterrupted run serves both tests below (each launch of the
# training program costs its start-up).
K3 = ["--accumulation-steps", "3", "--epochs", "2", "--set", "train.max_steps=null",
      "--set", "output.checkpoint_every=3"]


HAVE_HARNESS = importlib.util.find_spec("lm_eval") is not None
HARNESS_EXAMPLES = 40  # the final evaluation's examples, scored by the run and by the harness
# The end of the uninterrupted run, as a user's: with lm-eval, the harness on its export
# (eval.harness_tasks), over the final evaluation's examples. Neither changes the training.
HARNESS = (["--set", 'eval.harness_tasks=["builtin"]', "--set", f"data.eval_samples={HARNESS_EXAMPLES}"]
           if HAVE_HARNESS and LONG_TESTS else [])  # a long check (CI): a process of its own, a model load


@pytest.fixture(scope="module")
def straight_k3(tiny_run):
    root, config = tiny_run
    straight = root / "straight"
    return straight, run_train(TRAIN_SCRIPT, config, straight, *K3, *HARNESS)


def metric_steps(out_dir) -> list[dict]:
    return [json.loads(line) for line in open(out_dir / "metrics.jsonl") if '"loss"' in line]


@pytest.mark.ranks
def test_accumulation_counts_optimizer_steps(straight_k3):
    """The metrics, the schedule and the checkpoints count optimizer steps, not micro-batches."""
    straight, out = straight_k3
    assert "4 steps/epoch of 3 micro-batches each, 8 steps in all" in out.stdout
    # the update the run gets, once (rank 0)
    assert out.stdout.count("update: LOMO (SGD), lr 0.01, clip_grad_norm 1, clip_grad_value none, linear schedule, "
                            "warm-up 0.1") == 1
    # CPU ranks keep freed memory from here on (lomo_ds/runtime/host_malloc.py), said once
    assert out.stdout.count("host memory: ") == 1, out.stdout
    steps = metric_steps(straight)
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert [r["micro_batches"] for r in steps] == [3, 3, 3, 1] * 2
    from lomo_ds.engine.schedule import Schedule

    schedule = Schedule("linear", 0.01, 8, 1)  # tiny_cpu.json: lr 0.01, warm-up 0.1 x 8 steps, over 8 steps
    assert [r["lr"] for r in steps] == pytest.approx([schedule.lr_at(i) for i in range(8)])
    # keep_last=2: only the two newest complete checkpoints remain (step 3's was removed)
    assert sorted(os.listdir(straight / "checkpoints")) == ["latest", "step_00000006", "step_00000008"]


@pytest.mark.ranks
def test_killed_run_resumes_to_identical_parameters(tiny_run, straight_k3):
    """Rank 1 is killed mid-run; `--resume` continues from the last sealed checkpoint, across the
    epoch's short accumulation window, to the uninterrupted run's parameters and losses."""
    root, config = tiny_run
    straight, out = straight_k3
    interrupted = root / "interrupted"
    # Rank 0 alone reports; a DeepSpeed start-up warning shows once, not once per rank.
    assert out.stdout.count("data: ") == 1 and out.stdout.count("[final] step 8") == 1
    assert (out.stdout + out.stderr).count("Setting accelerator to CPU") <= 1
    assert re.search(r"eval: +\d+%\|", out.stderr)  # the evaluation's progress bar
    # Rank 1 dies right after step 7 (checkpoints every 3 steps, 8 in all): the step-6 checkpoint
    # was sealed before step 7 began, and the next one is only written after step 8 and the final
    # evaluation, long after the kill.
    assert run_and_kill_rank1(config, interrupted, after_step=7, extra=K3) != 0
    ckpts = sorted(os.listdir(interrupted / "checkpoints"))
    assert "step_00000006" in ckpts and "step_00000008" not in ckpts
    assert (interrupted / "checkpoints" / "latest").read_text() == "step_00000006"
    assert not (interrupted / "hf_model").exists()
    resumed = run_train(TRAIN_CLI, config, interrupted, *K3, "--resume")  # the console command's entry point
    assert "resumed from" in resumed.stdout and "at step 6" in resumed.stdout
    a = load_file(straight / "hf_model" / "model.safetensors")
    b = load_file(interrupted / "hf_model" / "model.safetensors")
    assert a.keys() == b.keys()
    diffs = {k: (a[k] - b[k]).abs().max().item() for k in a}
    assert max(diffs.values()) == 0.0, diffs
    # The steps after the resume (a window of 3, then the short one) logged the uninterrupted run's losses.
    la = {r["step"]: (r["micro_batches"], r["loss"]) for r in metric_steps(straight)}
    lb = {r["step"]: (r["micro_batches"], r["loss"]) for r in metric_steps(interrupted)}
    assert [lb[s] for s in (7, 8)] == [la[s] for s in (7, 8)] and la[8][0] == 1


@pytest.mark.ranks
@pytest.mark.long
@pytest.mark.skipif(not HAVE_HARNESS, reason="lm-eval not installed")
def test_the_harness_on_the_export_agrees_with_the_runs_own_evaluation(tiny_run, straight_k3, capsys):
    """lm-evaluation-harness on the run's export, by the recipe option (eval.harness_tasks) and by
    `lomo-ds eval` on the same data section, scores the final evaluation's examples as the run did,
    within one example (the builtin task's candidates are one token each, where the harness's summed
    log-probability and the run's mean are one measure)."""
    from lomo_ds.cli import main

    _, config = tiny_run
    straight, _ = straight_k3
    rows = [json.loads(line) for line in open(straight / "metrics.jsonl")]
    own = next(row for row in rows if row.get("phase") == "final")
    by_recipe = next(row for row in rows if row.get("phase") == "harness")
    assert own["eval/n"] == by_recipe["harness/lomo_builtin/n"] == HARNESS_EXAMPLES
    one = 1 / HARNESS_EXAMPLES + 1e-9
    assert abs(by_recipe["harness/lomo_builtin/acc"] - own["eval/accuracy"]) <= one, (by_recipe, own)
    assert json.loads((straight / "summary.json").read_text())["harness/lomo_builtin/acc"] == \
        by_recipe["harness/lomo_builtin/acc"]
    out_file = straight / "harness.json"
    rc = main(["eval", "--model", str(straight / "hf_model"), "--tasks", "builtin", "--config", str(config),
               "--set", f"data.eval_samples={HARNESS_EXAMPLES}", "--out", str(out_file)])
    assert rc == 0, capsys.readouterr().err
    by_cli = json.loads(out_file.read_text())["lomo_builtin"]
    assert by_cli["n"] == HARNESS_EXAMPLES
    assert abs(by_cli["acc"] - own["eval/accuracy"]) <= one, (by_cli, own)


# ----------------------------------------------------------------------------- the Hugging Face export
GGUF_MARKER = {"quant_method": "gguf", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf", "dequantize": False}
MAX_SHARD_SIZE = 40_000  # bytes: the ~0.2 MB tiny model in several shards, as a 65B one is in 5 GB ones


def export(tie: str, max_shard_size: int = MAX_SHARD_SIZE) -> dict:
    """Trains a tiny model 2 steps through the engine, exports it with export_hf (shards of at most
    `max_shard_size` bytes), and saves the engine's own logits on a fixed batch beside it."""
    out_dir = os.path.join(work_dir(), f"export_{tie}")
    model = tiny_llama(11, tie=tie == "tied")
    if tie == "tied":  # as the built-in model's config says: it was read from a GGUF file (its tensors are plain)
        model.config.quantization_config = GGUF_MARKER
    engine = lomo_ds.initialize(model, {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000},
        "lomo": {"lr": 0.05}, "train": {"clip_grad_norm": 1.0}})
    for step in range(2):
        engine.train_step(global_batch(step, engine.world)[engine.rank])
    export_hf(engine, None, out_dir, 600.0, max_shard_size=max_shard_size)
    probe = global_batch(99, 1)[0]["input_ids"]
    logits = engine.eval_forward({"input_ids": probe}).logits
    if engine.rank == 0:
        torch.save({"input_ids": probe, "logits": logits}, os.path.join(out_dir, "engine_logits.pt"))
    return {"dir": out_dir, "max_shard_size": max_shard_size}


# The untied export (one more training run in the 2-rank launch) is a long check (CI).
EXPORTS = [multi_rank_checks([2] if LONG_TESTS or tie == "tied" else [], **{tie: lambda tie=tie: export(tie)})[0]
           for tie in ("untied", "tied")]


@pytest.mark.parametrize("check", [pytest.param(c, marks=long_unless_declared(c)) for c in EXPORTS],
                         ids=str)
def test_export_loads_in_transformers_with_engine_logits(rank_results, check):
    """The export of a tied and an untied model, on the 2-rank launch, loads in transformers and
    gives the engine's logits; the tied model's config names a GGUF source, as the built-in model's
    does, and its export is a plain model."""
    from transformers import AutoModelForCausalLM

    tie = str(check)
    r = ok(rank_results(2), check)
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
    # A model read from a GGUF file exports as a plain one: the Trainer (DPO from the chat demo's
    # export) refuses a model whose config names quant_method "gguf" as quantized.
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert not getattr(model, "is_quantized", False)


# ----------------------------------------------------------------------------- host memory of checkpoint and export
# Host memory of a checkpoint and an export, measured: a long check (CI).
HOST_MEMORY = (multi_rank_checks([2], host_memory=lambda: checkpoint_and_export_host_memory(work_dir()))[0]
               if LONG_TESTS else None)


@pytest.mark.long
def test_checkpoint_and_export_hold_one_tensor_or_file_of_host_memory(rank_results):
    """The export holds at most one file's tensors on rank 0 (plus the tensor being gathered), not
    the whole model; a checkpoint's save and load hold no copy of the rank's shards."""
    assert_checkpoint_and_export_host_memory(ok(rank_results(2), HOST_MEMORY))


# ----------------------------------------------------------------------------- the recipe's parts
@multi_rank(worlds=[2])
def recipe_parts() -> dict:
    """TrainRecipe's parts one at a time on 2 ranks: setup, an evaluation, one step, a checkpoint;
    then a second recipe resumes from it and runs train, finish and cleanup."""
    from lomo_ds.config.run import load_run_config
    from lomo_ds.recipe.train import TrainRecipe

    root = pathlib.Path(work_dir())
    if torch.distributed.get_rank() == 0:
        tok = byte_bpe_tokenizer()
        save_tiny_model(root / "recipe_model", tok)
    torch.distributed.barrier()
    cfg = load_run_config(os.path.join(ROOT, "ds_configs", "tiny_cpu.json"), {
        "model.path": str(root / "recipe_model"), "output.dir": str(root / "recipe_run"), "train.max_steps": 2,
        "output.checkpoint_every": 1, "data.train_samples": 16, "data.eval_samples": 8})
    first = TrainRecipe(cfg)
    first.setup()
    out = {"steps": first.total_steps, "start": first.start_step}
    out["zero_shot"] = first.evaluate("zero_shot", 0)
    engine_step, seen = first.engine.train_step, []

    def recorded_step(batch):
        seen.append((batch.get("logits_to_keep"), tuple(batch["input_ids"].shape), tuple(batch["labels"].shape)))
        return engine_step(batch)

    first.engine.train_step = recorded_step
    out["record"] = first.train_step(0)
    out["engine_batches"] = seen
    first.save()
    first.cleanup()
    out["checkpoints"] = sorted(os.listdir(root / "recipe_run" / "checkpoints"))
    second = TrainRecipe(cfg, resume=True)
    second.setup()
    out["resumed_start"] = second.start_step
    second.train()
    second.finish()
    second.cleanup()
    out["summary"] = json.loads((root / "recipe_run" / "summary.json").read_text())
    out["logged_steps"] = logged_steps(root / "recipe_run")
    return out


def test_recipe_parts_run_alone(rank_results):
    r = ok(rank_results(2), recipe_parts)
    assert r["steps"] == 2 and r["start"] == 0
    assert 0.0 <= r["zero_shot"]["eval/accuracy"] <= 1.0 and r["zero_shot"]["eval/n"] == 8
    assert r["record"]["step"] == 1 and r["record"]["loss"] > 0 and not r["record"]["skipped"]
    # The engine is asked for the logits of the labelled positions only (the yes/no answers).
    for keep, ids_shape, labels_shape in r["engine_batches"]:
        assert keep is not None and keep < ids_shape[1] and list(labels_shape) == [ids_shape[0], keep]
    assert r["checkpoints"] == ["latest", "step_00000001"]
    assert r["resumed_start"] == 1  # the second recipe starts where the first one's checkpoint is
    assert r["summary"]["steps"] == 2 and 0.0 <= r["summary"]["final_accuracy"] <= 1.0
    assert r["logged_steps"] == [1, 2]  # the resumed run appends to the first one's metrics


def test_dry_run_prints_config_and_memory_plan(capsys, monkeypatch):
    from lomo_ds.recipe.train import main

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.chdir(ROOT)
    assert main(["--config", "ds_configs/llama65b.json", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert '"lomo"' in out and "65" in out
    assert "GB" in out or "GiB" in out
    # launched on 8 ranks: the line for this launch names the config's rule (AdaLomo) and the planner's
    # figure for it; LOMO clips by norm (a measuring backward, then the updating one, over a retained
    # graph, whose activations the planner must count), so its figure is above AdaLomo's
    from lomo_ds.config.run import load_run_config
    from lomo_ds.planning.planner import GIB, plan_for_run

    figures = {}
    for rule, name in (("adalomo", "AdaLomo"), ("sgd", "LOMO")):
        with open(os.path.join(ROOT, "ds_configs/llama65b.json")) as f:
            raw = json.load(f)
        raw["lomo"]["optimizer"] = rule
        estimates = plan_for_run(load_run_config(raw, check_files=False), 8).estimates
        figures[name] = estimates[("adalomo" if rule == "adalomo" else "lomo", 8)].total / GIB
    assert figures["LOMO"] > figures["AdaLomo"]
    monkeypatch.setenv("WORLD_SIZE", "8")
    for rule, name in (("adalomo", "AdaLomo"), ("sgd", "LOMO")):
        assert main(["--config", "ds_configs/llama65b.json", "--dry-run", "--set", f"lomo.optimizer={rule}"]) == 0
        assert f"this launch (8 ranks): {name} needs {figures[name]:.2f} GiB per GPU" in capsys.readouterr().out


def test_bad_config_fails_before_any_model(tmp_path, capsys, monkeypatch):
    from lomo_ds.recipe import train

    bad = tmp_path / "bad.json"
    cfg = json.load(open(os.path.join(ROOT, "ds_configs", "tiny_cpu.json")))
    cfg["lomo"]["lr"] = "fast"
    bad.write_text(json.dumps(cfg))
    monkeypatch.delenv("RANK", raising=False)
    loaded = []
    monkeypatch.setattr(train, "TrainRecipe", lambda *a, **k: loaded.append(a))  # what would load the model
    assert train.main(["--config", str(bad)]) == 2
    assert loaded == []
    err = capsys.readouterr().err
    assert "lomo.lr" in err and "expected a number" in err


# ----------------------------------------------------------------------------- the first command a user types
PLACEHOLDER_CONFIGS = [n for n in sorted(os.listdir(os.path.join(ROOT, "ds_configs")))
                       if n.endswith(".json") and n != "tiny_cpu.json"  # the tests' own placeholder
                       and json.load(open(os.path.join(ROOT, "ds_configs", n)))["model"]["path"].startswith("/")]


def test_every_gpu_config_holds_a_placeholder():
    assert PLACEHOLDER_CONFIGS == ["llama13b.json", "llama3.1_8b_chat.json", "llama30b.json", "llama65b.json",
                                   "llama7b.json", "llama7b_chat.json", "qwen2.5_7b_chat.json"]


@pytest.mark.parametrize("name", PLACEHOLDER_CONFIGS)
def test_shipped_config_without_model_is_one_config_error(name, capsys, monkeypatch):
    """`deepspeed launch/train.py --config ds_configs/<name>` on a machine without the model: one line
    naming model.path, the placeholder and --model, before anything is loaded."""
    from lomo_ds.recipe.train import main

    monkeypatch.delenv("RANK", raising=False)
    path = os.path.join("ds_configs", name)
    placeholder = json.load(open(os.path.join(ROOT, path)))["model"]["path"]
    monkeypatch.chdir(ROOT)
    assert main(["--config", path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"config error: {path}: model.path: {placeholder!r}") and "--model" in err[0], err


@pytest.mark.parametrize("rank", [0, 1])
def test_a_silent_rank_outlives_the_rank_that_reports(rank, capsys, monkeypatch):
    """Under a launcher every rank stops on a config error, rank 0 alone prints it, and the others
    wait (for the launcher to end them) instead of exiting first: a launcher tears the group down
    at the first exit, and CI saw rank 0 killed before its line was out."""
    from lomo_ds.recipe import train

    slept = []
    monkeypatch.setattr(train.time, "sleep", slept.append)
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.chdir(ROOT)
    assert train.main(["--config", "ds_configs/llama65b.json"]) == 2
    err = capsys.readouterr().err
    if rank == 0:
        assert "model.path: '/path/to/llama-65b'" in err and slept == []
    else:
        assert err == "" and slept and slept[0] >= 10, slept


@pytest.mark.ranks
def test_placeholder_error_is_printed_once_on_two_ranks():
    """The same under a launcher: every rank stops before loading a model, rank 0 alone says why."""
    proc = run_local([TRAIN, "--config", "ds_configs/llama65b.json"], 2, timeout=300, cwd=ROOT)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert out.count("model.path: '/path/to/llama-65b'") == 1, out[-3000:]
    assert "Repo id" not in out and "from_pretrained" not in out, out[-3000:]


class _RunsCode:
    """Unpickled, it writes a file: what a checkpoint from anywhere else could do at --resume."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def test_a_checkpoint_carrying_pickled_code_is_refused(tmp_path):
    """Resume reads the rank's state and its RNG file with weights_only: tensors, numbers, strings
    and containers load; a pickled callable is refused before it runs."""
    import pickle

    from lomo_ds.methods.base import load_rank_state, rank_state_file
    from lomo_ds.storage.checkpoint import _rng_file, read_rng, write_atomic

    marker = tmp_path / "ran"
    good = {"lomo": {"shards": {"w": torch.ones(3)}, "global_step": 4, "loss_scaler": None, "name": "x"}}
    write_atomic(rank_state_file(str(tmp_path), 0), lambda f: torch.save(good, f))
    assert load_rank_state(str(tmp_path), 0)["lomo"]["global_step"] == 4
    for path in (rank_state_file(str(tmp_path), 1), _rng_file(str(tmp_path), 1)):
        write_atomic(path, lambda f: torch.save({"lomo": {"evil": _RunsCode(str(marker))}}, f))
    with pytest.raises(pickle.UnpicklingError):
        load_rank_state(str(tmp_path), 1)
    with pytest.raises(pickle.UnpicklingError):
        read_rng(str(tmp_path), 1)  # as load_checkpoint reads it
    assert not marker.exists()


def test_one_rank_state_file_for_the_recipe_and_the_trainer(tmp_path):
    """Both write rank_NNNNN.pt as {"lomo": engine state}; the Trainer's old lomo_rank_NNNNN.pt
    (the engine's state alone) is read in that layout; a missing file names the one expected."""
    from lomo_ds.methods.base import OLD_TRAINER_STATE, load_rank_state, rank_state_file, save_rank_state

    engine_state = {"shards": {"w": torch.ones(3)}, "global_step": 4, "adalomo": None}
    save_rank_state(str(tmp_path), 0, {"lomo": engine_state})
    assert os.path.basename(rank_state_file(str(tmp_path), 0)) == "rank_00000.pt"
    assert load_rank_state(str(tmp_path), 0)["lomo"]["global_step"] == 4
    torch.save({**engine_state, "global_step": 6}, tmp_path / OLD_TRAINER_STATE.format(1))
    old = load_rank_state(str(tmp_path), 1)
    assert set(old) == {"lomo"} and old["lomo"]["global_step"] == 6
    assert torch.equal(old["lomo"]["shards"]["w"], torch.ones(3))
    with pytest.raises(FileNotFoundError, match="rank_00002.pt"):
        load_rank_state(str(tmp_path), 2)


SLOW_WRITE_S = 12  # each of rank 0's export files and checkpoint seals takes this long to write
SHORT_TIMEOUT_S = 8  # the collectives' timeout once the ranks are up: shorter than one write


# Seconds of deliberately slow writes in the 2-rank launch: a long check (CI, LOMO_DS_LONG_TESTS=1).
@multi_rank(worlds=[2] if LONG_TESTS else [])
def slow_io_run() -> dict:
    """The training program on the 2-rank launch, its collectives timing out after 8 s while each of
    rank 0's export files and checkpoint seals takes 12 s to write (tests/slow_io_run.py)."""
    from lomo_ds.recipe.train import main
    from tests.slow_io_run import slow_io

    root = pathlib.Path(work_dir()) / "slow_io"
    if torch.distributed.get_rank() == 0:
        write_tiny_run(root)
    torch.distributed.barrier()
    out = root / "run"
    with slow_io(SLOW_WRITE_S, SHORT_TIMEOUT_S):
        run = run_here(main, ["--config", str(root / "run.json"), "--output-dir", str(out), "--max-steps", "2",
                              "--set", "eval.at_end=false", "--set", "train.zero_shot_eval=false"])
    # After the run, a model the process builds is whole again, not partitioned with the run's config.
    from transformers import AutoModelForCausalLM

    after = AutoModelForCausalLM.from_config(tiny_llama_config())  # as tests/families.py builds its models
    return {"rc": run["rc"], "out": str(out), "built_whole_after": all(p.numel() > 0 for p in after.parameters())}


@pytest.mark.long
def test_slow_checkpoint_and_export_writes_outlast_the_collective_timeout(rank_results):
    """A 2-rank run whose collectives time out after 8 s, while each of rank 0's export files and
    checkpoint seals takes 12 s to write (a slow disk; a 65B export at 200 MB/s is 11 minutes): the
    other rank waits under output.io_timeout, the run finishes, and the export loads."""
    from transformers import AutoModelForCausalLM

    r = ok(rank_results(2), slow_io_run)
    out = pathlib.Path(r["out"])
    assert r["rc"] == 0
    assert r["built_whole_after"]  # the run released transformers' ZeRO-3 model-build config
    assert (out / "checkpoints" / "latest").read_text() == "step_00000002"
    assert AutoModelForCausalLM.from_pretrained(out / "hf_model") is not None
