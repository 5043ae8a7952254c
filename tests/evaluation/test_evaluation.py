"""Candidate scoring and the rank split of lomo_ds/evaluation/scoring.py."""
from __future__ import annotations

import pytest
import torch

from lomo_ds.data.types import EvalExample
from lomo_ds.evaluation.scoring import evaluate, evaluate_loss, mean_logprob
from tests.ranks import multi_rank, ok

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


# Under ZeRO-3 every forward is a collective, so every rank must run as many forwards as the busiest
# one: 7 examples split 3/2/2 on 3 ranks.
@multi_rank(worlds=[3])
def forward_calls(n_examples: int = 7) -> dict:
    """Candidate accuracy, forward calls per rank (all-gathered) and the loss's token count."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    fwd = bigram_logits({1: {2: 5.0}})
    exs = [EvalExample("t", [1] * (1 + i % 3), [[2], [3]], i % 2) for i in range(n_examples)]
    out = evaluate(fwd, exs, pad_id=0, batch_size=2, rank=rank, world=world)
    counts = [None] * world
    torch.distributed.all_gather_object(counts, len(fwd.calls))
    loss = evaluate_loss(fwd, [{"input_ids": [1, 2], "labels": [-100, 2]}] * n_examples, 0, 2, rank, world)
    return {"accuracy": out["accuracy"], "n": out["n"], "forward_calls": counts, "loss_tokens": loss["n_tokens"]}


def test_mean_not_sum_of_logprobs_decides():
    # A = [2, 3, 3]: every token fairly likely; B = [4]: one less likely token. The sum of
    # log-probs prefers the shorter B, the mean (the protocol) prefers A.
    fwd = bigram_logits({1: {2: 3.0, 4: 2.0}, 2: {3: -2.7}, 3: {3: -2.7}})
    logits = fwd({"input_ids": torch.tensor([[1, 2, 3, 3]])})[0]
    lp = logits.log_softmax(-1)
    a = [lp[0, 2].item(), lp[1, 3].item(), lp[2, 3].item()]
    b = lp[0, 4].item()
    assert sum(a) < b < sum(a) / 3
    assert mean_logprob(logits, [1, 2, 3, 3], 1) == pytest.approx(sum(a) / 3, rel=1e-5)
    assert evaluate(fwd, [EvalExample("t", [1], [[2, 3, 3], [4]], label=0)], pad_id=0, batch_size=4)["accuracy"] == 1.0
    assert evaluate(fwd, [EvalExample("t", [1], [[2, 3, 3], [4]], label=1)], pad_id=0, batch_size=4)["accuracy"] == 0.0


def test_per_task_accuracy_and_batching():
    fwd = bigram_logits({1: {2: 5.0}, 6: {7: 5.0}})
    exs = [EvalExample("a", [1], [[2], [3]], 0), EvalExample("a", [1], [[2], [3]], 1),
           EvalExample("b", [5, 6], [[8], [7]], 1)]
    out = evaluate(fwd, exs, pad_id=0, batch_size=4)
    assert out["accuracy/a"] == 0.5 and out["n/a"] == 2
    assert out["accuracy/b"] == 1.0 and out["n"] == 3
    assert out["accuracy"] == pytest.approx(2 / 3)
    assert len(fwd.calls) == 1  # single-token candidates: one context row per example, 3 rows, 4 per forward
    # label_nll: the right candidate's negated score, averaged over the examples
    lp = lambda ctx, tok: fwd({"input_ids": torch.tensor([[ctx, 0]])})[0, 0].log_softmax(-1)[tok].item()  # noqa: E731
    assert out["label_nll"] == pytest.approx(-(lp(1, 2) + lp(1, 3) + lp(6, 7)) / 3, rel=1e-6)


def test_padding_does_not_change_scores():
    fwd = bigram_logits({1: {2: 2.0, 3: 1.0}, 2: {2: 1.0}})
    short = EvalExample("t", [1], [[3], [2]], 1)
    long = EvalExample("t", [4, 4, 4, 4, 4, 1], [[2, 2, 2], [3]], 0)
    alone = evaluate(fwd, [short], 0, 1)
    together = evaluate(fwd, [short, long], 0, 8)
    assert alone["accuracy"] == 1.0 and together["accuracy"] == 1.0


@pytest.mark.parametrize("world", [3])  # the 3-rank launch's group (tests/conftest.py)
def test_equal_forward_calls_across_ranks(rank_results, world):
    # 7 examples on 3 ranks: 3/2/2 examples -> 3/2/2 rows (one per single-token-answer example)
    # -> 2/1/1 batches; every rank must run 2 (ranks 1 and 2 pad with a dummy forward).
    r = ok(rank_results(world), forward_calls)
    assert r["forward_calls"] == [2, 2, 2]
    assert r["n"] == 7 and r["accuracy"] == pytest.approx(4 / 7)  # label 0 (token 2) is right 4 times
    assert r["loss_tokens"] == 7


def test_world_without_process_group_is_an_error():
    with pytest.raises(RuntimeError, match="not initialized"):
        evaluate(bigram_logits({}), [EvalExample("t", [1], [[2], [3]], 0)], 0, 2, rank=0, world=2)


def test_with_tiny_model_and_tokenizer():
    """End to end: real tokenizer seams and a real causal LM's logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lomo_ds.data.examples import format_example, tokenize_eval_example
    from tests.helpers_data import RECORDS, byte_bpe_tokenizer

    tok = byte_bpe_tokenizer(True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                         max_position_embeddings=128)).eval()
    exs = [tokenize_eval_example(format_example(t, RECORDS[t][0]), tok, 128)[0] for t in RECORDS]
    fwd = lambda b: model(**b).logits  # noqa: E731
    out = evaluate(fwd, exs, tok.pad_token_id, batch_size=3)
    assert out["n"] == 6 and set(k for k in out if k.startswith("n/")) == {f"n/{t}" for t in RECORDS}
    # batching and padding do not change the predictions
    # 5 Yes/No tasks score both answers from one context row; COPA's two multi-token answers are 2 rows
    assert evaluate(fwd, exs, tok.pad_token_id, batch_size=1) == {**out, "forward_calls": 7}
