"""The training loss of one SP rank's slice of a whole batch (train.sequence_parallel_size > 1).

Every SP rank of a data-parallel group is given the same whole batch and keeps its slice of
positions (data/sequence_split.py). What it back-propagates is chosen so that the SP group's sum
is the whole sequence's loss, the engine's normal per-rank loss:

  "mean":   its slice's summed cross-entropy / the WHOLE batch's target tokens, so the SP ranks'
            values add up to the batch's token mean (the engine divides by micro-batches x
            data-parallel replicas, not x ranks);
  "tokens": its slice's token mean and its slice's token count, which the engine multiplies back
            into the slice's sum; the ranks' counts add up to every target token once.

A batch already split (DeepSpeed's UlyssesSPDataLoaderAdapter: input_ids, position_ids and
shift_labels of this rank's positions; the Trainer's path) is taken as it is; the whole batch's
target tokens are then one all-reduce over the SP group.

A slice may have no target even when its row has some: its loss is then an exact 0 (never 0/0),
and its backward still runs, carrying its peers' gradients back through Ulysses' all-to-all.
"""
from __future__ import annotations

from typing import Any

import torch

from lomo_ds.data.sequence_split import IGNORE, target_tokens
from lomo_ds.engine.chunked_loss import causal_lm_loss
from lomo_ds.runtime.device import group_device
from lomo_ds.runtime.dist import all_reduce_sum
from lomo_ds.runtime.layout import SequenceParallel


def slice_sum(module: torch.nn.Module, head, chunk_logits: int, part: dict[str, Any]) -> torch.Tensor:
    """The summed cross-entropy of a slice's shift_labels (the chunked loss where the head is
    known, else the model's logits)."""
    if head is not None:
        return causal_lm_loss(module, head, part, chunk_logits, reduction="sum").loss
    targets = part["shift_labels"]
    logits = module(input_ids=part["input_ids"], position_ids=part["position_ids"]).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                             targets.to(logits.device).reshape(-1), ignore_index=IGNORE,
                                             reduction="sum")


def sp_loss(module: torch.nn.Module, head, chunk_logits: int, batch: dict[str, Any], sp: SequenceParallel,
            normalization: str) -> tuple[torch.Tensor, bool, int]:
    """(loss, whether the whole batch has a target, tokens) as the engine's train_step reads them;
    `sp` is the parallel layout's SP part (lomo_ds/runtime/layout.py), which cuts this rank's slice."""
    pre_split = "shift_labels" in batch
    part = ({k: batch[k] for k in ("input_ids", "position_ids", "shift_labels")} if pre_split
            else sp.local_part(batch))
    mine = int((part["shift_labels"] != IGNORE).sum())
    whole = (int(all_reduce_sum(torch.tensor([float(mine)], device=group_device(sp.group)), sp.size, sp.group,
                                "sequence-parallel target tokens")[0]) if pre_split else target_tokens(batch))
    total = slice_sum(module, head, chunk_logits, part)
    if normalization == "tokens":
        return total / max(mine, 1), whole > 0, mine
    return total / max(whole, 1), whole > 0, 1
