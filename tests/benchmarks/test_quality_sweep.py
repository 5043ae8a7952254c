"""experiments/quality.py's plumbing, no training: every run it would launch is a valid run config,
the coordinate search and the stages pick what they say, --reuse/--max-runs run pieces, and the
table written from result files (hand-made here, for the writer only) says what the runs gave."""
from __future__ import annotations

import dataclasses
import importlib
import os
import re
from types import SimpleNamespace

import pytest
import yaml

from lomo_ds.config.run import load_run_config
from tests.module_help import help_text

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def quality():
    return importlib.import_module("experiments.quality")


@pytest.fixture(scope="module")
def hp(quality):
    return quality.table3.load_hparams(quality.HPARAMS)


def _every_stage1_setting(quality, hp, method):
    base = hp["methods"][method]["base"]
    return [base] + [{**base, **v} for variants in quality.axes_of(hp, method).values() for v in variants]


@pytest.mark.parametrize("method", ["lomo", "adalomo", "adamw", "lora", "lora_lomo"])
def test_every_run_is_a_valid_run_config(quality, hp, method):
    for setting in _every_stage1_setting(quality, hp, method):
        for run in quality.stage1_runs_of(hp, method, setting):
            o = quality.overrides_of(run, hp, hp["ranks"], "/tmp/x")
            cfg = load_run_config(os.path.join(ROOT, hp["config"]), o, check_files=False)
            assert cfg.data.task == "spelling" and cfg.eval.split == "validation" and cfg.data.eval_samples == 500
            assert cfg.micro_batch * hp["ranks"] == 8 and cfg.train.max_steps == run.max_steps
            assert cfg.tokenizer.max_length == 96 and cfg.train.seed == 42
            assert cfg.train.method == ("lomo" if method == "adalomo" else method)
            if method in ("lomo", "adalomo", "lora_lomo"):  # named by every cell: not the config's default
                assert cfg.lomo.optimizer == ("adalomo" if method == "adalomo" else "sgd")
            assert cfg.train.clip_grad_norm == setting.get("clip_grad_norm", 1.0)
            assert cfg.train.clip_grad_value == setting.get("clip_grad_value")
            assert cfg.train.scheduler.type == setting.get("schedule", "linear")
            if method in ("lomo", "adalomo"):
                assert cfg.lomo.lr == setting["lr"] and cfg.train.scheduler.warmup_ratio == setting["warmup_ratio"]
            elif method == "lora_lomo":
                assert cfg.lomo.lr == setting["lomo.lr"] and cfg.train.optimizer_lr == setting["lora.lr"]
                assert cfg.train.lora.targets == ("q_proj", "v_proj")
            else:
                assert cfg.train.optimizer_lr == setting["lr"]
            if run.accumulation > 1:  # equal steps, and equal tokens: max_steps / K steps of K micro-batches
                assert cfg.train.accumulation_steps == run.accumulation
                assert quality.tokens_of(run, hp) in (100 * 8 * run.accumulation, 100 * 8)


def test_heldout_runs_and_zero_shot(quality, hp):
    best = quality.Run(1, "lomo", quality.freeze({"lr": 0.3, "warmup_ratio": 0.0}), "spelling", 42, "validation", 100)
    runs = [r for r, _ in quality.stage2(hp, "lomo", best, lambda r: None)]
    assert {(r.task, r.seed) for r in runs} == {(t, s) for t in hp["tasks"] for s in hp["shared"]["seeds"]}
    assert all(r.split == "heldout" and r.setting == best.setting and r.stage == 2 for r in runs)
    cfg = load_run_config(os.path.join(ROOT, hp["config"]), quality.overrides_of(runs[-1], hp, 2, "/tmp/x"))
    assert cfg.eval.split == "heldout" and cfg.data.task == "syllables" and cfg.lomo.lr == 0.3
    multiple = quality.step_multiples(hp)
    assert [r.max_steps for r in runs] == [100 * multiple[r.task] for r in runs]
    assert cfg.train.max_steps == 100 * multiple["syllables"]
    # a K = 4 run chosen at equal tokens (25 steps) keeps equal tokens on every task
    k4 = dataclasses.replace(best, setting=quality.freeze({"lr": 0.3, "accumulation_steps": 4}), max_steps=25)
    assert all(quality.tokens_of(r, hp) == quality.tokens_of(dataclasses.replace(r, setting=best.setting,
                                                                                  max_steps=100 * multiple[r.task]), hp)
               for r, _ in quality.stage2(hp, "lomo", k4, lambda r: None))
    zs = [r for r, _ in quality.stage2(hp, "zero_shot", None, lambda r: None)]
    assert [r.task for r in zs] == hp["tasks"] and len({r.seed for r in zs}) == 1  # the seed changes nothing
    zs_cfg = load_run_config(os.path.join(ROOT, hp["config"]), quality.overrides_of(zs[0], hp, 2, "/x"))
    assert zs_cfg.train.zero_shot_eval and zs_cfg.train.method == "zero_shot"


def test_an_also_setting_must_be_a_mapping(quality, hp):
    bad = {**hp, "methods": {**hp["methods"], "lomo": {**hp["methods"]["lomo"], "also": {"shipped": 0.1}}}}
    with pytest.raises(ValueError, match=re.escape("methods.lomo.also.shipped: expected a mapping of setting keys")):
        quality.also_of(bad, "lomo")


@pytest.mark.parametrize("bad, message", [({"wordle": 2}, "unknown task 'wordle'"),
                                          ({"valence": 0}, "step_multiple.valence: expected a whole number >= 1"),
                                          ({"valence": 1.5}, "step_multiple.valence: expected a whole number >= 1")])
def test_step_multiple_is_checked(quality, hp, bad, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        quality.step_multiples({**hp, "step_multiple": bad})


def test_coordinate_search_moves_from_the_best_and_stops_at_an_unfinished_run(quality):
    hp = {"tune_task": "valence", "shared": {"seeds": [1, 2], "max_steps": 10, "global_batch": 8},
          "methods": {"lomo": {"base": {"lr": 0.1, "schedule": "linear"},
                               "axes": {"lr": [0.01, 0.1, 1.0],
                                        "clip": [{"clip_grad_norm": None, "clip_grad_value": 1.0}],
                                        "schedule": ["linear", "cosine"]}}}}
    score = {0.01: 60.0, 0.1: 70.0, 1.0: 80.0}

    def runner(run):
        s = run.settings
        assert run.task == "valence" and run.seed == 1 and run.split == "validation"
        return {"accuracy": score[s["lr"]] + (5 if s.get("schedule") == "cosine" else 0), "minutes": 1.0}

    search = quality.stage1(hp, "lomo", runner)
    tried = [r.settings for r, _ in search.tried]
    assert tried[0] == {"lr": 0.1, "schedule": "linear"}
    assert [s["lr"] for s in tried[1:3]] == [0.01, 1.0]  # 0.1 again is the base run, not run twice
    assert tried[3] == {"lr": 1.0, "schedule": "linear", "clip_grad_norm": None, "clip_grad_value": 1.0}
    assert tried[4] == {"lr": 1.0, "schedule": "cosine"}  # from the best so far (lr 1.0, which the clip tied)
    assert search.complete and search.best[0].settings == {"lr": 1.0, "schedule": "cosine"}
    partial = quality.stage1(hp, "lomo", lambda run: None if run.settings["lr"] == 1.0 else runner(run))
    assert not partial.complete and len(partial.tried) == 3  # the clip axis needs the lr axis's best


def test_the_accumulation_axis_runs_k_1_once(quality):
    """K = 1 is the best setting so far: named or not, one run (it once ran again under a new name)."""
    hp = {"tune_task": "valence", "shared": {"seeds": [1], "max_steps": 100, "global_batch": 8},
          "methods": {"lomo": {"base": {"lr": 0.1}, "axes": {"accumulation_steps": [1, 4]}}}}
    search = quality.stage1(hp, "lomo", lambda run: {"accuracy": 50.0, "minutes": 1.0})
    assert [(r.settings, r.max_steps) for r, _ in search.tried] == [
        ({"lr": 0.1}, 100), ({"lr": 0.1, "accumulation_steps": 4}, 100), ({"lr": 0.1, "accumulation_steps": 4}, 25)]


@pytest.mark.parametrize("k4_equal_tokens, chosen", [(60.0, ({"lr": 0.1}, 100)),
                                                      (75.0, ({"lr": 0.1, "accumulation_steps": 4}, 25))])
def test_a_run_with_k_times_the_tokens_is_never_chosen(quality, hp, k4_equal_tokens, chosen):
    """K = 4 at equal optimizer steps sees 4 times AdamW's examples: shown, never stage 2's recipe;
    K = 4 at equal tokens competes like any other setting."""
    small = {"tune_task": "valence", "shared": {"seeds": [1], "max_steps": 100, "global_batch": 8},
             "methods": {"lomo": {"base": {"lr": 0.1}, "axes": {"accumulation_steps": [1, 4]}}}}

    def runner(run):
        acc = {1: 70.0, 4: 90.0 if run.max_steps == 100 else k4_equal_tokens}[run.accumulation]
        return {"accuracy": acc, "minutes": 1.0}

    search = quality.stage1(small, "lomo", runner)
    assert (search.best[0].settings, search.best[0].max_steps) == chosen
    text = "\n".join(quality.stage1_table({"lomo": search}, {**hp, **small}))
    assert "| 90.0 (4x the tokens: not chosen) |" in text


def _args(tmp_path, **kw):
    return SimpleNamespace(**{"runs_dir": str(tmp_path / "runs"), "reuse": True, "max_runs": 0, "dry_run": False,
                              "extra_overrides": {}, "timeout": 1, "ledger": str(tmp_path / "ledger.jsonl"), **kw})


def _finish(quality, hp, runner, run, accuracy, split=None):
    """A result file as table3.record_run writes it for a finished run of `run`."""
    out_dir = os.path.join(runner.a.runs_dir, run.name)
    os.makedirs(out_dir, exist_ok=True)
    key = "zero_shot_accuracy" if run.method == "zero_shot" else "final_accuracy"
    quality.table3.record_run(out_dir, runner.config, quality.overrides_of(run, hp, runner.nproc, out_dir),
                              {"rc": 0, "minutes": 2.0, "steps": run.max_steps, key: accuracy / 100,
                               "eval_split": split or run.split})


def test_reuse_and_pieces(quality, hp, tmp_path, capsys):
    run = quality.stage1_runs_of(hp, "adamw", hp["methods"]["adamw"]["base"])[0]
    runner = quality.Runner(hp, _args(tmp_path), {(1, "adamw")})
    assert runner(run) is None and runner.missing == [run]  # --max-runs 0: nothing starts
    _finish(quality, hp, runner, run, 81.0)
    assert quality.Runner(hp, _args(tmp_path), {(1, "adamw")})(run)["accuracy"] == pytest.approx(81.0)
    assert quality.Runner(hp, _args(tmp_path, reuse=False), set())(run)["accuracy"] == pytest.approx(81.0)
    # without --reuse a runnable finished run runs again (dry run: its command is printed instead)
    again = quality.Runner(hp, _args(tmp_path, reuse=False, max_runs=None, dry_run=True), {(1, "adamw")})
    assert again(run) is None and again.started == 1 and "launch/train.py" in capsys.readouterr().out
    # another override (a smoke test's --set) is another run
    other = quality.Runner(hp, _args(tmp_path, extra_overrides={"train.max_steps": 2}), {(1, "adamw")})
    assert other(run) is None
    _finish(quality, hp, runner, run, 81.0, split="heldout")
    with pytest.raises(RuntimeError, match="evaluated on 'heldout', expected 'validation'"):
        runner(run)


def test_the_ledger_carries_finished_runs_to_another_machine(quality, hp, tmp_path, monkeypatch):
    """runs/ stays on the machine that ran it; the committed ledger is what a fresh clone resumes from."""
    run = quality.stage1_runs_of(hp, "adamw", hp["methods"]["adamw"]["base"])[0]
    launched = []

    def fake_train(program, nproc, cpu, out_dir, timeout):  # the launch itself is table3's, tested there
        launched.append(out_dir)
        os.makedirs(out_dir, exist_ok=True)
        return {"rc": 1 if "fails" in out_dir else 0, "minutes": 3.0, "final_accuracy": 0.8,
                "eval_split": "validation"}

    monkeypatch.setattr(quality.table3, "run_train", fake_train)
    here = quality.Runner(hp, _args(tmp_path, max_runs=None), {(1, "adamw")})
    assert here(run)["accuracy"] == pytest.approx(80.0) and len(launched) == 1
    # another machine: another runs directory (and checkout), the same ledger: nothing runs again
    there = quality.Runner(hp, _args(tmp_path, max_runs=None, runs_dir=str(tmp_path / "elsewhere")), {(1, "adamw")})
    assert there(run)["accuracy"] == pytest.approx(80.0) and len(launched) == 1
    [rec] = quality.Ledger(str(tmp_path / "ledger.jsonl")).entries.values()
    assert rec["run"] == run.name and rec["config"] == hp["config"] and "output.dir" not in rec["overrides"]
    # a smoke run (--set extras) is another run, and not the sweep's: it runs and is not recorded
    smoke = quality.Runner(hp, _args(tmp_path, max_runs=None, runs_dir=str(tmp_path / "third"),
                                     extra_overrides={"train.max_steps": 2}), {(1, "adamw")})
    assert smoke(run)["accuracy"] == pytest.approx(80.0) and len(launched) == 2
    # a failed run is not recorded either
    failing = quality.Runner(hp, _args(tmp_path, max_runs=None, runs_dir=str(tmp_path / "fails")), {(1, "adamw")})
    other = quality.stage1_runs_of(hp, "adamw", {**hp["methods"]["adamw"]["base"], "lr": 1e-3})[0]
    assert failing(other) is None and len(launched) == 3
    assert len((tmp_path / "ledger.jsonl").read_text().splitlines()) == 1
    assert there(run)["accuracy"] == pytest.approx(80.0)
    (tmp_path / "ledger.jsonl").write_text((tmp_path / "ledger.jsonl").read_text() + "not json\n")
    with pytest.raises(ValueError, match=re.escape("ledger.jsonl:2: expected a JSON object with a 'run' key")):
        quality.Ledger(str(tmp_path / "ledger.jsonl"))


def test_the_committed_ledger_rebuilds_the_committed_table(quality, tmp_path):
    """A fresh clone has no runs/: the sweep's tables in RESULTS.md, rewritten from the committed
    ledger alone, come out row for row as committed (only the date, command and count lines differ)."""
    results = tmp_path / "RESULTS.md"
    results.write_text(open(quality.RESULTS_MD, encoding="utf-8").read())
    assert quality.main(["--stage", "2", "--reuse", "--max-runs", "0", "--runs-dir", str(tmp_path / "runs"),
                         "--results", str(results)]) == 0

    def rows(text):
        section = text.split(quality.BEGIN, 1)[1].split(quality.END, 1)[0]
        return [line for line in section.splitlines() if line.startswith(("|", "- "))]

    committed, rebuilt = rows(open(quality.RESULTS_MD, encoding="utf-8").read()), rows(results.read_text())
    assert len(committed) > 40 and "not run yet" not in "\n".join(committed)
    assert rebuilt == committed


def test_table_from_finished_runs(quality, hp, tmp_path, monkeypatch):
    monkeypatch.setattr(quality, "accumulation_available", lambda: False)
    hp = {**hp, "step_multiple": {"syllables": 2}}  # one task run longer in stage 2
    # A recipe stage 2 runs beside LOMO's best: a row of its own, not the one the goals judge.
    lomo_hp = {**hp["methods"]["lomo"], "also": {"shipped": {**hp["methods"]["lomo"]["base"], "lr": 0.05}}}
    hp = {**hp, "methods": {**hp["methods"], "lomo": lomo_hp}}
    hparams = tmp_path / "quality.yaml"
    hparams.write_text(yaml.safe_dump(hp))
    runner = quality.Runner(hp, _args(tmp_path), set())
    # stage 1: every method's base setting best (the axes' other values score lower)
    for method in ("lomo", "adalomo", "adamw", "lora", "lora_lomo"):
        base = hp["methods"][method]["base"]
        for setting in _every_stage1_setting(quality, hp, method):
            for run in quality.stage1_runs_of(hp, method, setting):
                _finish(quality, hp, runner, run, 70.0 if setting == base else 60.0)
    seeds = hp["shared"]["seeds"]
    accs = {"lomo": [80, 82, 84], "adamw": [85, 86, 90], "adalomo": [88, 89, 90]}  # per seed, every task
    for method, per_seed in accs.items():
        best = quality.stage1_runs_of(hp, method, hp["methods"][method]["base"])[0]
        for run, _ in quality.stage2(hp, method, best, lambda r: None):
            _finish(quality, hp, runner, run, per_seed[seeds.index(run.seed)] + hp["tasks"].index(run.task))
    for run, _ in quality.stage2(hp, "zero_shot", None, lambda r: None):
        _finish(quality, hp, runner, run, 50.0)
    [(label, shipped)] = quality.also_of(hp, "lomo")
    assert (label, shipped.settings["lr"], shipped.max_steps) == ("shipped", 0.05, 100)
    for run, _ in quality.stage2(hp, "lomo", shipped, lambda r: None):
        _finish(quality, hp, runner, run, 95.0)
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\nHand-written notes.\n")
    argv = ["--stage", "2", "--reuse", "--max-runs", "0", "--runs-dir", str(tmp_path / "runs"),
            "--results", str(results), "--hparams", str(hparams), "--ledger", str(tmp_path / "ledger.jsonl")]
    assert quality.main(argv) == 0
    assert quality.main(argv) == 0  # rewritten in place, not appended twice
    text = results.read_text()
    assert text.startswith("# Results\n\nHand-written notes.\n") and text.count(quality.BEGIN) == 1
    assert "--stage 2 --reuse --max-runs 0" in text and "at commit " in text
    lines = text.splitlines()
    row = next(line for line in lines if line.startswith("| LOMO |") and "| 9/9 |" in line)
    assert "lr=0.1" in row and "clip_grad_norm=1" in row and "| 100 | 800 | 9/9 |" in row
    assert "Syllables's runs take 2 times the steps and tokens shown" in text
    # 9 runs: mean of (80, 82, 84) + (0, 1, 2) = 83.0, minimum 80.0; Valence's seeds 80 82 84
    assert "| 9/9 | 83.0 | 80.0 | 82.0 (min 80.0; 80.0 82.0 84.0) |" in row
    assert any(line.startswith("| Zero-shot | - | 0 | 0 | 3/3 | 50.0 | 50.0 |") for line in lines)
    assert any(line.startswith("| AdamW | lr=3e-05, warmup_ratio=0.1 | 100 | 800 | **70.0** |") for line in lines)
    also = next(line for line in lines if line.startswith("| LOMO (shipped) |"))
    assert "lr=0.05" in also and "| 9/9 | 95.0 | 95.0 |" in also
    assert "- LOMO 83.0 against AdamW 88.0 -2: NOT met" in text and "- AdaLomo 90.0 against AdamW 88.0: met" in text
    assert not any("LoRA+LOMO | lomo" in line and "| 9/9 |" in line for line in lines)  # stage 2 not run: no row


def test_makefile_target_and_help():
    with open(os.path.join(ROOT, "Makefile")) as f:
        make = f.read()
    assert "quality-cpu:" in make and "-m experiments.quality --stage 1" in make
    out = help_text("experiments.quality")
    assert "--max-runs" in out and "--reuse" in out, out
