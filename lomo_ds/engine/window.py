"""What the engine keeps about one window of micro-batches (an optimizer step): the agreed loss of
each micro-batch, and what the reduced slices of a backward are for."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import NamedTuple


class BucketMode(enum.Enum):
    """What the buckets' reduced slices are for in a backward."""

    UPDATE = "update"  # apply them
    ADD = "add"  # into the accumulator (micro-batches 1..K-1 of a window)
    FOLD = "fold"  # add, then apply the accumulated sum (the fused K-th micro-batch)


class Agreed(NamedTuple):
    """One micro-batch's loss as every rank agreed on it before the backward."""

    loss: float  # mean over the ranks with labels
    token_loss: float  # summed over every label token of every rank
    tokens: float  # label tokens of every rank
    nonfinite: bool
    unlabelled: bool  # no rank has a label

    def report(self, normalization: str) -> float:
        if normalization == "tokens" and not (self.nonfinite or self.unlabelled):
            return self.token_loss / self.tokens
        return self.loss


@dataclass
class Window:
    """What a window of micro-batches has seen so far, the same on every rank."""

    losses: list[float] = field(default_factory=list)  # the micro-batches' agreed losses (with labels)
    token_loss: float = 0.0
    tokens: float = 0.0
    nonfinite: bool = False
    backwards: int = 0  # micro-batches whose gradient is in the accumulator
    per_token: float | None = None  # the window's backward seed weight (LossWeights.token_weight)

    def note(self, agreed: Agreed) -> None:
        self.nonfinite |= agreed.nonfinite
        if not (agreed.nonfinite or agreed.unlabelled):
            self.losses.append(agreed.loss)
            self.token_loss += agreed.token_loss
            self.tokens += agreed.tokens

    def report(self, normalization: str) -> float:
        """The window's loss so far: the mean of its micro-batches' (or its token mean)."""
        if self.nonfinite or not self.losses:
            return math.nan
        if normalization == "tokens":
            return self.token_loss / self.tokens
        return sum(self.losses) / len(self.losses)
