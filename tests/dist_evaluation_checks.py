"""The evaluation's rank split on this launch's ranks (tests/dist_checks.py runs it on 3): under
ZeRO-3 every forward is a collective, so every rank must run as many forwards as the busiest one.
tests/test_evaluation.py asserts on the figures, and uses bigram_logits for its one-process tests."""
from __future__ import annotations

import torch

from lomo_ds.data.loading import EvalExample
from lomo_ds.evaluation.scoring import evaluate, evaluate_loss

V = 10


def bigram_logits(table: dict[int, dict[int, float]]):
    """forward_logits whose next-token log-probs depend only on the current token, and which counts calls."""
    calls = []

    def fwd(batch):
        ids = batch["input_ids"]
        calls.append(tuple(ids.shape))
        out = torch.full((*ids.shape, V), -5.0)
        for tok, nxt in table.items():
            for t, v in nxt.items():
                out[..., t] = torch.where(ids == tok, torch.tensor(v), out[..., t])
        return out

    fwd.calls = calls
    return fwd


def check_forward_calls(n_examples: int = 7) -> dict:
    """Candidate accuracy, forward calls per rank (all-gathered) and the loss's token count."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    fwd = bigram_logits({1: {2: 5.0}})
    exs = [EvalExample("t", [1] * (1 + i % 3), [[2], [3]], i % 2) for i in range(n_examples)]
    out = evaluate(fwd, exs, pad_id=0, batch_size=2, rank=rank, world=world)
    counts = [None] * world
    torch.distributed.all_gather_object(counts, len(fwd.calls))
    loss = evaluate_loss(fwd, [{"input_ids": [1, 2], "labels": [-100, 2]}] * n_examples, 0, 2, rank, world)
    return {"accuracy": out["accuracy"], "n": out["n"], "forward_calls": counts, "loss_tokens": loss["n_tokens"]}


def evaluation_checks(world: int) -> dict:
    return {"forward_calls": check_forward_calls}
