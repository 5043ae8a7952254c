"""Candidate-scoring evaluation, spread over data-parallel ranks.

Each candidate answer is scored by the MEAN log-probability of its tokens given the context
(MeZO / LOMO protocol); the prediction is the best-scoring candidate. Rank r scores examples
r, r+world, ...; per-task (correct, total) counts are summed over ranks with all_reduce.

Under ZeRO-3 every forward pass is a collective (each layer's parameters are all-gathered from
all ranks), so every rank must call `forward_logits` the same number of times or the job hangs.
Ranks first agree (all_reduce MAX) on the number of forward calls; a rank with fewer real
batches runs dummy one-token batches whose outputs it ignores.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from tqdm import tqdm

from lomo_ds.data.collate import collate
from lomo_ds.data.types import EvalExample
from lomo_ds.runtime import ds_compat
from lomo_ds.runtime.device import accelerator_device, group_device, move_batch
from lomo_ds.runtime.dist import all_reduce_sum

ForwardLogits = Callable[[dict], torch.Tensor]  # batch dict -> logits [B, T, V]


def _distributed(world: int) -> bool:
    if world <= 1:
        return False
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise RuntimeError(f"evaluate: world={world} but torch.distributed is not initialized")
    return True


def agree_on_calls(n_calls: int, world: int) -> int:
    """The largest number of forward calls any rank needs (every rank must make that many)."""
    if not _distributed(world):
        return n_calls
    t = torch.tensor([n_calls], dtype=torch.long, device=group_device())
    ds_compat.all_reduce(t, name="evaluation forward count", op="max")
    return int(t.item())


def _dummy_batch(device: torch.device) -> dict[str, torch.Tensor]:
    one = torch.zeros((1, 1), dtype=torch.long, device=device)
    return {"input_ids": one, "attention_mask": torch.ones_like(one)}  # same keys as the real batches


def _model_inputs(enc: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A collated batch's model inputs, on the device the forward runs on."""
    return move_batch({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}, device)


ALL_CANDIDATES = -1


def _rows(examples: Sequence[EvalExample]) -> list[tuple[int, int, list[int], int]]:
    """One row per (example, candidate): (example index, candidate index, token ids, context length)."""
    rows = []
    for ei, ex in enumerate(examples):
        if not ex.context_ids:
            raise ValueError(f"evaluate: example {ei} has an empty context; nothing predicts its first answer token")
        if all(len(c) == 1 for c in ex.candidate_ids):
            # Single-token answers (Yes/No): one forward of the context scores them all, exactly
            # as separate rows would (ci = ALL_CANDIDATES).
            rows.append((ei, ALL_CANDIDATES, list(ex.context_ids), len(ex.context_ids)))
            continue
        for ci, cand in enumerate(ex.candidate_ids):
            rows.append((ei, ci, list(ex.context_ids) + list(cand), len(ex.context_ids)))
    return rows


def mean_logprob(logits: torch.Tensor, ids: list[int], start: int) -> float:
    """Mean log-probability of ids[start:] where logits[p] predicts ids[p+1] (one row, [T, V])."""
    pred = logits[start - 1:len(ids) - 1].float().log_softmax(-1)
    target = torch.tensor(ids[start:], dtype=torch.long, device=pred.device)
    return pred.gather(-1, target[:, None]).mean().item()


def _calls(n_calls: int, progress: bool):
    """range(n_calls), shown as a progress bar like training's when `progress` (rank 0)."""
    return tqdm(range(n_calls), desc="eval", disable=not progress, dynamic_ncols=True, leave=False)


def evaluate(forward_logits: ForwardLogits, examples: Sequence[EvalExample], pad_id: int,
             batch_size: int, rank: int = 0, world: int = 1, device: torch.device | None = None,
             progress: bool = False) -> dict:
    """Accuracy per task and overall over all ranks' share of `examples` (the full list on every rank).

    batch_size counts sequences (context + one candidate); the candidates of several examples
    share a forward, on `device` (default: this rank's accelerator device, the engine's).
    Returns {"accuracy", "label_nll", "n", "accuracy/<task>", "n/<task>", "forward_calls"}; label_nll
    is the mean over examples of the right candidate's negated score (its mean log-probability per
    token), the evaluation's loss: it moves where the accuracy saturates or sits at chance.
    """
    device = device or accelerator_device()
    mine = list(examples[rank::world])
    rows = _rows(mine)
    # Similar lengths together: less padding. The order does not change any score.
    rows.sort(key=lambda r: len(r[2]))
    batches = [rows[i:i + batch_size] for i in range(0, len(rows), batch_size)]
    n_calls = agree_on_calls(len(batches), world)

    scores = [[-math.inf] * len(ex.candidate_ids) for ex in mine]
    for call in _calls(n_calls, progress):
        if call >= len(batches):
            forward_logits(_dummy_batch(device))  # keeps this rank in step with the others' collectives
            continue
        batch = batches[call]
        enc = collate([{"input_ids": ids, "labels": ids} for _, _, ids, _ in batch], pad_id)
        with torch.no_grad():
            logits = forward_logits(_model_inputs(enc, device))
            for row, (ei, ci, ids, start) in enumerate(batch):
                if ci == ALL_CANDIDATES:
                    last = logits[row, len(ids) - 1].float().log_softmax(-1)
                    for k, cand in enumerate(mine[ei].candidate_ids):
                        scores[ei][k] = last[cand[0]].item()
                else:
                    scores[ei][ci] = mean_logprob(logits[row], ids, start)

    # Every rank knows every task name (all ranks hold the full example list): same tensor layout.
    tasks = sorted({ex.task for ex in examples})
    counts = torch.zeros((len(tasks), 3), dtype=torch.float64, device="cpu")  # host-side tallies
    for ex, sc in zip(mine, scores, strict=True):
        k = tasks.index(ex.task)
        counts[k, 0] += int(max(range(len(sc)), key=sc.__getitem__) == ex.label)
        counts[k, 1] += 1
        counts[k, 2] -= sc[ex.label]
    if _distributed(world):
        counts = all_reduce_sum(counts, world, name="evaluation counts").cpu()
    total = counts.sum(0)
    out = {"accuracy": float(total[0] / total[1]) if total[1] else float("nan"),
           "label_nll": float(total[2] / total[1]) if total[1] else float("nan"), "n": int(total[1]),
           "forward_calls": n_calls}
    for k, task in enumerate(tasks):
        out[f"accuracy/{task}"] = float(counts[k, 0] / counts[k, 1]) if counts[k, 1] else float("nan")
        out[f"n/{task}"] = int(counts[k, 1])
    return out


def evaluate_loss(forward_logits: ForwardLogits, examples: Sequence[dict], pad_id: int,
                  batch_size: int, rank: int = 0, world: int = 1, device: torch.device | None = None,
                  progress: bool = False, token_loss=None) -> dict:
    """Mean token cross-entropy over the labelled tokens of tokenized examples ({"input_ids",
    "labels"}), for tasks without candidates (instruction). Same rank split, padding and device
    as evaluate. `token_loss(batch)`, when given and not None for the model: the batch's summed
    token loss without every position's fp32 logits (the LOMO engine's chunked loss), in place of
    the loss from `forward_logits`."""
    device = device or accelerator_device()
    mine = sorted(examples[rank::world], key=lambda e: len(e["input_ids"]))
    batches = [mine[i:i + batch_size] for i in range(0, len(mine), batch_size)]
    n_calls = agree_on_calls(len(batches), world)
    sums = torch.zeros(2, dtype=torch.float64, device="cpu")  # host-side: summed loss, token count
    for call in _calls(n_calls, progress):
        if call >= len(batches):
            dummy = _dummy_batch(device)
            if token_loss is None or token_loss({**dummy, "labels": torch.full_like(dummy["input_ids"], -100)}) is None:
                forward_logits(dummy)
            continue
        enc = collate(batches[call], pad_id)
        chunked = None if token_loss is None else token_loss({**_model_inputs(enc, device),
                                                              "labels": enc["labels"].to(device)})
        if chunked is not None:
            sums[0] += chunked.item()
            sums[1] += int((enc["labels"][:, 1:] != -100).sum())
            continue
        with torch.no_grad():
            logits = forward_logits(_model_inputs(enc, device))
            labels = enc["labels"][:, 1:].to(logits.device)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)),
                                                     labels.reshape(-1), ignore_index=-100, reduction="sum")
        sums[0] += loss.item()
        sums[1] += int((labels != -100).sum())
    if _distributed(world):
        sums = all_reduce_sum(sums, world, name="evaluation loss sums").cpu()
    return {"loss": float(sums[0] / sums[1]) if sums[1] else float("nan"), "n_tokens": int(sums[1]),
            "forward_calls": n_calls}
