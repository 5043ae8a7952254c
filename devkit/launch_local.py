"""Start a program on N ranks of this machine (torch.distributed.run), the way the tests, benchmarks
and experiments do (not shipped in the package: nothing in it launches this way): one free port,
LOCAL_SIZE as DeepSpeed's launcher sets it, the cores split between CPU ranks, and DeepSpeed's
/dev/shm all-reduce buffers removed after the launch whatever its end.

    proc = run_local(["launch/train.py", "--config", "c.json"], nproc=2, timeout=600)
    proc = run_local(["-m", "experiments.table2", "--worker"], nproc=2, timeout=600)   # a module
"""
from __future__ import annotations

import contextlib
import glob
import os
import signal
import socket
import subprocess
import sys
from typing import Iterator

ADDR = "127.0.0.1"


def free_port() -> int:
    """A TCP port no process listens on now (the launch's rendezvous)."""
    with socket.socket() as s:
        s.bind((ADDR, 0))
        return s.getsockname()[1]


def rank_env(nproc: int, cpu: bool = True, env: dict | None = None) -> dict[str, str]:
    """The environment of `nproc` local ranks: os.environ, then `env`, then what the launch needs."""
    out = {**os.environ, **(env or {})}
    # LOCAL_SIZE as DeepSpeed's own launcher sets it (torch.distributed.run sets only LOCAL_WORLD_SIZE):
    # without it DeepSpeed's CPU accelerator runs `numactl --hardware` in a subprocess on every
    # device_count() call, i.e. on every reduce-scatter bucket of its ZeRO-3 optimizer; with it the
    # launch starts as a `deepspeed` one does (lomo's shared_memory transport under "auto").
    out["LOCAL_SIZE"] = str(nproc)
    out.setdefault("PYTHONUNBUFFERED", "1")
    if cpu:
        # Ranks on a few cores: the cores split between them, or they fight over every core (a
        # caller's own figure in `env` wins).
        out["OMP_NUM_THREADS"] = (env or {}).get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // nproc))
        out.setdefault("CUDA_VISIBLE_DEVICES", "")
    return out


def as_deepspeed_launched() -> None:
    """In a rank started by plain torch.distributed.run: LOCAL_SIZE as DeepSpeed's launcher would set
    it (see rank_env), before DeepSpeed starts."""
    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))


def torchrun_command(program: list[str], nproc: int, port: int) -> list[str]:
    """`program` (a script and its arguments, or "-m", a module and its arguments) on `nproc` ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", ADDR,
            "--master_port", str(port), *program]


def remove_shm_buffers(port: int) -> None:
    """DeepSpeed's shared-memory all-reduce buffers of the launch on `port`, which it never removes:
    lomo_ds.init_distributed starts DeepSpeed without them (ds_compat.skip_shm_allreduce_op), but a
    program whose process group something else starts (accelerate, for a Trainer) still maps them."""
    for leftover in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{ADDR}_{port}_*"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(leftover)


def _descendants(pid: int) -> list[int]:
    """The processes below `pid` now (Linux /proc; none elsewhere)."""
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_launch(proc: subprocess.Popen) -> None:
    """SIGKILL the launch and its ranks: torch.distributed.run starts each rank in a session of its
    own, so killing the launcher's process group alone would leave the ranks running, holding the
    output pipes open (communicate() would then wait forever)."""
    ranks = _descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def local_ranks(program: list[str], nproc: int, cpu: bool = True, env: dict | None = None,
                cwd: str | None = None, **popen) -> Iterator[subprocess.Popen]:
    """The running launch (a Popen of torch.distributed.run); its /dev/shm leftovers go on exit."""
    port = free_port()
    # Its own process group, so that ending it early (a timeout, an error in the caller) ends the ranks too.
    proc = subprocess.Popen(torchrun_command(program, nproc, port), env=rank_env(nproc, cpu, env), cwd=cwd,
                            start_new_session=True, **popen)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            kill_launch(proc)
        proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream:
                stream.close()
        remove_shm_buffers(port)


def run_local(program: list[str], nproc: int, timeout: float, cpu: bool = True, env: dict | None = None,
              cwd: str | None = None, capture: bool = True, **popen) -> subprocess.CompletedProcess:
    """Run the launch to its end, as subprocess.run does (text output captured unless `capture` is
    False; raises subprocess.TimeoutExpired after killing it)."""
    if capture:
        popen.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with local_ranks(program, nproc, cpu, env, cwd, **popen) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_launch(proc)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
