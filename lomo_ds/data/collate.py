"""Batching tokenized examples: right-padded input ids, masked labels and attention mask."""
from __future__ import annotations

from typing import Iterable

import torch


def pad_id_of(tokenizer) -> int:
    """Padding is masked out everywhere, so any id works; EOS when the tokenizer has no pad token."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def collate(examples: Iterable[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example: input_ids (pad_id), attention_mask (0), labels (-100)."""
    examples = list(examples)
    if not examples:
        raise ValueError("collate: empty batch")
    width = max(len(e["input_ids"]) for e in examples)
    # Built on the host: every engine's train_step / eval_forward moves the batch to its device.
    host = torch.device("cpu")
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long, device=host)
    mask = torch.zeros((len(examples), width), dtype=torch.long, device=host)
    labels = torch.full((len(examples), width), -100, dtype=torch.long, device=host)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[i, :n] = torch.tensor(e["input_ids"], dtype=torch.long, device=host)
        mask[i, :n] = 1
        labels[i, :n] = torch.tensor(e["labels"], dtype=torch.long, device=host)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
