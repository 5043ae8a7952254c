"""A job as SLURM runs one, on this machine, for tests and rehearsals of a batch script's
preemption: every process of the job is signalled (SLURM signals all the processes of a job step,
whatever their session), and what is left after the grace period (SLURM's KillWait) is SIGKILLed.

    python -m devkit.slurm_like --time-limit 600 --signal USR1@120 --kill-wait 30 -- CMD ARGS...

runs CMD (the batch script); at time-limit minus 120 s sends SIGUSR1 to every process below it
(`--signal=USR1@120` without `B:`: the steps, not the batch shell; `B:USR1@120`: the shell alone),
at the time limit SIGTERM to each process, KillWait later SIGKILL; exits with CMD's status (128 +
the signal's number if a signal ended it). Tests drive a Job themselves (signal_all, signal_steps,
end)."""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time

from devkit.launch_local import _descendants


class Job:
    """CMD started in a session of its own (as slurmstepd starts a step's tasks)."""

    def __init__(self, cmd: list[str], **popen):
        self.proc = subprocess.Popen(cmd, start_new_session=True, **popen)
        self._seen: set[int] = {self.proc.pid}

    def processes(self) -> list[int]:
        """The job's live processes: CMD, everything below it, and what was below a process of the
        job at an earlier call (SLURM's cgroup keeps them: a launcher killed outright leaves its ranks
        running, and torchrun's ranks run in sessions of their own, out of a process group's reach).
        Call it while the job runs, so that it learns them."""
        for pid in list(self._seen):
            self._seen.update(_descendants(pid))
        return [pid for pid in sorted(self._seen) if _alive(pid)]

    def signal_all(self, sig: int) -> None:
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def signal_steps(self, sig: int) -> None:
        """`--signal=SIG@N` without `B:`: the job steps' processes (all below the batch script), not
        the batch script's shell, which lives on (to requeue)."""
        for pid in self.processes():
            if pid != self.proc.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)

    def end(self, kill_wait: float) -> int:
        """SLURM's end of a job: SIGTERM to every process, SIGKILL to what is left `kill_wait`
        seconds later; CMD's exit status."""
        self.signal_all(signal.SIGTERM)
        return self.wait(kill_wait)

    def wait(self, grace: float) -> int:
        """CMD's exit status, once it and the processes below it are gone; what is left after
        `grace` seconds is SIGKILLed."""
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and (self.proc.poll() is None or self.processes()):
            time.sleep(0.1)
        if self.proc.poll() is None or self.processes():
            self.signal_all(signal.SIGKILL)
        rc = self.proc.wait()
        return 128 - rc if rc < 0 else rc


def _alive(pid: int) -> bool:
    """Running (not a zombie waiting for its parent to collect it: it does nothing more)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--time-limit", type=float, required=True, help="seconds the job may run")
    ap.add_argument("--signal", default=None, help="SIG@SECONDS: SIG to every process SECONDS before the limit")
    ap.add_argument("--kill-wait", type=float, default=30.0, help="seconds from SIGTERM to SIGKILL (KillWait)")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    job = Job(cmd)
    start = time.monotonic()
    if args.signal:
        name, _, before = args.signal.partition("@")
        at = start + args.time_limit - float(before or 60)
        while job.proc.poll() is None and time.monotonic() < at:
            job.processes()  # learnt while they run: a process orphaned later is still the job's
            time.sleep(0.1)
        shell_only = name.startswith("B:")
        name = name.removeprefix("B:")
        sig = getattr(signal, name if name.startswith("SIG") else f"SIG{name}")
        if job.proc.poll() is None:
            if shell_only:
                job.proc.send_signal(sig)
            else:
                job.signal_steps(sig)
    while job.proc.poll() is None and time.monotonic() < start + args.time_limit:
        job.processes()
        time.sleep(0.1)
    if job.proc.poll() is None:
        return job.end(args.kill_wait)
    return job.wait(args.kill_wait)


if __name__ == "__main__":
    sys.exit(main())
