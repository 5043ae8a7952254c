"""TrainingArguments(enable_jit_checkpoint=True) under LomoTrainerMixin: the training program's
preemption (lomo_ds/runtime/preemption.py) in the Trainer's loop.

transformers' own JIT checkpoint saves from a signal at the next callback, mid-window too, where
the shard accumulator holds part of a step that no checkpoint keeps. Here the ranks agree at each
optimizer step's end (on_step_end: the window is whole), the Trainer saves its checkpoint as for
save_steps, rank 0 writes the PREEMPTED marker naming it in the output folder (a requeue reads that,
not the launcher's exit status), and train() ends the process with PREEMPTED_EXIT once it has.
"""
from __future__ import annotations

import os

from transformers import TrainerCallback

from lomo_ds.runtime.preemption import Preemption

SIGNALS = ("SIGTERM", "SIGUSR1")


class PreemptionCallback(TrainerCallback):
    def __init__(self, signals=SIGNALS, deadline_s: float | None = None):
        self.signals, self.deadline_s = signals, deadline_s
        self.preemption: Preemption | None = None
        self.stopped_at: int | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        marker_dir = args.output_dir if state.is_world_process_zero else None
        self.preemption = Preemption(self.signals, self.deadline_s, marker_dir=marker_dir)

    def on_step_end(self, args, state, control, **kwargs):
        if self.preemption is not None and self.preemption.agreed():
            control.should_save = True  # the Trainer's own checkpoint, at this agreed boundary
            control.should_training_stop = True
            self.stopped_at = state.global_step
        return control

    def on_save(self, args, state, control, **kwargs):
        # Every rank, after the Trainer's save of the stop's step: the checkpoint is whole.
        if self.preemption is not None and self.stopped_at is not None:
            self.preemption.stopped(self.stopped_at, os.path.join(args.output_dir, f"checkpoint-{self.stopped_at}"))

    def on_train_end(self, args, state, control, **kwargs):
        if self.preemption is not None:
            self.preemption.restore()
            self.preemption = None
