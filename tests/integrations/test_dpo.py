"""Preference tuning: TRL's DPOTrainer with LOMO and AdaLomo (lomo_ds.integrations.dpo), the
preference data (lomo_ds.data.preference) and the planner's DPO rows (lomo_ds.planning.dpo).

The multi-rank checks (tests/integrations/dist_dpo_checks.py) train through LomoDPOTrainer on real DeepSpeed
ZeRO-3 ranks and compare with a single-process reference: TRL's DPO loss on an unpartitioned copy of
the starting model, torch.optim.SGD (or the reference AdaLomo), on each window's micro-batches of
every rank, with the Trainer's schedule and global-norm clipping.

Revert checked: without LomoDPOTrainer's `mean` normalisation (the mixin then weighs each
micro-batch by its padded token count, as the model's forward accepts num_items_in_batch), the
parameters on 1 rank differ from the reference by 1.6e-3 (LOMO) and 1.4e-2 (AdaLomo).
"""
import json

import pytest

from tests.integrations import dist_dpo_checks as D
from tests.ranks import LONG_TESTS, ROOT, long_unless_declared, multi_rank_checks, ok

TOL = 1e-5
WORLDS = [1, 2]
# AdaLomo on 2 ranks with the long checks (CI): LOMO's on 2 and AdaLomo's on 1 run in every suite.
EQUIVALENCE = [*multi_rank_checks(WORLDS, dpo_lomo=lambda: D.check_equivalence("lomo")),
               *multi_rank_checks(WORLDS if LONG_TESTS else [1], dpo_adalomo=lambda: D.check_equivalence("adalomo"))]
PAIRS = [pytest.param(world, check, marks=long_unless_declared(check, world))
         for world in WORLDS for check in EQUIVALENCE]
# The same pairs as a Dataset.from_list (no cache files, which TRL keys its precomputed reference by):
# a long check (CI).
IN_MEMORY = (multi_rank_checks([2], dpo_in_memory=lambda: D.check_equivalence("lomo", in_memory=True))[0]
             if LONG_TESTS else None)


@pytest.mark.parametrize(("world", "check"), PAIRS, ids=str)
def test_dpo_matches_reference(rank_results, world, check):
    r = ok(rank_results(world), check)
    print(f"{check} on {world}: max |DPO - reference| = {r['max_abs_diff']:.2e}, reference log-probs "
          f"{r['ref_logp_diff']:.2e}, norms {r['ref_grad_norm']}")
    assert r["wrapped"] == "DeepSpeedEngine" and r["deepspeed_engines"] == 1  # no second engine on the policy
    assert r["ref_logp_diff"] <= TOL  # the precomputed reference is the starting model's
    assert r["max_abs_diff"] <= TOL
    assert r["loss"] == pytest.approx(r["ref_loss"], abs=1e-5)
    assert r["grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-5)
    assert r["lr"] == pytest.approx(r["ref_lr"], abs=1e-12)
    clipped = [n > D.CLIP[world] for n in r["ref_grad_norm"]]
    assert any(clipped) and not all(clipped), r["ref_grad_norm"]  # the clip acts on some steps only
    assert r["loss"][-1] != r["loss"][0]
    assert all(a is not None for a in r["reward_accuracy_logged"])  # TRL's metrics reach the logs


@pytest.mark.long
def test_dpo_in_memory_dataset_on_two_ranks(rank_results):
    """Pairs given as Dataset.from_list train on 2 ranks as the reference does, with the precomputed
    reference log-probs of the same pairs read from a file (and of a direct computation).

    Revert checked: through TRL's cache file, rank 1 raises FileNotFoundError on a /tmp/hf_datasets-*
    path that only rank 0 has."""
    results = rank_results(2)
    r, from_file = ok(results, IN_MEMORY), ok(results, EQUIVALENCE[0])
    assert r["input_cache_files"] == 0 and from_file["input_cache_files"] > 0
    assert r["ref_logp_diff"] <= TOL  # the starting model's, computed directly
    assert r["ref_logps"] == from_file["ref_logps"] and r["ref_logps_dtype"] == from_file["ref_logps_dtype"]
    assert r["max_abs_diff"] <= TOL
    assert r["loss"] == pytest.approx(r["ref_loss"], abs=1e-5) and r["loss"][-1] != r["loss"][0]


# ----------------------------------------------------------------------------- single process: the arguments
@pytest.fixture
def dpo_args(monkeypatch, tmp_path):
    import os

    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    saved = dict(os.environ)

    def make(**kw):
        return D.dpo_config(str(tmp_path), kw.pop("optim", "lomo"), 1.0, **kw)

    yield make
    unset_hf_deepspeed_config()
    os.environ.clear()
    os.environ.update(saved)


REFUSED = [
    ({"precompute_ref_log_probs": False}, r"^precompute_ref_log_probs: expected True"),
    ({"padding_free": True}, r"^padding_free: "),
    ({"activation_offloading": True}, r"^activation_offloading: "),
    ({"optim": "adamw_torch"}, r"^optim: expected 'lomo' or 'adalomo'"),
]


@pytest.mark.parametrize("fields,message", REFUSED, ids=lambda v: str(v)[:40])
def test_refused_before_deepspeed(dpo_args, fields, message):
    import torch

    from lomo_ds.integrations.dpo import LomoDPOTrainer
    from lomo_ds.integrations.training_args import TrainingArgumentsError
    from lomo_ds.runtime import ds_compat
    from tests.helpers_data import chatml_tokenizer

    tok = chatml_tokenizer()
    model = D.tiny_policy(len(tok))
    with pytest.raises(TrainingArgumentsError, match=message) as e:
        LomoDPOTrainer(model=model, args=dpo_args(**fields), train_dataset=None, processing_class=tok)
    assert "\n" not in str(e.value)
    assert not ds_compat.is_zero_param(next(model.parameters())) and not torch.distributed.is_initialized()


def test_second_reference_model_refused(dpo_args):
    from lomo_ds.integrations.dpo import LomoDPOTrainer
    from lomo_ds.integrations.training_args import TrainingArgumentsError

    with pytest.raises(TrainingArgumentsError, match=r"^ref_model: a second model is not supported"):
        LomoDPOTrainer(model=D.tiny_policy(50), ref_model=D.tiny_policy(50), args=dpo_args())
    with pytest.raises(TrainingArgumentsError, match=r"^peft_config: "):
        LomoDPOTrainer(model=D.tiny_policy(50), args=dpo_args(), peft_config=object())


def test_dpo_trainer_only_through_lomo_subclass():
    from trl import DPOTrainer

    from lomo_ds.integrations.dpo import LomoDPOTrainer
    from lomo_ds.integrations.training_args import TrainingArgumentsError, check_trainer_class
    from lomo_ds.integrations.transformers import LomoTrainerMixin

    with pytest.raises(TrainingArgumentsError, match=r"^DPOTrainer: .*lomo_ds.integrations.dpo.LomoDPOTrainer"):
        check_trainer_class(type("Mine", (LomoTrainerMixin, DPOTrainer), {}))
    check_trainer_class(LomoDPOTrainer)
    check_trainer_class(type("Mine", (LomoDPOTrainer,), {}))


# ----------------------------------------------------------------------------- preference data
def _write(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write(r if isinstance(r, str) else json.dumps(r))
            f.write("\n")
    return str(path)


CONV = {"prompt": [{"role": "user", "content": "Extract item=count: Ada has 3 cups."}],
        "chosen": [{"role": "assistant", "content": "cups=3"}],
        "rejected": [{"role": "assistant", "content": "cups=4"}]}
GOOD = {
    "conversational": CONV,
    "plain": {"prompt": "Ada has 3 cups. item=count:", "chosen": " cups=3", "rejected": " cups=4"},
    "implicit_plain": {"chosen": "Ada has 3 cups: cups=3", "rejected": "Ada has 3 cups: cups=4"},
    "implicit_conversational": {"chosen": CONV["prompt"] + CONV["chosen"],
                                "rejected": CONV["prompt"] + CONV["rejected"]},
}


@pytest.mark.parametrize("kind", sorted(GOOD))
@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_formats_read_through_datasets(tmp_path, kind, ext):
    from lomo_ds.data.preference import load_preference

    records = [GOOD[kind], GOOD[kind]]
    if ext == "jsonl":
        path = _write(tmp_path / "p.jsonl", records)
    else:
        import datasets

        path = str(tmp_path / "p.parquet")
        datasets.Dataset.from_list(records).to_parquet(path)
    data = load_preference(path)
    assert len(data) == 2 and data[1] == GOOD[kind]


BAD = [
    ('{"prompt": "a", "chosen": "b"', r"p.jsonl:3: not valid JSON"),
    ({"prompt": "a", "chosen": "b"}, r"p.jsonl:3: missing rejected"),
    ({"prompt": "a", "chosen": "b", "rejected": "b"}, r"p.jsonl:3: chosen and rejected are the same"),
    ({"prompt": "a", "chosen": "", "rejected": "b"}, r"p.jsonl:3: chosen: expected a non-empty string"),
    ({**CONV, "rejected": CONV["chosen"]}, r"p.jsonl:3: chosen and rejected are the same"),
    ({**CONV, "chosen": [{"role": "robot", "content": "x"}]}, r"p.jsonl:3: chosen\[0\]: unknown role 'robot'"),
    ({**CONV, "prompt": [{"role": "assistant", "content": "x"}]}, r"p.jsonl:3: prompt: the last turn is the assis"),
    ({**CONV, "rejected": [{"role": "user", "content": "x"}]}, r"p.jsonl:3: rejected: a completion holds assistant"),
    ({**GOOD["plain"], "score": 1}, r"p.jsonl:3: unknown field\(s\) \['score'\]"),
    (GOOD["plain"], r"p.jsonl:3: a plain with an explicit prompt record in a file of conversational"),
    ({"chosen": CONV["prompt"] + CONV["chosen"], "rejected": CONV["chosen"] + CONV["rejected"]},
     r"p.jsonl:3: a conversational with an implicit prompt record in a file of conversational with an explicit"),
]


@pytest.mark.parametrize("bad,message", BAD, ids=lambda v: str(v)[:30])
def test_bad_record_names_file_and_line(tmp_path, bad, message):
    from lomo_ds.data.errors import DataError
    from lomo_ds.data.preference import load_preference

    # the first records in the bad one's own format, unless the test is about a format that changes
    plain = isinstance(bad, dict) and isinstance(bad.get("chosen"), str) and "a plain" not in message
    first = GOOD["plain"] if plain else CONV
    path = _write(tmp_path / "p.jsonl", [first, first, bad])
    with pytest.raises(DataError, match=message):
        load_preference(path)


def test_implicit_prompt_must_share_the_turns(tmp_path):
    from lomo_ds.data.errors import DataError
    from lomo_ds.data.preference import load_preference

    good = GOOD["implicit_conversational"]
    bad = {"chosen": good["chosen"], "rejected": [{"role": "user", "content": "other"}] + CONV["rejected"]}
    with pytest.raises(DataError, match=r"p.jsonl:2: chosen and rejected must share every turn but the last"):
        load_preference(_write(tmp_path / "p.jsonl", [good, bad]))


def test_hard_pairs_differ_in_one_part_only():
    """Both replies item=count; the rejected one has the count or the item wrong, never both, never the format;
    each of the three kinds drawn, and named back by hard_pair_kind."""
    import os
    import re

    from lomo_ds.data.preference import HARD_KINDS, check_pair, hard_pair_kind, hard_pairs

    root = os.path.join(ROOT, "lomo_ds", "data", "builtin")
    with open(os.path.join(root, "chat", "validation.jsonl")) as f:
        conv = [json.loads(line)["messages"] for line in f]
    pairs = hard_pairs(conv, seed=0)
    assert len(pairs) == len(conv)
    kinds = {k: 0 for k in HARD_KINDS}
    for i, p in enumerate(pairs):
        check_pair(p, f"pair {i}")
        good, bad = p["chosen"][0]["content"], p["rejected"][0]["content"]
        assert re.fullmatch(r"[a-z]+=\d+", good) and re.fullmatch(r"[a-z]+=\d+", bad), (good, bad)
        (gi, gc), (bi, bc) = good.split("="), bad.split("=")
        assert (gi == bi) != (gc == bc), (good, bad)
        kind = "count" if gi == bi else "item_singular" if bi + "s" == gi else "item_other"
        assert hard_pair_kind(p) == kind, (good, bad)
        kinds[kind] += 1
    assert min(kinds.values()) > 20, kinds
    assert hard_pairs(conv, seed=0) == pairs and hard_pairs(conv, seed=1) != pairs


def test_hard_pairs_every_kind_per_conversation():
    """per_conversation=3: each conversation once with each kind of wrong reply; a kind list restricts them."""
    import os

    from lomo_ds.data.preference import HARD_KINDS, hard_pair_kind, hard_pairs

    with open(os.path.join(ROOT, "lomo_ds", "data", "builtin", "chat", "validation.jsonl")) as f:
        conv = [json.loads(line)["messages"] for line in f][:10]
    pairs = hard_pairs(conv, seed=3, per_conversation=3)
    assert len(pairs) == 30
    for i, m in enumerate(conv):
        group = pairs[3 * i:3 * i + 3]
        assert all(p["prompt"] == m[:-1] and p["chosen"][0]["content"] == m[-1]["content"] for p in group)
        assert sorted(hard_pair_kind(p) for p in group) == sorted(HARD_KINDS)
    only = hard_pairs(conv, seed=3, kinds=("item_singular",))
    assert [p["rejected"][0]["content"] for p in only] == [
        m[-1]["content"].replace("s=", "=") for m in conv]
    with pytest.raises(ValueError, match="kinds"):
        hard_pairs(conv, seed=3, kinds=("prose",))


# ----------------------------------------------------------------------------- the planner's DPO rows
@pytest.mark.parametrize("name,fits", [("Llama-3.1-8B", True), ("Qwen2.5-7B", True), ("Mistral-7B-v0.3", True),
                                       ("Gemma-2-9B", True)])
@pytest.mark.parametrize("seq", [1024, 2048])
def test_dpo_rows_of_the_docs(name, fits, seq):
    """docs/dpo.md's table: each 7-9B model on one 24 GiB GPU for DPO (1 pair, precomputed
    reference) at its figure; with a second reference model none fits."""
    import os
    from dataclasses import replace

    from lomo_ds.planning import planner
    from lomo_ds.planning.dpo import dpo_estimate

    root = ROOT
    spec = planner.resolve_model(os.path.join(root, "docs", "models", f"{name}.json"))
    run = replace(planner.RunSpec(), seq=seq)
    est = {m: dpo_estimate(spec, m, 1, run, pairs=1) for m in ("lomo", "adalomo")}
    with open(os.path.join(root, "docs", "dpo.md")) as f:
        row = next(line for line in f if line.startswith(f"| {name} |"))
    col = 1 if seq == 1024 else 2
    assert row.split("|")[col + 1].strip() == " / ".join(f"{est[m].total / planner.GIB:.2f}" for m in est)
    assert (est["lomo"].total <= 24 * planner.GIB) == fits
    assert dpo_estimate(spec, "lomo", 1, run, pairs=1, reference="ref_model").total > 24 * planner.GIB
    # the policy's forward runs chosen and rejected: 2 sequences a pair
    assert est["lomo"].policy.activations == planner.estimate(spec, "lomo", 1, replace(run, batch=2)).activations
    assert dpo_estimate(spec, "lomo", 1, run, pairs=2).policy.activations == pytest.approx(
        planner.estimate(spec, "lomo", 1, replace(run, batch=4)).activations)


def test_plan_cli_dpo_rows(capsys):
    from lomo_ds.cli import main

    assert main(["plan", "--model", "7b", "--dpo-pairs", "1", "--seq", "1024"]) == 0
    out = capsys.readouterr().out
    assert "| LOMO | precomputed (shipped) |" in out and "ref_model (refused)" in out
    assert main(["plan", "--model", "7b", "--dpo-pairs", "1", "--batch", "2"]) == 2
    assert "--batch: with --dpo-pairs" in capsys.readouterr().err
