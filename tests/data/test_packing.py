"""Packing and length-grouped order (lomo_ds/data/packing.py): every example's loss in a packed
row equals its loss alone, through the mask transformers builds from restarting position ids."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from lomo_ds.data.collate import collate
from lomo_ds.data.order import batches_for_step, epoch_order
from lomo_ds.data.packing import collate_packed, length_grouped_order, make_batch, pack, padding_fraction, train_order
from tests.tiny import VOCAB, tiny_llama_config


def examples(n: int, seed: int = 0) -> list[dict]:
    """Random token sequences of 5..20 tokens, the first ~third of each a prompt (label -100)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(5, 21, (1,), generator=g, device="cpu"))
        ids = torch.randint(0, VOCAB, (length,), generator=g, device="cpu").tolist()
        prompt = max(1, length // 3)
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def per_example_losses(logits: torch.Tensor, labels: torch.Tensor, spans: list[tuple[int, int, int]]) -> list[float]:
    """Mean next-token loss of each (row, start, length) span, from its own labels only."""
    out = []
    for row, start, n in spans:
        lg, lb = logits[row, start:start + n - 1], labels[row, start + 1:start + n]
        out.append(torch.nn.functional.cross_entropy(lg.float(), lb, ignore_index=-100).item())
    return out


@pytest.fixture(scope="module")
def model():
    cfg = tiny_llama_config(layers=2)
    cfg._attn_implementation = "sdpa"  # what a CPU run uses; the mask is built the same way for eager
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def packed_and_alone(model, batch_transform=lambda b: b):
    exs = examples(12)
    rows = pack(exs, max_length=48, seed=3)
    assert len(rows) < len(exs) and all(len(r["input_ids"]) <= 48 for r in rows)
    batch = batch_transform(collate_packed(rows, pad_id=0))
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    spans, by_ids = [], []
    for r, row in enumerate(rows):
        start = 0
        for n in row["lengths"]:
            spans.append((r, start, n))
            by_ids.append(tuple(row["input_ids"][start:start + n]))
            start += n
    packed = per_example_losses(logits, batch["labels"], spans)
    alone = {}
    with torch.no_grad():
        for e in exs:
            b = collate([e], pad_id=0)
            lg = model(input_ids=b["input_ids"]).logits
            alone[tuple(e["input_ids"])] = per_example_losses(lg, b["labels"], [(0, 0, len(e["input_ids"]))])[0]
    return packed, [alone[k] for k in by_ids]


def test_each_example_loss_in_a_packed_row_equals_its_loss_alone(model):
    packed, alone = packed_and_alone(model)
    assert len(packed) == 12
    assert max(abs(a - b) for a, b in zip(packed, alone, strict=True)) < 1e-5, (packed, alone)


def test_without_the_block_diagonal_mask_the_losses_differ(model):
    # The same rows as one causal block (a 2D all-ones mask turns transformers' packed-sequence
    # detection off): examples after the first in a row see their neighbours, so the comparison
    # above can fail.
    def one_block(batch):
        return {**batch, "attention_mask": torch.ones_like(batch["input_ids"])}

    packed, alone = packed_and_alone(model, one_block)
    assert max(abs(a - b) for a, b in zip(packed, alone, strict=True)) > 1e-2


def test_packed_labels_positions_and_padding():
    exs = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}]
    rows = pack(exs, max_length=6, seed=0)
    assert len(rows) == 1 and sorted(rows[0]["lengths"]) == [2, 3]
    batch = collate_packed(rows + [{"input_ids": [1], "labels": [-100], "lengths": [1]}], pad_id=0)
    first = rows[0]["lengths"][0]
    # position ids restart at each example and in the padding; every example's first label is -100
    assert batch["position_ids"][0].tolist() == list(range(first)) + list(range(5 - first))
    assert batch["labels"][0, 0].item() == -100 and batch["labels"][0, first].item() == -100
    assert batch["position_ids"][1].tolist() == [0, 0, 1, 2, 3] and batch["use_cache"] is False
    assert "attention_mask" not in batch  # a 2D mask would turn the block-diagonal mask off
    with pytest.raises(ValueError, match="longer than max_length=2"):
        pack(exs, max_length=2, seed=0)


def test_length_grouped_order_is_a_seeded_permutation_with_less_padding():
    lengths = [len(e["input_ids"]) for e in examples(203, seed=1)]
    order = length_grouped_order(lengths, seed=5, epoch=2, global_batch=8)
    assert sorted(order) == list(range(203))
    assert order == length_grouped_order(lengths, seed=5, epoch=2, global_batch=8)  # resume replays it
    assert order != length_grouped_order(lengths, seed=5, epoch=3, global_batch=8)
    exs = [{"input_ids": [0] * n} for n in lengths]

    def padding(o):
        return padding_fraction([[exs[i] for i in batches_for_step(o, s, 2, 4, r)]
                                 for s in range(25) for r in range(2)])

    assert padding(order) < 0.5 * padding(epoch_order(203, 5, 2))


def test_train_order_groups_only_unpacked_chat_data():
    class Data:
        train = [{"input_ids": [0] * n, "labels": [0] * n} for n in (3, 9, 1, 7)]
        group_by_length = False

    assert train_order(Data, 1, 0, 2) == epoch_order(4, 1, 0)
    Data.group_by_length = True
    assert train_order(Data, 1, 0, 2) == length_grouped_order([3, 9, 1, 7], 1, 0, 2)
    assert set(make_batch(Data.train[:2], 0, packed=False)) == {"input_ids", "attention_mask", "labels"}
