"""One batch's sequences split over the sequence-parallel ranks (train.sequence_parallel_size).

Each SP rank of a data-parallel group gets the same whole batch and keeps its own contiguous slice
of positions. Two things must survive the split:

- positions: `position_ids` are the whole row's (0..S-1, or the batch's own for packed rows), so
  rotary embeddings and the causal order after Ulysses' all-to-all are the unsplit model's;
- labels: position t predicts labels[t + 1]. The shift is made on the whole row BEFORE the split
  ("shift_labels", -100 after the last position), so the target of a slice's last position is the
  first label of the next slice: no label is dropped at a boundary, none counted twice.

Ulysses discards the attention mask (it would be the whole sequence's), so a padded row must be
right-padded: causal attention then never lets a real token see a pad.
"""
from __future__ import annotations

from typing import Any

import torch

IGNORE = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Each position's target: the next label, -100 for the last position (what transformers'
    causal-LM loss does inside the model, done here on the whole row)."""
    pad = torch.full((*labels.shape[:-1], 1), IGNORE, dtype=labels.dtype, device=labels.device)
    return torch.cat([labels[..., 1:], pad], dim=-1)


def check_divisible(seq_len: int, sp_size: int) -> None:
    if seq_len % sp_size:
        raise ValueError(f"train.sequence_parallel_size {sp_size}: the sequence length {seq_len} is not divisible "
                         f"by it; pad the rows to a multiple of {sp_size} (data.max_length a multiple of it)")


def _check_right_padded(mask: torch.Tensor) -> None:
    # A mask that never rises again along a row: every pad after every real token.
    if bool((mask[..., 1:] > mask[..., :-1]).any()):
        raise ValueError("sequence parallelism needs right-padded rows: Ulysses attention drops the attention mask, "
                         "so a left pad would be seen by the tokens after it")


def split_batch(batch: dict[str, Any], sp_rank: int, sp_size: int) -> dict[str, Any]:
    """This SP rank's slice of `batch` (input_ids, labels; optional position_ids, attention_mask):
    input_ids, position_ids and shift_labels of positions [rank * S/sp, (rank + 1) * S/sp).
    Without labels the targets are the input ids (the model's own loss's convention)."""
    ids = batch["input_ids"]
    seq = ids.shape[-1]
    check_divisible(seq, sp_size)
    mask = batch.get("attention_mask")
    if mask is not None:
        _check_right_padded(mask)
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(seq, device=ids.device).expand(ids.shape[0], seq)
    labels = batch.get("labels")
    targets = shift_labels(labels if labels is not None else ids)
    chunk = seq // sp_size
    part = slice(sp_rank * chunk, (sp_rank + 1) * chunk)
    return {"input_ids": ids[:, part], "position_ids": positions[:, part], "shift_labels": targets[:, part]}


def pad_to_multiple(batch: dict[str, Any], sp_size: int, pad_id: int) -> dict[str, Any]:
    """Right-pad a collated batch's rows to a multiple of `sp_size` positions: pad ids, mask 0,
    labels -100 (nothing learns from them, and no real token attends to them)."""
    extra = -batch["input_ids"].shape[-1] % sp_size
    if not extra:
        return batch
    fill = {"input_ids": pad_id, "attention_mask": 0, "labels": IGNORE}
    out = dict(batch)
    for key, value in fill.items():
        if key in batch:
            t = batch[key]
            pad = torch.full((*t.shape[:-1], extra), value, dtype=t.dtype, device=t.device)
            out[key] = torch.cat([t, pad], dim=-1)
    return out


def target_tokens(batch: dict[str, Any]) -> int:
    """The whole batch's target tokens (what its SP slices' shift_labels count together)."""
    labels = batch.get("labels")
    if labels is None:
        return batch["input_ids"][..., 1:].numel()
    return int((labels[..., 1:] != IGNORE).sum())
