"""A user's own Trainer script, whose process group accelerate starts (TrainingArguments, or
`accelerate launch`), never runs lomo_ds.init_distributed; importing the mixin must still keep
DeepSpeed's CPU backend from building its shared-memory all-reduce op, which lomo_ds never uses and
a CPU compiles for minutes on its first run (tests/integrations/trainer_process_group_script.py).

Reverts checked (2 CPU ranks, 2026-12-07): without the import-time ds_compat.skip_shm_allreduce_op
in lomo_ds/integrations/transformers.py, both ranks stop at "DeepSpeed's comm backend is building
its shared-memory all-reduce op (deepspeed.ops.comm.deepspeed_shm_comm_op), which the Trainer path
must skip" (the launch fails); with it, both report a TorchBackend without the op.

Long checks (CI): each starts two ranks of its own and trains a step.
"""
import json
import os
import subprocess
import sys

import pytest

from tests.ranks import ROOT, launch

SCRIPT = os.path.join("tests", "integrations", "trainer_process_group_script.py")
pytestmark = [pytest.mark.ranks, pytest.mark.long]


def _reports(stdout: str) -> list[dict]:
    """Each rank's JSON report: the ranks share the launcher's stdout, so one's line may run into
    another's (`...}{"rank": 0, ...`); each report is one write, read whole wherever it starts."""
    decoder, found, at = json.JSONDecoder(), [], stdout.find('{"rank"')
    while at != -1:
        report, end = decoder.raw_decode(stdout, at)
        found.append(report)
        at = stdout.find('{"rank"', end)
    return sorted(found, key=lambda r: r["rank"])


def _assert_no_shm_op(reports: list[dict], output: str) -> None:
    assert [r["rank"] for r in reports] == [0, 1], output[-4000:]
    for r in reports:
        assert r["world"] == 2 and r["group_started_by"] == "accelerate", r
        assert r["deepspeed_backend"] == "TorchBackend" and not r["shm_op"], r


def test_a_trainer_script_under_torchrun_starts_deepspeed_without_its_shm_op(tmp_path):
    proc = launch([SCRIPT, str(tmp_path)], 2, timeout=600)
    _assert_no_shm_op(_reports(proc.stdout), proc.stdout + proc.stderr)


def test_a_trainer_script_under_accelerate_launch_starts_deepspeed_without_its_shm_op(tmp_path):
    """`accelerate launch` with two processes: on a machine without GPUs its torchrun-based
    launcher (--multi_gpu) starts CPU ranks (its --cpu launcher starts one process without MPI)."""
    pytest.importorskip("accelerate.commands.launch")
    from devkit.launch_local import free_port, kill_launch, rank_env

    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()), SCRIPT, str(tmp_path)]
    proc = subprocess.Popen(command, env=rank_env(2, cpu=True, env={"HF_HUB_OFFLINE": "1"}), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        kill_launch(proc)
        out, err = proc.communicate()
    assert proc.returncode == 0, f"accelerate launch failed ({proc.returncode}):\n{out[-4000:]}\n{err[-8000:]}"
    _assert_no_shm_op(_reports(out), out + err)
