"""Every baseline method runs on 2 ranks behind LomoEngine's interface, with a sane memory breakdown.

One multi-rank launch (this file run as a script) runs all the checks and writes a JSON file the
tests below read.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
METHODS = ["adamw", "sgd", "lora", "lora_lomo", "lomo", "zero_shot"]
BUCKET = 2000  # LOMO reduce-scatter bucket (elements)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- the worker
def _worker(out_path: str) -> None:
    sys.path.insert(0, ROOT)
    sys.path.insert(0, HERE)
    import torch

    from lomo_ds.baselines import build_engine
    from lomo_ds.memory import model_state_bytes
    from tiny import global_batch, tiny_llama

    results = {}
    ds_config = {"train_micro_batch_size_per_gpu": 2,
                 "zero_optimization": {"stage": 3, "reduce_bucket_size": 5000,
                                       "stage3_prefetch_bucket_size": 0}}
    opts = {"adamw": {"lr": 1e-3}, "sgd": {"lr": 0.1}, "lora": {}, "lora_lomo": {},
            "lomo": {}, "zero_shot": {}}
    for method in METHODS:
        torch.manual_seed(0)
        model = tiny_llama(seed=0, layers=2, hidden=48)
        n_params = sum(p.numel() for p in model.parameters())
        lomo_cfg = {"lr": 0.05 if method == "lomo" else 1e-3, "bucket_size": BUCKET}
        eng = build_engine(model, ds_config, method, lomo_cfg=lomo_cfg, **opts[method])
        world, rank = eng.world, eng.rank
        batch = global_batch(0, world)[rank]
        before_state = eng.full_state_dict()
        with torch.no_grad():
            loss0 = eng.eval_forward(batch).loss.item()
        eng.enable_memory_tracking()
        steps = [eng.train_step(batch) for _ in range(2)]
        mem = eng.memory_breakdown()
        with torch.no_grad():
            loss1 = eng.eval_forward(batch).loss.item()
        after_state = eng.full_state_dict()
        changed = {}
        if rank == 0:
            for name, t in before_state.items():
                changed[name] = bool((after_state[name].float() - t.float()).abs().max().item() > 0)
        results[method] = {
            "world": world, "loss_before": loss0, "loss_after": loss1,
            "steps": [{k: v for k, v in s.items() if k in ("loss", "lr", "grad_norm", "skipped", "loss_scale")}
                      for s in steps],
            "global_step": eng.global_step, "memory": mem, "n_params": n_params,
            "changed": changed, "fp32_param_bytes": n_params * 4,
        }
        del eng
    if torch.distributed.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


# ----------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("baselines") / "results.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), os.path.abspath(__file__), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"2-rank baseline run failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


@pytest.mark.parametrize("method", METHODS)
def test_interface_and_steps(results, method):
    r = results[method]
    assert r["world"] == 2
    assert r["global_step"] == 2
    for s in r["steps"]:
        assert set(s) == {"loss", "lr", "grad_norm", "skipped", "loss_scale"}
        assert s["loss"] == s["loss"] and s["loss"] > 0


@pytest.mark.parametrize("method", ["adamw", "sgd", "lora", "lora_lomo", "lomo"])
def test_training_lowers_the_loss(results, method):
    r = results[method]
    assert r["loss_after"] < r["loss_before"], r
    assert not any(s["skipped"] for s in r["steps"])


def test_which_parameters_change(results):
    full = results["adamw"]["changed"]
    assert all(full.values())
    assert all(results["lomo"]["changed"].values())
    lora = results["lora"]["changed"]
    assert any("lora_B" in n and c for n, c in lora.items())
    assert not any(c for n, c in lora.items() if "lora_" not in n), "LoRA must leave the base frozen"
    both = results["lora_lomo"]["changed"]
    assert any("lora_B" in n and c for n, c in both.items())
    assert any("q_proj.base_layer" in n and c for n, c in both.items()), "LOMO must update the base weights"
    assert not any(results["zero_shot"]["changed"].values())
    assert results["zero_shot"]["loss_before"] == pytest.approx(results["zero_shot"]["loss_after"])


def test_memory_breakdown_categories(results):
    for method, r in results.items():
        m = r["memory"]
        assert m["total"] == m["params"] + m["grads"] + m["optimizer_states"] + m["activations"], method
        assert m["params"] > 0 and m["peak_rss"] > m["total"], method
    shard = results["adamw"]["fp32_param_bytes"] / 2  # fp32 model, 2 ranks
    adamw, sgd, lomo = (results[k]["memory"] for k in ("adamw", "sgd", "lomo"))
    # DeepSpeed keeps a separate fp32 master partition (even for an fp32 model) + AdamW's two moments
    assert adamw["optimizer_states"] == pytest.approx(3 * shard, rel=0.02)
    assert sgd["optimizer_states"] == pytest.approx(shard, rel=0.02)  # master only: no momentum
    # DeepSpeed keeps a gradient shard buffer for the whole model (+ its buckets)
    assert adamw["grads"] >= shard
    # LOMO: no optimizer state, gradients bounded by the bucket (+ one parameter's gradient)
    assert lomo["optimizer_states"] == 0
    assert 0 < lomo["grads"] < 0.5 * shard
    assert lomo["activations"] > 0 and lomo["activations"] == pytest.approx(adamw["activations"], rel=0.05)
    assert results["zero_shot"]["memory"]["grads"] == 0
    assert results["lora"]["memory"]["optimizer_states"] < 0.05 * adamw["optimizer_states"]
    assert lomo["total"] < sgd["total"] < adamw["total"]


if __name__ == "__main__":
    _worker(sys.argv[1])
