"""Learning-rate schedules: a pure function of the step, so resuming needs only the step count."""
import math
from dataclasses import dataclass


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
