"""The training loss of one batch on this rank, as the step back-propagates it.

Through the chunked linear + cross-entropy (chunked_loss.py: no whole logits tensor) where the
model's head is one it knows, else the model's own loss. Sequence-parallel: this rank's slice of
the whole batch, weighed so that the SP group's losses add up to the batch's (sequence_loss.py).
"""
from __future__ import annotations

from typing import Any

import torch

from lomo_ds.engine.chunked_loss import causal_lm_loss
from lomo_ds.engine.sequence_loss import sp_loss
from lomo_ds.runtime.dist import has_labelled_tokens, label_tokens, loss_of


class BatchLoss:
    """One engine's loss of a batch: its `module`, the `head` the chunked loss reads (None: the
    model's own loss), `chunk_logits` (memory.loss_chunk_logits), the SP groups `sp`, and
    `normalization` (train.loss_normalization: whether label tokens are counted)."""

    def __init__(self, module: torch.nn.Module, head, chunk_logits: int, sp, normalization: str):
        self.module, self.head, self.chunk_logits = module, head, chunk_logits
        self.sp, self.normalization = sp, normalization

    def forward(self, batch: dict[str, Any]):
        """The training forward: its outputs' "loss" is what the step reads (no logits with the
        chunked loss)."""
        if self.head is not None and batch.get("labels") is not None:
            return causal_lm_loss(self.module, self.head, batch, self.chunk_logits)
        return self.module(**batch)

    def __call__(self, batch: dict[str, Any], forward=None) -> tuple[torch.Tensor, bool, int]:
        """The loss of `forward(batch)` (default: forward above; the engine passes its own, which a
        subclass may replace: the Trainer's compute_loss), whether the batch has a label, and its
        label tokens (1 unless normalization is "tokens")."""
        if self.sp.size > 1:
            return sp_loss(self.module, self.head, self.chunk_logits, batch, self.sp, self.normalization)
        tokens = label_tokens(batch) if self.normalization == "tokens" else 1
        return loss_of((forward or self.forward)(batch)), has_labelled_tokens(batch), tokens

    def token_sum(self, batch: dict[str, Any]) -> torch.Tensor | None:
        """The summed cross-entropy of the batch's label tokens (shifted by one, -100 ignored),
        through the chunked loss; None where the model keeps its own loss."""
        if self.head is None:
            return None
        return causal_lm_loss(self.module, self.head, batch, self.chunk_logits, reduction="sum").loss
