"""The end of a window of micro-batches: its step taken, or skipped on every rank, and counted.

A window whose last backward applied the update (a window of one, or the fused K-th micro-batch)
only ends the step here. One that only accumulated is applied here, as one pass over this rank's
accumulated shards after the exact global norm of the sum (one all-reduce) has been learnt. A
window with something non-finite anywhere, or no label on any rank, is skipped on every rank at
once; after lomo.max_consecutive_skips skipped steps in a row the run stops.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lomo_ds.engine.update import PassSettings
from lomo_ds.engine.window import Window
from lomo_ds.runtime import ds_compat


def clipped(total_sq: float, clip_norm: float | None) -> tuple[float, float]:
    """The global norm from the agreed sum of squares (inf where it is not finite), and what the
    update's grad_scale is multiplied by: min(1, clip_norm / (norm + 1e-6)) as torch's
    clip_grad_norm_, or 1 without norm clipping."""
    norm = math.sqrt(total_sq) if math.isfinite(total_sq) else math.inf
    if clip_norm is None or not math.isfinite(norm):
        return norm, 1.0
    return norm, min(1.0, clip_norm / (norm + 1e-6))


@dataclass
class StepCounters:
    """The optimizer steps taken (skipped ones included: the schedule moves on), skipped, and
    skipped in a row; part of the resumable state."""

    global_step: int = 0
    skipped_steps: int = 0
    consecutive_skips: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"global_step": self.global_step, "skipped_steps": self.skipped_steps,
                "consecutive_skips": self.consecutive_skips}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_step = state["global_step"]
        self.skipped_steps = state["skipped_steps"]
        self.consecutive_skips = state.get("consecutive_skips", 0)


class WindowCloser:
    """Closes one engine's windows. Handed what a step's end touches: the run's `config`, the
    `params` and their `updater`, the window's `accumulator` (None for windows of one), the
    `buckets` (their shared layout and spans), the host `staging`, the step's agreements
    (`step_sums`), the `loss_scaler` (or None), the loss's `weights`, ZeRO-3's `offload` and the
    `counters` it advances."""

    def __init__(self, config, params, updater, accumulator, buckets, staging, step_sums, loss_scaler, weights,
                 offload, counters: StepCounters):
        self.config, self.params, self.updater, self.accumulator = config, params, updater, accumulator
        self.buckets, self.staging, self.step_sums = buckets, staging, step_sums
        self.loss_scaler, self.weights, self.offload, self.counters = loss_scaler, weights, offload, counters

    def settings(self, lr: float, grad_scale: float) -> PassSettings:
        """An updating pass's settings, the run's clipping by value and weight decay included."""
        return PassSettings(lr=lr, grad_scale=grad_scale, clip_value=self.config.train.clip_grad_value,
                            weight_decay=self.config.lomo.weight_decay)

    def close(self, window: Window, length: int, result: dict[str, Any], applied: bool) -> dict[str, Any]:
        """The window's last micro-batch (of `length`) is in: apply the step from the accumulated
        gradient (or, `applied` in its backward, it is applied already), or skip it on every rank."""
        if window.nonfinite or not window.backwards:
            # A non-finite loss or gradient in any micro-batch (or no labels in the whole window):
            # the whole step is skipped on every rank, once.
            self.zero_accumulator()
            return self.skip(result, overflow=window.nonfinite)
        result["normalizer"] = self.weights.normalizer(length, window.tokens) * (window.per_token or 1.0)
        if not applied:
            grad_scale = 1.0 / (result["normalizer"] * result["loss_scale"])
            # Exact global norm of the accumulated gradient: per-rank sums of squares, one all-reduce.
            norm_sq = (self.accumulator.sum_of_squares(self.params) * grad_scale**2).reshape(1)
            (total,) = self.step_sums.sum(norm_sq, "squared norm")
            result["grad_norm"], clip = clipped(total, self.config.train.clip_grad_norm)
            if not math.isfinite(result["grad_norm"]):
                self.accumulator.zero()  # overflow in some micro-batch on some rank: no parameter touched
                return self.skip(result, overflow=True)
            self.apply_accumulated(self.settings(result["lr"], grad_scale * clip))
        self.zero_accumulator()
        return self.stepped(result)

    def zero_accumulator(self) -> None:
        if self.accumulator is not None:  # a window of one accumulates nothing
            self.accumulator.zero()

    def apply_accumulated(self, settings: PassSettings) -> None:
        """The update as one pass over this rank's accumulated shards, bucket by bucket in the
        layout every rank shares (so per-bucket collectives, AdaLomo's, come in one order)."""
        stats = self.updater.begin_pass(settings, measure=False, step=self.counters.global_step)
        groups = getattr(self.buckets, "layout", None) or [[p] for p in self.params]
        # AdaLomo hands the host part of its host-memory shards to the worker: done before the
        # step ends and the next forward gathers them.
        with self.staging.joined():
            for group in groups:
                with self.buckets.timers.span("update"):
                    self.updater.apply_bucket([(p, self.accumulator.lazy_total(p, self.updater.slice_device(p)))
                                               for p in group], stats)

    def stepped(self, result: dict[str, Any]) -> dict[str, Any]:
        """End a step that was applied."""
        self.end_step()
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow=False)
        self.counters.consecutive_skips = 0
        self.counters.global_step += 1
        return result

    def skip(self, result: dict[str, Any], overflow: bool) -> dict[str, Any]:
        """End a step every rank skips; stop the run when skipping has become the rule."""
        self.end_step()
        if self.loss_scaler is not None and overflow:
            self.loss_scaler.update(overflow=True)
        counters = self.counters
        counters.skipped_steps += 1
        counters.consecutive_skips += 1
        counters.global_step += 1
        result["skipped"] = True
        if counters.consecutive_skips >= self.config.lomo.max_consecutive_skips:
            scale = f", loss scale {self.loss_scaler.scale}" if self.loss_scaler is not None else ""
            raise RuntimeError(f"lomo.max_consecutive_skips: the last {counters.consecutive_skips} steps were all "
                               f"skipped (non-finite loss or gradients, or no labelled tokens on any rank{scale}), "
                               f"{counters.global_step} steps into the run; lower lomo.lr, check the data, or raise "
                               "the limit")
        return result

    def end_step(self) -> None:
        # The last bucket's update (the embeddings and first layer: what the next forward gathers
        # first) was queued on the compute stream; DeepSpeed gathers on its own stream.
        ds_compat.gathers_wait_for_updates(self.offload)
        # Every parameter goes back to its shard, persistent ones included, so the next forward
        # gathers each from its updated shard (a gathered copy kept across an update is stale).
        ds_compat.release_all(self.offload)
        for p in self.params:
            p.grad = None
