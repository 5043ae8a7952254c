"""Preemption: a signal (SLURM's SIGTERM, a spot notice's SIGUSR1...) asks the run to stop at the next
optimizer-step boundary, checkpoint and exit with PREEMPTED_EXIT.

The step boundary, not the moment of the signal: mid-window the shard accumulator holds part of the
step, and it is not part of a checkpoint. The ranks agree at every boundary (an all-reduce of one
flag), so a signal that reached one rank stops all of them at the same step: a checkpoint is a
collective.

One request, many copies. A signal to the whole job (SLURM signals every process of the step)
reaches a rank directly and again through its launcher, which forwards what it gets (DeepSpeed's
launch.py one rank after another, torchrun all at once). The rule: a repeat within
REPEAT_WINDOW_S seconds of the first signal is the same request and changes nothing; a repeat
after that is the user's second signal and ends the process at once with UNSAVED_EXIT, as does
the deadline after the first (output.preempt_deadline_s). Once the stop's checkpoint is whole, any
of the signals ends the process with PREEMPTED_EXIT at once (launch.py forwards to a later rank
only after the earlier ones have exited: by then there is nothing left to lose). The window is
by time, not by sender: Python's handlers do not see a signal's sender, and a forward and a
direct copy of the same request arrive within a launcher's reaction time of each other.

The decision runs on a watcher thread woken through signal.set_wakeup_fd, not in a Python signal
handler: a handler runs only on the main thread between bytecodes, so a main thread blocked in a C
call (a collective waiting on a dead peer) would never see the second signal.

Checkpoints are sealed by a rename only once whole (lomo_ds/storage/checkpoint.py), so whatever
was being written is never taken for one: the last whole checkpoint remains `latest`.

The requeue decision does not rest on the launcher's exit status (launch.py exits 1 when it is
signalled, torchrun always 1): rank 0 writes MARKER (JSON: the exit status, the step and the
checkpoint to resume from) in the run's output folder when it stops on a signal, atomically; a run
that starts removes a previous one's.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Callable, Sequence

PREEMPTED_EXIT = 75  # EX_TEMPFAIL, "try again": checkpointed at a step boundary; requeue and --resume
UNSAVED_EXIT = 76  # stopped by a second signal or the deadline: resume from the last whole checkpoint
# A repeat of the signal within this many seconds of the first is a copy of the same request (a
# launcher forwarding the signal the job got), not the user's second signal.
REPEAT_WINDOW_S = 10.0
MARKER = "PREEMPTED"  # in the run's output folder: the job was stopped by a signal; requeue it


class Preempted(Exception):
    """Raised out of the training loop once every rank has checkpointed after a signal."""

    def __init__(self, step: int):
        super().__init__(f"preempted after step {step}")
        self.step = step


def _say_on_rank0(msg: str) -> None:
    # Every rank is usually signalled: one line, not one per rank.
    if os.environ.get("RANK", "0") == "0":
        print(msg, flush=True)


def exit_process(code: int) -> None:
    """End the process now: no cleanup that could wait on a peer or finish a write."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or redirected stream must not keep the process alive
            pass
    os._exit(code)  # looked up now: a test's wrapper records the status


def write_marker(output_dir: str, status: int, step: int | None, checkpoint: str | None) -> None:
    """MARKER in `output_dir`, written whole or not at all (a rename)."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, MARKER)
    with open(f"{path}.tmp", "w") as f:
        json.dump({"exit": status, "step": step, "checkpoint": checkpoint}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(f"{path}.tmp", path)


def read_marker(output_dir: str) -> dict | None:
    path = os.path.join(output_dir, MARKER)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


class Preemption:
    """The signal handlers of a run, the flag they set, and the watcher that acts on repeats.

    `marker_dir`: where MARKER goes (rank 0's output folder; None on the other ranks)."""

    def __init__(self, signals: Sequence[str], deadline_s: float | None,
                 say: Callable[[str], None] | None = None, exit_now: Callable[[int], None] | None = None,
                 repeat_window_s: float = REPEAT_WINDOW_S, marker_dir: str | None = None):
        self.signals = tuple(signals)
        self.deadline_s = deadline_s
        self.repeat_window_s = repeat_window_s
        self.say = say or _say_on_rank0
        self.exit_now = exit_now or exit_process
        self.marker_dir = marker_dir
        self.requested_at: float | None = None
        self.saved = False  # the stop's checkpoint is whole: a signal now exits PREEMPTED_EXIT
        self._lock = threading.Lock()
        self._previous = {}
        self._numbers = {int(getattr(signal, name)) for name in self.signals}
        if marker_dir is not None and os.path.exists(os.path.join(marker_dir, MARKER)):
            os.remove(os.path.join(marker_dir, MARKER))  # a previous run's: this one decides anew
        self._wake_r = self._wake_w = -1
        self._previous_wakeup = -1
        self._seen = 0  # signals the watcher has acted on
        self._timer: threading.Timer | None = None
        if self.signals:
            self._start_watcher()
        for name in self.signals:
            self._previous[name] = signal.signal(getattr(signal, name), self._flag)

    @property
    def enabled(self) -> bool:
        return bool(self.signals)

    def _start_watcher(self) -> None:
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        # The C-level handler writes the signal's number here from whichever thread the signal
        # lands on, at once; the main thread may be blocked in C for as long as a collective waits.
        self._previous_wakeup = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(self._wake_r, self._previous_wakeup),
                         name="lomo_ds-preemption", daemon=True).start()

    def _watch(self, fd: int, forward_to: int) -> None:
        while True:
            try:
                data = os.read(fd, 64)
            except OSError:
                return
            if not data:
                os.close(fd)
                return
            if forward_to >= 0:  # whoever had the wakeup fd before still hears of its signals
                try:
                    os.write(forward_to, data)
                except OSError:
                    pass
            for signum in data:
                if signum in self._numbers:
                    self.on_signal(signum)

    def on_signal(self, signum: int) -> None:
        """One signal: the first asks for the stop; the rest as the module's rule says."""
        name = signal.Signals(signum).name
        with self._lock:  # the marker's write and `saved` are one step for this decision
            now = time.monotonic()
            if self.saved:
                self.exit_now(PREEMPTED_EXIT)
                return
            self._seen += 1
            if self._seen == 1:
                self.requested_at = self.requested_at or now  # _flag may have been first
                self.say(f"{name}: stopping after this optimizer step with a checkpoint")
                if self.deadline_s is not None:
                    self._timer = threading.Timer(self.deadline_s, self._deadline)
                    self._timer.daemon = True  # never keeps a finished run alive
                    self._timer.start()
                return
            if now - self.requested_at < self.repeat_window_s:
                return  # a copy of the same request (a launcher forwarding it)
            self.say(f"{name} again: stopping now; the last whole checkpoint is the one to resume from")
            self._unsaved_exit()

    def _flag(self, signum, frame) -> None:
        """The Python-level handler (main thread, between bytecodes): the request's flag only, so
        that a step boundary right after it sees it; the watcher does the rest (no lock here: the
        main thread may hold it)."""
        if self.requested_at is None:
            self.requested_at = time.monotonic()

    def _deadline(self) -> None:
        with self._lock:
            if self.saved:
                self.exit_now(PREEMPTED_EXIT)
                return
            self.say(f"preemption deadline ({self.deadline_s:g} s) passed: stopping now; the last whole "
                     f"checkpoint is the one to resume from")
            self._unsaved_exit()

    def _unsaved_exit(self) -> None:
        if self.marker_dir is not None:
            write_marker(self.marker_dir, UNSAVED_EXIT, None, None)
        self.exit_now(UNSAVED_EXIT)

    def agreed(self) -> bool:
        """Collective: whether any rank has been signalled (every rank gets the same answer)."""
        if not self.enabled:
            return False
        mine = self.requested_at is not None
        import torch

        if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
            return mine
        from lomo_ds.runtime import ds_compat
        from lomo_ds.runtime.device import group_device

        flag = torch.tensor([int(mine)], dtype=torch.int32, device=group_device())
        ds_compat.all_reduce(flag, name="preemption flag", op="max")
        return bool(flag.item())

    def stopped(self, step: int, checkpoint: str | None) -> None:
        """Every rank, once the stop's checkpoint is whole: the marker (rank 0), and from now on a
        signal ends the process with PREEMPTED_EXIT."""
        with self._lock:
            if self.marker_dir is not None:
                write_marker(self.marker_dir, PREEMPTED_EXIT, step, checkpoint)
            self.saved = True

    def restore(self) -> None:
        """The handlers that were there before (a library caller's own). After a stop whose checkpoint
        is whole, a signal whose action was to end the process ends it with PREEMPTED_EXIT instead:
        a launcher's forward landing in the process's last moments must not turn 75 into 143."""
        for name, previous in self._previous.items():
            if self.saved and previous in (signal.SIG_DFL, None):
                previous = _exit_preempted
            signal.signal(getattr(signal, name), previous)
        self._previous = {}
        if self._timer is not None:  # the run is over: its deadline must not end a library caller
            self._timer.cancel()
        if self._wake_w >= 0:
            signal.set_wakeup_fd(self._previous_wakeup)
            os.close(self._wake_w)  # the watcher reads its end, then closes it
            self._wake_w = -1


def _exit_preempted(signum, frame) -> None:
    exit_process(PREEMPTED_EXIT)
