"""The features a long run leans on, through the launchers users start them with, together: a
streamed mixture of three sources (data.sources, data.streaming), sequence parallelism (SP 2, sdpa)
with the tiled MLP and offloaded checkpoints, moved between rank counts and launchers as a
cluster's free GPUs come and go: `deepspeed` on 2 ranks (SP 2), torchrun on 3 (no SP: 3 ranks
cannot hold SP 2), `deepspeed` on 1. The global batch stays 6 rows a step, so each leg sees the
examples an uninterrupted one-rank run sees, and the moved run ends within fp32 rounding of it
(the legs sum gradients in other orders: over SP's slices, the MLP's tiles, 1-3 ranks).

A second check runs the Trainer path under `accelerate launch` (examples/sft_lomo.py on a tiny
model): the loss it logs falls. Launches of their own: long checks (LOMO_DS_LONG_TESTS=1, CI).
"""
from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from devkit.launch_local import free_port, rank_env, remove_shm_buffers, run_local
from tests.ranks import ROOT
from tests.recipe.test_mixture_train import write_mixture_runs
from tests.recipe.test_train import TRAIN_SCRIPT

pytestmark = [pytest.mark.ranks, pytest.mark.long]

GLOBAL_BATCH = 6
STEPS_PER_LEG = 2
TOL = 1e-5  # fp32, AdaLomo, 6 steps; gradients summed over slices, tiles and ranks in other orders
# A constant learning rate: a leg's --max-steps (where it stops) is not part of its schedule.
COMMON = ["--set", "lomo.optimizer=adalomo", "--set", "train.scheduler.type=constant",
          "--set", "train.scheduler.warmup_ratio=0", "--set", "eval.at_end=false",
          "--set", "output.checkpoint_every=null", "--set", "data.packing=false",
          "--set", "gradient_accumulation_steps=1", "--set", 'model.attn_implementation="sdpa"',
          # Each row weighs by its tokens wherever it lands: under "mean" a step's loss is the mean of
          # the ranks' micro-batch means, which another cut of the same rows into micro-batches changes.
          "--set", 'train.loss_normalization="tokens"']
LONG_ROWS = ["--set", "train.sequence_parallel_size=2", "--set", "memory.tiled_mlp=true",
             "--set", "memory.offload_checkpoints=true", "--set", "model.gradient_checkpointing=true"]


def _args(config: pathlib.Path, out: pathlib.Path, micro: int, max_steps: int, *extra) -> list[str]:
    return [*TRAIN_SCRIPT, "--config", str(config), "--output-dir", str(out), "--max-steps", str(max_steps),
            *COMMON, "--set", f"train_micro_batch_size_per_gpu={micro}", *extra]


def _deepspeed(args: list[str], world: int, log: pathlib.Path) -> str:
    port = free_port()
    cmd = ["deepspeed", "--num_gpus", str(world), "--master_port", str(port), *args]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env={**rank_env(world), "PYTHONPATH": ROOT}, capture_output=True,
                              text=True, timeout=900)
    finally:
        remove_shm_buffers(port)
    log.write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, \
        f"{' '.join(cmd)}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def _torchrun(args: list[str], world: int) -> str:
    proc = run_local(args, world, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def _losses(out: pathlib.Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_a_streamed_mixture_with_sp_and_long_row_options_moves_between_launchers_and_rank_counts(tmp_path):
    write_mixture_runs(tmp_path)
    config = tmp_path / "stream.json"
    total = 3 * STEPS_PER_LEG
    straight = tmp_path / "straight"
    _torchrun(_args(config, straight, GLOBAL_BATCH, total), 1)
    moved = tmp_path / "moved"
    # deepspeed, 2 ranks, SP 2 (one data-parallel replica: its micro-batch is the global batch)
    out = _deepspeed(_args(config, moved, GLOBAL_BATCH, STEPS_PER_LEG, *LONG_ROWS), 2, tmp_path / "leg1.log")
    # torchrun, 3 ranks, no SP
    out = _torchrun(_args(config, moved, GLOBAL_BATCH // 3, 2 * STEPS_PER_LEG, "--resume"), 3)
    assert f"at step {STEPS_PER_LEG}" in out, out[-2000:]
    # deepspeed, 1 rank
    out = _deepspeed(_args(config, moved, GLOBAL_BATCH, total, "--resume"), 1, tmp_path / "leg3.log")
    assert f"at step {2 * STEPS_PER_LEG}" in out, out[-2000:]
    a, b = _losses(straight), _losses(moved)
    assert sorted(a) == sorted(b) == list(range(1, total + 1)), (a, b)
    loss_gap = max(abs(a[s] - b[s]) for s in a)
    wa = load_file(straight / "hf_model" / "model.safetensors")
    wb = load_file(moved / "hf_model" / "model.safetensors")
    gap = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    start = load_file(tmp_path / "model" / "model.safetensors")
    moved_by = max((wa[k] - v).abs().max().item() for k, v in start.items() if k in wa)
    print(f"moved run against the straight one: weights {gap:.2e}, losses {loss_gap:.2e}; "
          f"training moved {moved_by:.2e}")
    assert gap <= TOL and loss_gap <= TOL, (gap, loss_gap)
    assert moved_by > 100 * TOL  # the comparison is of weights that trained


@pytest.mark.skipif(shutil.which("accelerate") is None, reason="accelerate's launcher is not installed")
def test_the_trainer_path_trains_under_accelerate_launch(tmp_path):
    from tests.helpers_data import chatml_tokenizer
    from tests.integrations.dist_dpo_checks import tiny_policy

    tok = chatml_tokenizer()
    model_dir = tmp_path / "model"
    tiny_policy(len(tok)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    port = free_port()
    # --multi_gpu: accelerate's torchrun path, which starts CPU ranks where there is no GPU (its --cpu
    # path with 2 processes wants MPI).
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port),
           "examples/sft_lomo.py", "--model", str(model_dir), "--max-steps", "6", "--lr", "0.05",
           "--output-dir", str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=ROOT, env={**rank_env(2), "PYTHONPATH": ROOT}, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    losses = [float(x.split("'loss': ")[1].split(",")[0].strip("'")) for x in proc.stdout.splitlines()
              if "'loss': " in x]
    assert len(losses) >= 2 and losses[-1] < losses[0], (losses, proc.stdout[-2000:])
