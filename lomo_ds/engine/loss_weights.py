"""How a step weighs its loss: what every rank agrees on before any backward, what each rank
back-propagates, and what the summed gradient is divided by.

train.loss_normalization "mean": each rank back-propagates its batch's token-mean loss, and the
step's summed gradient is divided by micro-batches x data-parallel replicas. "tokens": each rank
back-propagates its token SUM, times one power-of-two weight for the whole window (so the seed
stays near the loss scale), and the sum is divided by the label tokens of every rank and
micro-batch, times that weight. The update undoes the seed's weight and the loss scale through its
grad_scale, so the gradient it applies is the same either way the batch was cut.
"""
from __future__ import annotations

import math

import torch

from lomo_ds.engine.window import Agreed


class LossWeights:
    """The loss's weighing for one engine: `normalization` (train.loss_normalization), the number
    of data-parallel replicas and of SP ranks sharing a batch, the ranks, and the step's
    agreements (`step_sums`: lomo_ds/comm/step_sums.py, one all-reduce of a few numbers)."""

    def __init__(self, normalization: str, dp_size: int, sp_size: int, world: int, step_sums):
        self.normalization = normalization
        self.dp_size, self.sp_size, self.world = dp_size, sp_size, world
        self.step_sums = step_sums

    @property
    def by_tokens(self) -> bool:
        return self.normalization == "tokens"

    def agree(self, loss: torch.Tensor, labelled: bool, tokens: int) -> Agreed:
        """Before any backward, ONE all-reduce of three fp32 numbers: the summed loss of the ranks
        with labelled tokens, how many such ranks, and how many of them have a non-finite loss;
        with "tokens", two more: the token-weighted loss and the label tokens."""
        value = float(loss.detach()) if labelled else 0.0  # an unlabelled batch's loss is 0/0
        finite = math.isfinite(value)
        # An SP group's ranks share one batch: together they count as one labelled batch.
        values = [value if finite else 0.0, float(labelled) / self.sp_size, float(not finite)]
        if self.by_tokens:
            tokens = tokens if labelled and finite else 0
            values += [value * tokens, float(tokens)]
        total, n_labelled, n_nonfinite, *weighted = self.step_sums.sum(values, "loss")
        if n_nonfinite or not n_labelled:
            return Agreed(math.nan, 0.0, 0.0, n_nonfinite > 0, n_labelled == 0)
        token_loss, all_tokens = weighted if self.by_tokens else (0.0, 0.0)
        return Agreed(total / n_labelled, token_loss, all_tokens, False, False)

    def token_weight(self, all_tokens: float) -> float:
        """With "tokens", what each rank's token sum is multiplied by before the backward: about
        one over the mean label tokens per rank, a power of two (so the gradient is the token sum's
        exactly, rescaled). A seed of tokens x loss_scale would overflow fp16 for log2(tokens)
        halvings of the scale, at the start and after every regrowth; this one is as large as
        "mean"'s. 1 for "mean", or before any rank has a label."""
        if not self.by_tokens or all_tokens <= 0:
            return 1.0
        return 2.0 ** -math.floor(math.log2(max(all_tokens / self.world, 1.0)))

    def backward_loss(self, loss: torch.Tensor, labelled: bool, tokens: int, loss_scale: float,
                      per_token: float = 1.0) -> torch.Tensor:
        """What this rank back-propagates: its token-mean loss ("mean"), or its token sum ("tokens")
        times `per_token` (token_weight); unscaled and averaged afterwards, by the update's grad_scale."""
        if not labelled:
            # Nothing to learn on this rank, but its backward still runs (ZeRO-3's gathers and
            # the reduce-scatter are collectives) and contributes a zero gradient. transformers'
            # 0/0 loss already back-propagates zeros; a model's own loss may not.
            return loss * 0.0
        weight = tokens * per_token if self.by_tokens else 1
        return loss * (weight * loss_scale)

    def normalizer(self, micro_batches: int, tokens: float) -> float:
        """What the summed gradient of a step is divided by: its micro-batches x replicas ("mean"),
        or its label tokens over every rank and micro-batch ("tokens"). Under sequence parallelism
        the replicas are the data-parallel ones: an SP group's ranks share batches."""
        return tokens if self.by_tokens else micro_batches * self.dp_size
