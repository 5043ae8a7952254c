"""The planner: the paper's Table 2 GPU counts and out-of-memory rows, the CLI, and agreement with
memory measured on small CPU runs of LomoEngine (1 and 2 ranks) within 10%."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from lomo_ds.cli import main
from lomo_ds.planner import GIB, LLAMA, ModelSpec, estimate, plan, resolve_model, run_spec

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# The measured model: LLaMA-style, odd sizes, model states comparable to activations.
TINY = dict(hidden=128, layers=4, intermediate=344, vocab=256, heads=4, kv_heads=2, head_dim=32)
SEQ, MICRO, BUCKET = 32, 2, 20_000
CASES = {  # name -> (DeepSpeed zero_optimization extras, activation checkpointing)
    "default": ({}, False),
    "ac_small_live": ({"stage3_max_live_parameters": 30_000, "stage3_max_reuse_distance": 30_000,
                       "stage3_prefetch_bucket_size": 0, "stage3_param_persistence_threshold": 1000}, True),
}


# ----------------------------------------------------------------------------- formulas
def test_llama_sizes_from_real_configs():
    counts = {k: m.n_params / 1e9 for k, m in LLAMA.items()}
    assert counts["7b"] == pytest.approx(6.74, abs=0.01)
    assert counts["13b"] == pytest.approx(13.02, abs=0.01)
    assert counts["30b"] == pytest.approx(32.53, abs=0.01)
    assert counts["65b"] == pytest.approx(65.29, abs=0.01)


def test_table2_gpu_counts_and_oom_rows():
    run = run_spec(seq=1024, batch=1, dtype="fp16", checkpointing=True)
    want_lomo = {"7b": 1, "13b": 2, "30b": 4, "65b": 8}
    for size, model in LLAMA.items():
        p = plan(model, 24, run)
        assert p.min_gpus["lomo"] == want_lomo[size], (size, p.min_gpus)
        # the paper's rows that ran on 8 GPUs, and the ones that ran out of memory there
        assert p.fits("adamw", 8) == (size == "7b"), size
        assert p.fits("sgd", 8) == (size in ("7b", "13b")), size


def test_table2_memory_close_to_paper():
    run = run_spec(seq=1024, batch=1, dtype="fp16", checkpointing=True)
    paper = {("7b", "adamw", 8): 15.76, ("7b", "sgd", 8): 9.49, ("7b", "lomo", 1): 13.61,
             ("13b", "sgd", 8): 15.74, ("13b", "lomo", 2): 15.92, ("30b", "lomo", 4): 19.78,
             ("65b", "lomo", 8): 19.18}
    for (size, method, n), gb in paper.items():
        got = estimate(LLAMA[size], method, n, run).total / GIB
        assert got == pytest.approx(gb, rel=0.12), (size, method, n, got)


def test_table1_model_states():
    # LLaMA-7B on one GPU, fp16: params 12.55, grads (LOMO) 0.24, SGD/AdamW optimizer states 25.10/75.31
    run = run_spec(seq=512, batch=8, dtype="fp16")
    lomo, sgd, adamw = (estimate(LLAMA["7b"], m, 1, run) for m in ("lomo", "sgd", "adamw"))
    assert lomo.params / GIB == pytest.approx(12.55, abs=0.01)
    assert lomo.grads / GIB == pytest.approx(0.24, abs=0.01)
    assert lomo.optimizer_states == 0
    assert sgd.optimizer_states / GIB == pytest.approx(25.10, abs=0.01)
    assert adamw.optimizer_states / GIB == pytest.approx(75.31, abs=0.02)


def test_checkpointing_shrinks_activations():
    m = LLAMA["7b"]
    off = estimate(m, "lomo", 1, run_spec(seq=512, batch=8))
    on = estimate(m, "lomo", 1, run_spec(seq=512, batch=8, checkpointing=True))
    assert on.activations < 0.1 * off.activations and on.recompute > 0


# ----------------------------------------------------------------------------- inputs and CLI
def test_resolve_hf_and_run_config(tmp_path):
    hf = {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 11008, "vocab_size": 32000,
          "num_attention_heads": 32}
    d = tmp_path / "llama7"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(hf))
    spec, over = resolve_model(str(d))
    assert spec.n_params == LLAMA["7b"].n_params and over == {}
    run = {"model": {"path": str(d), "gradient_checkpointing": True}, "tokenizer": {"max_length": 512},
           "bf16": {"enabled": True}, "lomo": {"bucket_size": 1000},
           "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e8}}
    (tmp_path / "run.json").write_text(json.dumps(run))
    spec, over = resolve_model(str(tmp_path / "run.json"))
    assert spec.n_params == LLAMA["7b"].n_params
    assert over == {"checkpointing": True, "seq": 512, "dtype": "bf16", "lomo_bucket": 1000, "max_live": 100_000_000}
    with pytest.raises(ValueError, match="expected one of"):
        resolve_model("17b")


def test_cli_plan(capsys):
    assert main(["plan", "--model", "13b", "--gpus", "8", "--gpu-mem", "24", "--seq", "1024", "--batch", "1",
                 "--dtype", "fp16", "--checkpointing"]) == 0
    out = capsys.readouterr().out
    assert "smallest GPU count for lomo: 2" in out
    assert "on 8 GPU(s): adamw" in out and "out of memory" in out
    assert main(["plan", "--model", "7b", "--json", "--checkpointing"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["min_gpus"]["lomo"] == 1
    assert main(["plan", "--model", "nonsense"]) == 2


# ----------------------------------------------------------------------------- measured runs
def _worker(out_path: str) -> None:
    sys.path.insert(0, ROOT)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lomo_ds.methods import build_engine
    from lomo_ds.run_config import load_run_config

    results = {}
    for name, (zero_extra, ac) in CASES.items():
        cfg = LlamaConfig(vocab_size=TINY["vocab"], hidden_size=TINY["hidden"], intermediate_size=TINY["intermediate"],
                          num_hidden_layers=TINY["layers"], num_attention_heads=TINY["heads"],
                          num_key_value_heads=TINY["kv_heads"], head_dim=TINY["head_dim"], max_position_embeddings=64,
                          tie_word_embeddings=False, attn_implementation="eager", use_cache=False)
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        ds = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 3, **zero_extra}}
        if ac:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
        run = load_run_config({**ds, "lomo": {"lr": 1e-3, "bucket_size": BUCKET}, "model": {"path": "tiny"}},
                              check_files=False)
        eng = build_engine(run, model, total_steps=0)
        eng.enable_memory_tracking()
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, TINY["vocab"], (MICRO, SEQ), generator=g)
        # The first step records DeepSpeed's module trace (no prefetch, no reuse); the second is
        # the steady state the planner predicts.
        eng.train_step({"input_ids": ids, "labels": ids.clone()})
        eng.reset_memory()
        eng.train_step({"input_ids": ids, "labels": ids.clone()})
        results[name] = {"world": eng.world, **eng.memory_breakdown(),
                         "tracker_total": eng.tracker.peak.total}
        del eng
    if torch.distributed.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def measured_runs(tmp_path_factory):
    """Both launches (1 and 2 ranks) run at the same time; each writes its JSON."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = {}
    for world in (1, 2):
        out = tmp_path_factory.mktemp(f"planner{world}") / "measured.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
               str(_free_port()), os.path.abspath(__file__), str(out)]
        procs[world] = (out, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              text=True, cwd=ROOT))
    results = {}
    for world, (out, proc) in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        if proc.returncode != 0 or not out.exists():
            pytest.fail(f"{world}-rank measured run failed (rc {proc.returncode}):\n{stdout[-3000:]}\n{stderr[-6000:]}")
        results[world] = json.loads(out.read_text())
    return results


@pytest.fixture(params=[1, 2], ids=["1rank", "2ranks"])
def measured(request, measured_runs):
    return request.param, measured_runs[request.param]


@pytest.mark.parametrize("case", list(CASES))
def test_planner_matches_measured_lomo(measured, case):
    world, results = measured
    r = results[case]
    assert r["world"] == world
    zero_extra, ac = CASES[case]
    keys = {"stage3_max_live_parameters": "max_live", "stage3_max_reuse_distance": "max_reuse",
            "stage3_prefetch_bucket_size": "prefetch", "stage3_param_persistence_threshold": "persistence"}
    run = run_spec(seq=SEQ, batch=MICRO, dtype="fp32", checkpointing=ac, lomo_bucket=BUCKET,
                   **{keys[k]: v for k, v in zero_extra.items()})
    spec = ModelSpec("tiny", TINY["hidden"], TINY["layers"], TINY["intermediate"], TINY["vocab"], TINY["heads"],
                     TINY["kv_heads"], TINY["head_dim"])
    est = estimate(spec, "lomo", world, run)
    detail = f"{case} on {world}: measured {r}, predicted {est.gib()}"
    assert r["params"] == pytest.approx(est.params, rel=0.10), detail
    assert r["activations"] == pytest.approx(est.activations, rel=0.10), detail
    assert r["total"] == pytest.approx(est.accounted, rel=0.10), detail


if __name__ == "__main__":
    _worker(sys.argv[1])
