"""Batches for the chat and instruction tasks: packing, and length-grouped batch order.

Packing (data.packing) concatenates tokenized examples into rows of at most tokenizer.max_length.
No example may see another: each row carries position ids that restart at every example, and the
batch has no attention_mask and no cache, which is how transformers' models are told a row is
packed (masking_utils finds the examples from the position ids and builds a block-diagonal causal
mask for sdpa/eager). Flash attention is another matter: transformers takes its varlen path from the
position ids only for a batch of one row, so the config refuses flash attention with packing and
more rows per micro-batch (config/run.py). The loss is
unchanged: every example's first token is a prompt token, labelled -100, so no example is asked to
predict the next one's start.

Without packing, each epoch's order is grouped by length (similar lengths share a global batch:
less padding) and is, like the plain order, a pure function of (seed, epoch), so --resume replays
it exactly.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np
import torch

from lomo_ds.data.collate import collate
from lomo_ds.data.order import epoch_order
from lomo_ds.data.types import Datasets

# Length grouping sorts within mega-batches of this many global batches, then shuffles the batches:
# a large window pads less, a small one keeps the epoch's order more random.
MEGABATCH_BATCHES = 16
_PACK_STREAM = 7  # the packing order's seed stream, apart from the epochs' (seed, epoch) streams


def pack(examples: list[dict], max_length: int, seed: int) -> list[dict]:
    """Rows {"input_ids", "labels", "lengths"} of whole examples in a seeded order, each row
    filled until the next example would not fit."""
    order = np.random.default_rng([seed, _PACK_STREAM]).permutation(len(examples))
    return list(pack_stream((examples[int(i)] for i in order), max_length))


def pack_stream(examples: Iterable[dict], max_length: int) -> Iterator[dict]:
    """pack's rows of `examples` in their order, each row given out once the next example does not
    fit in it (a stream is packed as it is read: data/streaming.py)."""
    row = None
    for ex in examples:
        n = len(ex["input_ids"])
        if n > max_length:
            raise ValueError(f"pack: an example of {n} tokens is longer than max_length={max_length}")
        if row is not None and len(row["input_ids"]) + n > max_length:
            yield row
            row = None
        if row is None:
            row = {"input_ids": [], "labels": [], "lengths": []}
        row["input_ids"] += ex["input_ids"]
        row["labels"] += [-100] + list(ex["labels"][1:])  # nothing predicts an example's first token
        row["lengths"].append(n)
    if row is not None:
        yield row


def collate_packed(rows: list[dict], pad_id: int) -> dict:
    """input_ids, labels, position_ids (restarting per example), use_cache=False, right-padded;
    the padding is a segment of its own, labelled -100."""
    width = max(len(r["input_ids"]) for r in rows)
    host = torch.device("cpu")  # the engines move batches to their device
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=host)
    labels = torch.full((len(rows), width), -100, dtype=torch.long, device=host)
    positions = torch.zeros((len(rows), width), dtype=torch.long, device=host)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"], dtype=torch.long, device=host)
        labels[i, :n] = torch.tensor(r["labels"], dtype=torch.long, device=host)
        positions[i] = torch.cat([torch.arange(k, dtype=torch.long, device=host)
                                  for k in [*r["lengths"], width - n] if k])
    # A cache disables transformers' packed-sequence detection: the mask would be one causal block.
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "use_cache": False}


def make_batch(examples: list[dict], pad_id: int, packed: bool) -> dict:
    return collate_packed(examples, pad_id) if packed else collate(examples, pad_id)


def padding_fraction(micro_batches: list[list[dict]]) -> float:
    """The share of padding positions over micro batches, each padded to its longest row."""
    real = sum(len(e["input_ids"]) for mb in micro_batches for e in mb)
    total = sum(len(mb) * max(len(e["input_ids"]) for e in mb) for mb in micro_batches if mb)
    return 1.0 - real / total if total else 0.0


def length_grouped_order(lengths: list[int], seed: int, epoch: int, global_batch: int) -> list[int]:
    """An epoch's example order whose consecutive global batches hold similar lengths: the
    epoch's permutation is cut into mega-batches, each sorted by length (longest first) and cut
    into global batches; the full batches are shuffled, the partial one stays last."""
    perm = epoch_order(len(lengths), seed, epoch)
    size = global_batch * MEGABATCH_BATCHES
    flat = [i for s in range(0, len(perm), size) for i in sorted(perm[s:s + size], key=lambda j: -lengths[j])]
    batches = [flat[s:s + global_batch] for s in range(0, len(flat), global_batch)]
    full = [b for b in batches if len(b) == global_batch]
    tail = [b for b in batches if len(b) < global_batch]
    shuffled = np.random.default_rng([seed, epoch, _PACK_STREAM]).permutation(len(full))
    return [i for k in shuffled for i in full[int(k)]] + [i for b in tail for i in b]


def train_order(data, seed: int, epoch: int, global_batch: int) -> list[int]:
    """The epoch's order of data.train (lomo_ds.data.types.Datasets): grouped by length for
    chat/instruction data that is not packed, the mixture's for data.sources, the plain permutation
    otherwise."""
    if getattr(data, "mixture", None) is not None:
        return data.mixture.order(seed, epoch)
    if getattr(data, "keep_order", False):
        return list(range(len(data.train)))
    if data.group_by_length:
        return length_grouped_order([len(e["input_ids"]) for e in data.train], seed, epoch, global_batch)
    return epoch_order(len(data.train), seed, epoch)


def finish_train_split(data: Datasets, run_cfg) -> None:
    """Pack the training examples (data.packing) or else group their batches by length."""
    if run_cfg.data.packing:
        n = len(data.train)
        data.train = pack(data.train, run_cfg.tokenizer.max_length, run_cfg.train.seed)
        data.packed = True
        data.stats["train_packed_rows"] = len(data.train)
        data.stats["train_examples_packed"] = n
    else:
        data.group_by_length = True
