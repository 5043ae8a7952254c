"""Preemption under the launchers users run (lomo_ds/runtime/preemption.py, docs/cluster.md): the
real `deepspeed` command (its runner, DeepSpeed's launch.py, the ranks), torchrun, and a job as
SLURM runs one (devkit/slurm_like.py: every process of the job signalled). The signal goes to one
rank, to the launcher, or to every process of the job (SLURM's end of a job; with `deepspeed` the
whole process group); the documented route for a long notice, SIGUSR1 to the ranks while the
launcher ignores it (examples/slurm_preempt.sbatch), is a case of its own.

Each case: every rank exits 75 (tests/rank_status_run.py writes each rank's status), the stop's
checkpoint is whole and `latest`, the PREEMPTED marker names it, and the run resumed from it ends
with the uninterrupted run's weights. Where the job's signal reaches a rank twice (directly and
through its launcher), rank 0's checkpoint seal is slowed so that the copy lands during the write:
a copy is the same request, not the user's second signal. Launches of their own: long checks
(LOMO_DS_LONG_TESTS=1, as CI runs them).
"""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import time

import psutil
import pytest
from safetensors.torch import load_file

from devkit.launch_local import free_port, rank_env, remove_shm_buffers, run_local, torchrun_command
from devkit.slurm_like import Job
from lomo_ds.runtime.preemption import MARKER, PREEMPTED_EXIT
from tests.ranks import ROOT
from tests.recipe.test_train import TRAIN_SCRIPT, logged_steps, write_tiny_run

pytestmark = [pytest.mark.ranks, pytest.mark.long]

STEPS = 12
SIGNAL_AFTER = 2  # steps logged before the signal goes
SLOW_SEAL_S = 3  # where a copy of the signal must land during the checkpoint's write (well within 30 s)


def _args(base: pathlib.Path, out: pathlib.Path, *extra) -> list[str]:
    return ["--config", str(base / "run.json"), "--output-dir", str(out), "--max-steps", str(STEPS),
            "--set", "output.checkpoint_every=100", "--set", "eval.at_end=false", *extra]


def tiny_and_straight(base: pathlib.Path, cpu: bool = True) -> pathlib.Path:
    """The tiny run's config under `base`, and its uninterrupted run (torchrun, 2 ranks; on 2 GPUs
    where `cpu` is False)."""
    write_tiny_run(base)
    proc = run_local([*TRAIN_SCRIPT, *_args(base, base / "straight")], 2, timeout=900, cpu=cpu, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return base


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_and_straight(tmp_path_factory.mktemp("launcher_preemption"))


def _command(launcher: str, program: list[str], port: int, ignore_usr1: bool) -> list[str]:
    if launcher == "deepspeed":
        cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(port), "--module", *program]
    else:
        cmd = torchrun_command(["-m", *program], 2, port)
    if ignore_usr1:  # as examples/slurm_preempt.sbatch starts the launcher: SIGUSR1 is for the ranks
        cmd = ["bash", "-c", "trap '' USR1; exec \"$@\"", "bash", *cmd]
    return cmd


def _ranks(job: Job) -> dict[int, int]:
    out = {}
    for pid in job.processes():
        try:
            rank = psutil.Process(pid).environ().get("RANK")
        except psutil.Error:
            continue
        if rank is not None and "rank_status_run" in " ".join(psutil.Process(pid).cmdline()):
            out[int(rank)] = pid
    return out


def _launcher(job: Job, launcher: str) -> int:
    """The process that starts and signals the ranks: DeepSpeed's launch.py (the `deepspeed`
    runner's child), or torchrun itself."""
    for pid in job.processes():
        with_args = " ".join(psutil.Process(pid).cmdline())
        if launcher == "deepspeed" and "deepspeed.launcher.launch" in with_args:
            return pid
        if launcher == "torchrun" and "torch.distributed.run" in with_args:
            return pid
    raise AssertionError(f"no {launcher} process among {job.processes()}")


def _send(job: Job, launcher: str, target: str) -> None:
    if target == "rank":
        os.kill(_ranks(job)[1], signal.SIGTERM)
    elif target == "launcher":
        os.kill(_launcher(job, launcher), signal.SIGTERM)
    elif target == "job":  # SLURM's end of a job: every process, the launcher's forward comes on top
        job.signal_all(signal.SIGTERM)
    elif target == "group":  # a terminal's or a wrapper's signal to the process group (`deepspeed` keeps one)
        os.killpg(job.proc.pid, signal.SIGTERM)
    elif target == "usr1":  # `--signal=USR1@N` without B: every process; the launcher ignores it
        job.signal_all(signal.SIGUSR1)


CASES = [
    ("deepspeed", "rank"), ("deepspeed", "launcher"), ("deepspeed", "group"), ("deepspeed", "usr1"),
    ("torchrun", "rank"), ("torchrun", "launcher"), ("torchrun", "job"), ("torchrun", "usr1"),
]


def preempted_under(launcher: str, target: str, base: pathlib.Path, tmp_path: pathlib.Path,
                    cpu: bool = True) -> dict:
    """The run of `base` started by `launcher` on 2 ranks (2 GPUs where `cpu` is False), signalled at
    `target` after step SIGNAL_AFTER, then resumed by torchrun: what each rank exited with, the
    marker, the checkpoints left, and the resumed run's largest difference from the straight one."""
    out, status = tmp_path / "run", tmp_path / "status"
    status.mkdir()
    slow = SLOW_SEAL_S if target in ("job", "group") else 0
    program = ["tests.rank_status_run", str(status), str(slow), *_args(base, out)]
    port = free_port()
    env = {**rank_env(2, cpu=cpu), "PYTHONPATH": ROOT}
    with open(tmp_path / "launch.log", "w") as log:
        job = Job(_command(launcher, program, port, target == "usr1"), cwd=ROOT, env=env, stdout=log,
                  stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 600
            while SIGNAL_AFTER not in logged_steps(out):
                assert job.proc.poll() is None and time.monotonic() < deadline, "the run ended before the signal"
                job.processes()  # learnt while they run, as SLURM's cgroup knows them
                time.sleep(0.05)
            sent = time.monotonic()
            _send(job, launcher, target)
            rc = job.wait(120)  # past every launcher's own SIGKILL (30 s)
            took = time.monotonic() - sent
        finally:
            job.signal_all(signal.SIGKILL)
            remove_shm_buffers(port)
    log = (tmp_path / "launch.log").read_text()
    statuses = {p.name: json.loads(p.read_text())["status"] for p in status.glob("rank_*.json")}
    print(f"{launcher}, SIGTERM/USR1 to the {target}: launcher exit {rc}, ranks {statuses}, {took:.1f} s")
    assert statuses == {"rank_0.json": PREEMPTED_EXIT, "rank_1.json": PREEMPTED_EXIT}, log[-6000:]
    marker = json.loads((out / MARKER).read_text())
    ckpts = out / "checkpoints"
    found = {"marker": marker, "latest": (ckpts / "latest").read_text(),
             "meta": (ckpts / f"step_{marker['step']:08d}" / "meta.json").exists(),
             "partials": [n for n in os.listdir(ckpts) if n.endswith(".partial")]}
    resumed = run_local([*TRAIN_SCRIPT, *_args(base, out), "--resume"], 2, timeout=900, cpu=cpu, cwd=ROOT)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    a = load_file(base / "straight" / "hf_model" / "model.safetensors")
    b = load_file(out / "hf_model" / "model.safetensors")
    assert a.keys() == b.keys()
    return {**found, "resumed_at_step": f"at step {marker['step']}" in resumed.stdout,
            "marker_after_resume": (out / MARKER).exists(), "max_abs_diff": max((a[k] - b[k]).abs().max().item()
                                                                               for k in a), "checkpoints": str(ckpts)}


def assert_preempted(r: dict, tol: float = 0.0) -> None:
    """preempted_under's figures: a whole checkpoint of the stopped step is `latest`, the marker
    names it, the resumed run went on from it and left no marker, and ended within `tol` of the
    uninterrupted run (0: the same bits on CPU ranks)."""
    marker, step = r["marker"], r["marker"]["step"]
    assert marker["exit"] == PREEMPTED_EXIT and SIGNAL_AFTER <= step < STEPS, marker
    name = f"step_{step:08d}"
    assert r["latest"] == name and marker["checkpoint"] == os.path.join(r["checkpoints"], name), r
    assert r["meta"] and not r["partials"], r
    assert r["resumed_at_step"] and not r["marker_after_resume"], r  # a finished run leaves nothing to requeue
    assert r["max_abs_diff"] <= tol, r


@pytest.mark.parametrize("launcher,target", CASES)
def test_every_rank_exits_75_with_a_whole_checkpoint_whatever_the_launcher(tiny, tmp_path, launcher, target):
    assert_preempted(preempted_under(launcher, target, tiny, tmp_path))


def test_the_sbatch_example_requeues_on_the_marker_and_the_requeued_job_finishes(tiny, tmp_path):
    """examples/slurm_preempt.sbatch as SLURM runs it (devkit/slurm_like.py; `srun` runs its command,
    `scontrol` records what it is asked): SIGUSR1 to the job step's processes (not the batch shell)
    mid-run; the launcher ignores it, the ranks stop with a checkpoint, the script reads the marker
    and requeues the job. The requeued job resumes, finishes with the uninterrupted weights, and
    does not requeue."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\nexec "$@"\n')
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    out, port = tmp_path / "run", free_port()
    env = {**rank_env(2), "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": ROOT, "SLURM_JOB_ID": "4242",
           "CONFIG": str(tiny / "run.json"), "OUT": str(out), "GPUS": "2", "MASTER_PORT": str(port)}
    extra = ["--max-steps", str(STEPS), "--set", "output.checkpoint_every=100", "--set", "eval.at_end=false"]

    def job(signalled: bool, log_name: str) -> int:
        with open(tmp_path / log_name, "w") as log:
            job = Job(["bash", os.path.join(ROOT, "examples", "slurm_preempt.sbatch"), *extra], cwd=ROOT, env=env,
                      stdout=log, stderr=subprocess.STDOUT)
            try:
                deadline = time.monotonic() + 600
                while signalled and SIGNAL_AFTER not in logged_steps(out):
                    assert job.proc.poll() is None and time.monotonic() < deadline, "ended before the signal"
                    time.sleep(0.05)
                if signalled:
                    job.signal_steps(signal.SIGUSR1)
                return job.wait(600)
            finally:
                job.signal_all(signal.SIGKILL)
                remove_shm_buffers(port)

    rc = job(True, "first.log")
    log = (tmp_path / "first.log").read_text()
    assert rc == 0 and (tmp_path / "scontrol.log").read_text() == "requeue 4242\n", log[-6000:]
    marker = json.loads((out / MARKER).read_text())
    assert marker["exit"] == PREEMPTED_EXIT and SIGNAL_AFTER <= marker["step"] < STEPS, marker
    assert (out / "checkpoints" / "latest").read_text() == f"step_{marker['step']:08d}"
    print(f"sbatch example: SIGUSR1 to the step after step {SIGNAL_AFTER}; stopped after step {marker['step']}, "
          f"requeued")
    rc = job(False, "requeued.log")
    log = (tmp_path / "requeued.log").read_text()
    assert rc == 0 and f"at step {marker['step']}" in log, log[-6000:]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"  # not requeued again
    assert not (out / MARKER).exists()
    a = load_file(tiny / "straight" / "hf_model" / "model.safetensors")
    b = load_file(out / "hf_model" / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0


@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_a_setup_error_ends_the_job_at_once_whatever_the_launcher(tiny, tmp_path, launcher):
    """A setup error on every rank (here a resume from a checkpoint whose meta.json is not JSON):
    rank 0 says why and exits 2, and the launcher stops the others, which wait in stop_every_rank
    so that rank 0's message is printed first. That wait must end at the launcher's SIGTERM: with
    the preemption handlers still installed it would be taken as a request to stop after the step,
    the rank would sleep on, and the job would end only at the launcher's SIGKILL, 30 s later."""
    out, status = tmp_path / "run", tmp_path / "status"
    status.mkdir()
    bad = out / "checkpoints" / "step_00000002"
    bad.mkdir(parents=True)
    (bad / "meta.json").write_text("not json")
    (out / "checkpoints" / "latest").write_text(bad.name)
    program = ["tests.rank_status_run", str(status), "0", *_args(tiny, out), "--resume"]
    port = free_port()
    env = {**rank_env(2), "PYTHONPATH": ROOT}
    with open(tmp_path / "launch.log", "w") as log:
        job = Job(_command(launcher, program, port, False), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            rc = job.wait(300)
            ended = time.time()
        finally:
            job.signal_all(signal.SIGKILL)
            remove_shm_buffers(port)
    log = (tmp_path / "launch.log").read_text()
    rank0 = json.loads((status / "rank_0.json").read_text())
    after = ended - rank0["time"]
    print(f"{launcher}: launcher exit {rc}, rank 0 exit {rank0['status']}, the job ended {after:.1f} s after rank 0")
    assert rc != 0 and rank0["status"] == 2, log[-4000:]
    assert "checkpoint error:" in log, log[-4000:]
    assert after < 15, f"the job ended {after:.1f} s after rank 0's exit (the launcher's SIGKILL comes at 30 s)"
