"""Preemption: a signal (SLURM's SIGTERM, a spot notice's SIGUSR1...) asks the run to stop at the next
optimizer-step boundary, checkpoint and exit with PREEMPTED_EXIT.

The step boundary, not the moment of the signal: mid-window the shard accumulator holds part of the
step, and it is not part of a checkpoint. The ranks agree at every boundary (an all-reduce of one
flag), so a signal that reached one rank stops all of them at the same step: a checkpoint is a
collective.

A second signal, or the deadline after the first (output.preempt_deadline_s), ends the process at
once with UNSAVED_EXIT. Checkpoints are sealed by a rename only once whole
(lomo_ds/storage/checkpoint.py), so whatever was being written is never taken for one: the last
whole checkpoint remains `latest`.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable, Sequence

import torch

from lomo_ds.runtime import ds_compat
from lomo_ds.runtime.device import group_device

PREEMPTED_EXIT = 75  # EX_TEMPFAIL, "try again": checkpointed at a step boundary; requeue and --resume
UNSAVED_EXIT = 76  # stopped by a second signal or the deadline: resume from the last whole checkpoint


class Preempted(Exception):
    """Raised out of the training loop once every rank has checkpointed after a signal."""

    def __init__(self, step: int):
        super().__init__(f"preempted after step {step}")
        self.step = step


def _say_on_rank0(msg: str) -> None:
    # Every rank is usually signalled: one line, not one per rank.
    if os.environ.get("RANK", "0") == "0":
        print(msg, flush=True)


class Preemption:
    """The signal handlers of a run and the flag they set."""

    def __init__(self, signals: Sequence[str], deadline_s: float | None,
                 say: Callable[[str], None] | None = None, exit_now: Callable[[int], None] = os._exit):
        self.signals = tuple(signals)
        self.deadline_s = deadline_s
        self.say = say or _say_on_rank0
        self.exit_now = exit_now  # os._exit: no cleanup that could wait on a peer or finish a write
        self.requested_at: float | None = None
        self._previous = {}
        for name in self.signals:
            self._previous[name] = signal.signal(getattr(signal, name), self._on_signal)

    @property
    def enabled(self) -> bool:
        return bool(self.signals)

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested_at is not None:
            self.say(f"{name} again: stopping now; the last whole checkpoint is the one to resume from")
            self.exit_now(UNSAVED_EXIT)
            return
        self.requested_at = time.monotonic()
        self.say(f"{name}: stopping after this optimizer step with a checkpoint")
        if self.deadline_s is not None:
            timer = threading.Timer(self.deadline_s, self._deadline)
            timer.daemon = True  # never keeps a finished run alive
            timer.start()

    def _deadline(self) -> None:
        self.say(f"preemption deadline ({self.deadline_s:g} s) passed: stopping now; the last whole "
                 f"checkpoint is the one to resume from")
        self.exit_now(UNSAVED_EXIT)

    def agreed(self) -> bool:
        """Collective: whether any rank has been signalled (every rank gets the same answer)."""
        if not self.enabled:
            return False
        mine = self.requested_at is not None
        if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
            return mine
        flag = torch.tensor([int(mine)], dtype=torch.int32, device=group_device())
        ds_compat.all_reduce(flag, name="preemption flag", op="max")
        return bool(flag.item())

    def restore(self) -> None:
        """The handlers that were there before (a library caller's own)."""
        for name, previous in self._previous.items():
            signal.signal(getattr(signal, name), previous)
        self._previous = {}
