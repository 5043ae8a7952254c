"""Learning-rate schedules: a pure function of the step, so resuming needs only the step count."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lomo_ds.config.engine_config import EngineConfig


@dataclass(frozen=True)
class Schedule:
    kind: str  # "constant" | "linear" | "cosine"
    base_lr: float
    total_steps: int = 0
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0

    def lr_at(self, step: int) -> float:
        """Learning rate for the update numbered `step` (0-based)."""
        if self.kind == "constant":
            if self.warmup_steps and step < self.warmup_steps:
                return self.base_lr * (step + 1) / self.warmup_steps
            return self.base_lr
        if self.warmup_steps and step < self.warmup_steps:
            return self.base_lr * (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        if self.kind == "linear":
            factor = 1.0 - progress
        else:  # cosine
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.base_lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * factor)


def schedule_of(config: EngineConfig, total_steps: int | None) -> Schedule:
    """The schedule train.scheduler describes for lomo.lr; `total_steps`, when given, wins over its
    total_steps."""
    s = config.train.scheduler
    total = s.total_steps if total_steps is None else total_steps
    if total < 0:
        raise ValueError(f"total_steps: expected >= 0, got {total}")
    if s.type != "constant" and total <= 0:
        raise ValueError(f"train.scheduler.total_steps: a {s.type} schedule needs the total step count "
                         f"(or pass total_steps= to the engine)")
    warmup = s.warmup_steps or int(round(s.warmup_ratio * total))
    return Schedule(s.type, config.lomo.lr, total, warmup, s.min_lr_ratio)
