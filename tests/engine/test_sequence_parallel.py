"""Sequence parallelism (train.sequence_parallel_size) with the fused update: on 2 ranks (SP = 2)
and 4 ranks (SP = 2 x DP = 2) the parameters equal one process's torch.optim.SGD (or the reference
AdaLomo) on the same whole sequences, with norm clipping that bites and accumulation K = 2, in both
loss normalisations, and the loss equals the unsplit loss. The 4-rank launch is a long check
(CI: LOMO_DS_LONG_TESTS=1). The split itself and the refusals are checked without ranks.

Two things of the model's attention Ulysses loses unless lomo_ds keeps them
(lomo_ds/runtime/sequence_parallel.py), each checked against the whole rows in one process:
- a sliding window shorter than the row (Mistral, window 3 of 12): under sdpa the window lived only
  in the dropped mask. Reverted (no window mask), the parameters differ by 2.4e-3.
- fewer key/value heads than SP (1 for SP 2): DeepSpeed's replication left the module's
  num_key_value_groups at 2 instead of 4, and evaluation after a training step failed in sdpa
  ("The size of tensor a (4) must match the size of tensor b (2)").
Where the long checks run, every model family (tests/families.py) with SGD and AdaLomo, in fp32
and bf16: tests/engine/test_sequence_parallel_families.py."""
from __future__ import annotations

import pytest
import torch

from lomo_ds.data.sequence_split import shift_labels, split_batch, target_tokens
from lomo_ds.runtime.layout import ParallelLayout
from tests.engine import dist_sp_checks as S
from tests.families import sdpa_family
from tests.ranks import LONG_TESTS, assert_matches_reference, multi_rank_checks, ok
from tests.tiny import tiny_llama_config

TOL = 1e-5  # fp32, 3 steps of 2 micro-batches; the attention's sums run in another order
WORLDS = [2, 4] if LONG_TESTS else [2]

CHECKS = multi_rank_checks(
    WORLDS,
    sp_sgd_mean=lambda: S.equivalence(2, normalization="mean"),
    sp_sgd_tokens=lambda: S.equivalence(2, normalization="tokens"),
    sp_adalomo=lambda: S.equivalence(2, optimizer="adalomo", normalization="tokens"),
)
(UNSPLIT,) = multi_rank_checks(WORLDS, sp_unsplit_loss=lambda: S.unsplit_loss(2))
(OTHER_MODEL,) = multi_rank_checks(WORLDS, sp_other_model_unaffected=lambda: S.other_model_unaffected(2))
WINDOW, FEW_KV = multi_rank_checks(
    WORLDS,
    sp_sliding_window=lambda: S.equivalence(2, build=lambda seed: sdpa_family("mistral", seed, window=3)),
    sp_fewer_kv_heads_then_eval=lambda: S.equivalence(2, build=lambda seed: sdpa_family("llama", seed),
                                                      evaluate=True),
)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("check", CHECKS, ids=str)
def test_matches_whole_sequence_reference(rank_results, world, check):
    r = ok(rank_results(world), check)
    assert (r["sp"], r["dp"]) == (2, world // 2)
    assert_matches_reference(r, TOL, f"{check} on {world} ranks (SP 2 x DP {world // 2}), against one process")
    assert r["grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-5)
    assert all(n > 0.5 for n in r["ref_grad_norm"])  # the clip bit


@pytest.mark.parametrize("world", WORLDS)
def test_sliding_window_matches_whole_rows(rank_results, world):
    r = ok(rank_results(world), WINDOW)
    assert_matches_reference(r, TOL, f"Mistral, window 3 of {S.SEQ}, on {world} ranks, against one process")


def test_the_window_changes_these_rows():
    # Else the check above could not tell a dropped window from a kept one.
    batch = S.micro_batch(0, 0, 0)
    with torch.no_grad():
        windowed, whole = (sdpa_family("mistral", 1, window=w)(**batch).loss.item() for w in (3, S.SEQ))
    assert abs(windowed - whole) > 1e-3


@pytest.mark.parametrize("world", WORLDS)
def test_fewer_kv_heads_than_sp_then_evaluation(rank_results, world):
    r = ok(rank_results(world), FEW_KV)
    assert_matches_reference(r, TOL, f"LLaMA, 1 key/value head, SP 2, on {world} ranks, against one process")
    assert r["eval_loss"] == pytest.approx(r["ref_eval_loss"], rel=1e-5)
    assert r["replies"] == r["ref_replies"] and all(r["replies"])


@pytest.mark.parametrize("world", WORLDS)
def test_loss_is_the_unsplit_loss(rank_results, world):
    r = ok(rank_results(world), UNSPLIT)
    for normalization, (got, want) in r.items():
        assert got == pytest.approx(want, abs=1e-6), normalization


@pytest.mark.parametrize("world", WORLDS)
def test_another_model_in_the_process_is_not_routed(rank_results, world):
    """The attention is routed per model: a second model in the process (as DPO's and GRPO's
    reference models, an evaluation model) attends as it did before the SP engine was built and
    trained, in training mode too, and transformers' own "sdpa" stays registered as it was."""
    r = ok(rank_results(world), OTHER_MODEL)
    assert r["equal"], f"the other model's logits moved by {r['max_abs_diff']}"
    assert r["registry_sdpa_kept"]
    assert r["other_attention"] == "sdpa" and r["trained_attention"].startswith("lomo_ds_ulysses_")
    assert r["trained_attention"].endswith("_sdpa")


@pytest.mark.parametrize("world", WORLDS)
def test_normalisations_differ_on_these_rows(rank_results, world):
    # Prompted and whole rows in one window: "mean" and "tokens" weigh them differently, so each
    # check above tells a wrong normalisation from the right one.
    mean, tokens = (ok(rank_results(world), c)["ref_grad_norm"] for c in CHECKS[:2])
    assert all(m != pytest.approx(t, rel=1e-2) for m, t in zip(mean, tokens, strict=True))


def _batch(seq=12, prompt=0):
    ids = torch.arange(2 * seq).reshape(2, seq) % 97
    labels = ids.clone()
    labels[:, :prompt] = -100
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("sp", [2, 3, 4])
@pytest.mark.parametrize("prompt", [0, 5])
def test_split_keeps_every_label_once_and_global_positions(sp, prompt):
    batch = _batch(prompt=prompt)
    parts = [split_batch(batch, r, sp) for r in range(sp)]
    # Concatenated, the slices are the whole row shifted once: the label after each boundary is
    # the target of the last position before it, neither dropped nor repeated.
    joined = torch.cat([p["shift_labels"] for p in parts], dim=1)
    assert torch.equal(joined, shift_labels(batch["labels"]))
    assert torch.equal(joined[:, :-1], batch["labels"][:, 1:])
    assert int((joined != -100).sum()) == target_tokens(batch)
    assert torch.equal(torch.cat([p["position_ids"] for p in parts], dim=1), torch.arange(12).expand(2, 12))
    assert torch.equal(torch.cat([p["input_ids"] for p in parts], dim=1), batch["input_ids"])
    chunk = 12 // sp
    for r, p in enumerate(parts[:-1]):  # each boundary's target is the next slice's first label
        assert torch.equal(p["shift_labels"][:, -1], batch["labels"][:, (r + 1) * chunk])


def test_split_keeps_packed_position_ids():
    batch = {**_batch(), "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1]] * 2)}
    assert split_batch(batch, 1, 2)["position_ids"].tolist() == [[2, 3, 4, 5, 0, 1]] * 2


def test_split_refusals():
    with pytest.raises(ValueError, match="sequence length 12 is not divisible by it"):
        split_batch(_batch(), 0, 5)
    left = {**_batch(), "attention_mask": torch.tensor([[0] * 2 + [1] * 10] * 2)}
    with pytest.raises(ValueError, match="right-padded"):
        split_batch(left, 0, 2)
    right = {**_batch(), "attention_mask": torch.tensor([[1] * 10 + [0] * 2] * 2)}
    assert split_batch(right, 1, 2)["input_ids"].shape == (2, 6)


def test_pad_to_multiple_pads_right_with_nothing_to_learn():
    from lomo_ds.data.sequence_split import pad_to_multiple

    batch = {"input_ids": torch.ones(2, 10, dtype=torch.long), "attention_mask": torch.ones(2, 10, dtype=torch.long),
             "labels": torch.ones(2, 10, dtype=torch.long)}
    out = pad_to_multiple(batch, 3, pad_id=7)
    assert out["input_ids"].shape == (2, 12) and out["input_ids"][:, 10:].eq(7).all()
    assert out["attention_mask"][:, 10:].eq(0).all() and out["labels"][:, 10:].eq(-100).all()
    assert target_tokens(out) == target_tokens(batch)
    assert pad_to_multiple(batch, 5, pad_id=7) is batch


def test_model_refusals():
    def check(cfg, sp, device_type="cpu"):
        ParallelLayout.plan(sp, 2 * sp, 0, device_type).check_model(cfg)

    cfg = tiny_llama_config()  # 4 heads, 2 key/value heads
    cfg._attn_implementation = "sdpa"
    check(cfg, 2)
    with pytest.raises(ValueError, match="4 attention heads are not divisible"):
        check(cfg, 3)
    cfg.num_key_value_heads, cfg.num_attention_heads = 3, 6
    with pytest.raises(ValueError, match="3 key/value heads neither divide"):
        check(cfg, 2)
    cfg.num_key_value_heads, cfg.num_attention_heads = 2, 4
    cfg._attn_implementation = "eager"
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        check(cfg, 2)
    cfg._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="needs another attention here: 'sdpa'"):
        check(cfg, 2, "cpu")
    check(cfg, 2, "cuda")
    cfg._attn_implementation = "flex_attention"  # with no block mask it would attend to later tokens
    with pytest.raises(ValueError, match="attention 'flex_attention' reads the model's mask"):
        check(cfg, 2, "cuda")
    with pytest.raises(ValueError, match="does not divide the 3 ranks"):
        ParallelLayout.plan(2, 3, 0)


def test_layout_ranks_and_one_model_check():
    """The layout's ranks: SP groups of consecutive ranks, the replicas across them. A model config
    is checked once per layout: the recipe's check from the files, then the engine's of the built
    model, reads it once (a refused one is refused every time)."""
    layout = ParallelLayout.plan(2, 6, 3)
    assert (layout.sp.rank, layout.dp_size, layout.dp_rank, layout.sp_size) == (1, 3, 1, 2)
    cfg = tiny_llama_config()
    cfg._attn_implementation = "sdpa"
    layout.check_model(cfg)
    assert len(layout._checked) == 1
    layout.check_model(cfg)
    assert len(layout._checked) == 1
    cfg._attn_implementation = "eager"
    for _ in range(2):
        with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
            layout.check_model(cfg)


@pytest.mark.parametrize("overrides,message", [
    ({"train.method": "adamw"}, r"train.sequence_parallel_size: .*train.method 'adamw' cannot split"),
    ({"tokenizer.max_length": 130}, r"tokenizer.max_length: 130 is not divisible by train.sequence_parallel_size 3"),
    ({"data.packing": True, "data.task": "builtin_chat"}, r"data.packing: with train.sequence_parallel_size"),
    ({"model.attn_implementation": "eager"}, r"model.attn_implementation: 'eager' builds the S x S mask"),
    ({"train.sequence_parallel_size": 0}, r"train.sequence_parallel_size"),
])
def test_run_config_refusals_on_load(overrides, message):
    """A bad sequence-parallel run config fails when it is loaded, before any rank starts."""
    import os

    from lomo_ds.config.errors import ConfigError
    from lomo_ds.config.run import load_run_config
    from tests.ranks import ROOT

    with pytest.raises(ConfigError, match=message):
        load_run_config(os.path.join(ROOT, "ds_configs", "cpu_long_context.json"), overrides)


def test_shipped_long_context_config_loads():
    import os

    from lomo_ds.config.run import load_run_config
    from tests.ranks import ROOT

    cfg = load_run_config(os.path.join(ROOT, "ds_configs", "cpu_long_context.json"))
    assert cfg.train.sequence_parallel_size == 3 and cfg.tokenizer.max_length % 3 == 0
