"""Prompts, loading, sampling, tokenization and data order (lomo_ds/data/)."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from lomo_ds.config.run import load_run_config
from lomo_ds.config.tasks import BUILTIN_DIR, SUPERGLUE_TASKS, TASKS, Task
from lomo_ds.data.collate import collate
from lomo_ds.data.errors import DataError
from lomo_ds.data.examples import check_record, format_example, tokenize_eval_example, tokenize_train_example
from lomo_ds.data.io import load_split, read_jsonl, sample_indices
from lomo_ds.data.loading import build_datasets
from lomo_ds.data.order import (
    batches_for_step,
    epoch_order,
    micro_batches_per_epoch,
    position_of_step,
    steps_per_epoch,
    window_of_step,
)
from tests.helpers_data import RECORDS, boolq_records, byte_bpe_tokenizer, write_jsonl


def cfg(tmp_path=None, **data):
    return load_run_config({"model": {"path": "x"}, "lomo": {"lr": 0.03}, "data": data,
                            "tokenizer": {"max_length": 64}})


# ----------------------------------------------------------------------------- prompts

@pytest.mark.parametrize("task", sorted(RECORDS))
def test_prompt_exactly_as_mezo(task):
    record, prompt, candidates, label = RECORDS[task]
    ex = format_example(task, check_record(task, record, "here"))
    assert ex.prompt == prompt
    assert ex.candidates == candidates
    assert ex.label == label


def test_registry_covers_every_task():
    # every SuperGLUE task has a pinned prompt above and a hub configuration; only builtin and
    # instruction have none (run_config validates data.task against the same registry)
    assert sorted(RECORDS) == sorted(t for t, spec in TASKS.items() if spec.hub_config is not None)
    assert TASKS["wsc"].hub_config == "wsc.fixed"
    assert SUPERGLUE_TASKS == ("rte", "boolq", "wsc", "wic", "multirc", "copa")  # the paper's Table 3 column order
    assert [TASKS[t].title for t in SUPERGLUE_TASKS] == ["RTE", "BoolQ", "WSC", "WiC", "MultiRC", "COPA"]
    assert [t for t, spec in TASKS.items() if not spec.has_candidates] == ["instruction", "chat", "builtin_chat"]
    assert [t for t, spec in TASKS.items() if spec.conversational] == ["chat", "builtin_chat"]
    with pytest.raises(ValueError, match="no prompt"):
        format_example("instruction", {"prompt": "p", "response": "r"})


def test_a_new_task_is_one_registry_entry(tmp_path, monkeypatch):
    sst2 = Task("sst2", {"sentence": (str,), "label": (int,)}, lambda r: f'{r["sentence"]}\nIt was',
                candidates=lambda r: [" terrible", " great"], values={"label": (0, 1)})
    monkeypatch.setitem(TASKS, "sst2", sst2)
    write_jsonl(str(tmp_path / "train.jsonl"),
                [{"sentence": "Fine film.", "label": 1}, {"sentence": "Dull.", "label": 0}])
    write_jsonl(str(tmp_path / "validation.jsonl"), [{"sentence": "Bad.", "label": 2}])
    data = SimpleNamespace(task="sst2", source=str(tmp_path), train_file=None, eval_file=None)
    ex = format_example("sst2", load_split(data, "train")[0])
    assert (ex.prompt, ex.candidates, ex.label) == ("Fine film.\nIt was", [" terrible", " great"], 1)
    with pytest.raises(DataError, match=r"validation\.jsonl:1: field 'label': expected 0 or 1, got 2"):
        load_split(data, "eval")


def test_record_values_checked_and_bool_labels_accepted():
    record = dict(RECORDS["copa"][0], question="why")
    with pytest.raises(DataError, match="here: field 'question': expected 'cause' or 'effect', got 'why'"):
        check_record("copa", record, "here")
    r = dict(RECORDS["boolq"][0], label=True)
    assert format_example("boolq", check_record("boolq", r, "here")).label == 0


def test_copa_effect_and_I_kept():
    r = {"premise": "I ran out of milk.", "choice1": "I went to the store.", "choice2": "The Cat slept.",
         "question": "effect", "label": 0}
    ex = format_example("copa", r)
    assert ex.prompt == "I ran out of milk so "
    assert ex.candidates == ["I went to the store.", "the Cat slept."]


def test_builtin_uses_boolq_prompt_and_files_are_balanced_and_disjoint():
    train = [r for r, _ in read_jsonl(os.path.join(BUILTIN_DIR, "train.jsonl"))]
    val = [r for r, _ in read_jsonl(os.path.join(BUILTIN_DIR, "validation.jsonl"))]
    assert sum(r["label"] for r in train) * 2 == len(train)
    assert sum(r["label"] for r in val) * 2 == len(val)
    assert not {r["passage"] for r in train} & {r["passage"] for r in val}
    ex = format_example("builtin", train[0])
    assert ex.prompt == f'{train[0]["passage"]} {train[0]["question"]}\n'  # question already ends in "?"


# ----------------------------------------------------------------------------- loading

def test_local_jsonl_dir_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rte = [RECORDS["rte"][0]] * 3
    write_jsonl(str(tmp_path / "j" / "train.jsonl"), rte)
    write_jsonl(str(tmp_path / "j" / "validation.jsonl"), rte[:2])
    os.makedirs(tmp_path / "p")
    pq.write_table(pa.Table.from_pylist(rte), str(tmp_path / "p" / "train.parquet"))
    pq.write_table(pa.Table.from_pylist(rte[:1]), str(tmp_path / "p" / "validation.parquet"))
    for sub, n_eval in (("j", 2), ("p", 1)):
        c = cfg(task="rte", source=str(tmp_path / sub))
        assert len(load_split(c.data, "train")) == 3
        assert len(load_split(c.data, "eval")) == n_eval
    # explicit files win over the source directory
    c = cfg(task="rte", source=str(tmp_path / "j"), eval_file=str(tmp_path / "p" / "train.parquet"))
    assert len(load_split(c.data, "eval")) == 3


def test_malformed_jsonl_names_file_and_line(tmp_path):
    good = json.dumps(RECORDS["boolq"][0])
    for bad_line, msg in (("{not json", "not valid JSON"),
                          (json.dumps({"passage": "x", "label": 1}), "missing field 'question'"),
                          (json.dumps({"passage": "x", "question": 3, "label": 1}), "field 'question'"),
                          (json.dumps({"passage": "x", "question": "q", "label": 7}), "expected 0 or 1"),
                          ("[1, 2]", "expected a JSON object")):
        p = write_jsonl(str(tmp_path / "train.jsonl"), [good, "", bad_line])
        with pytest.raises(DataError, match=rf"train\.jsonl:3: .*{msg}"):
            load_split(cfg(task="boolq", train_file=p).data, "train")


def test_missing_split_file(tmp_path):
    write_jsonl(str(tmp_path / "train.jsonl"), [RECORDS["wic"][0]])
    with pytest.raises(DataError, match="no validation.jsonl"):
        load_split(cfg(task="wic", source=str(tmp_path)).data, "eval")


def test_sampling_is_seeded_and_takes_all_when_fewer():
    a = sample_indices(100, 10, seed=42)
    assert a == sample_indices(100, 10, seed=42)
    assert a != sample_indices(100, 10, seed=43)
    assert len(set(a)) == 10
    assert sorted(sample_indices(7, 1000, seed=42)) == list(range(7))


# ----------------------------------------------------------------------------- tokenization

@pytest.mark.parametrize("bos", [False, True])
def test_labels_mask_prompt_and_seam_matches_joint_encoding(bos):
    tok = byte_bpe_tokenizer(bos)
    record, prompt, candidates, label = RECORDS["copa"]
    ex = format_example("copa", record)
    out = tokenize_train_example(ex, tok, 64, "truncate")
    joint = tok(prompt + candidates[label])["input_ids"]
    assert out["input_ids"] == joint + [tok.eos_token_id]
    n_answer = sum(1 for x in out["labels"] if x != -100)
    assert out["labels"][-n_answer:] == out["input_ids"][-n_answer:]
    assert tok.decode(out["input_ids"][-n_answer:-1]).strip() == candidates[label].strip()
    assert all(x == -100 for x in out["labels"][:-n_answer])
    assert out["truncated"] == 0
    ev, _ = tokenize_eval_example(ex, tok, 64)
    for cand, ids in zip(candidates, ev.candidate_ids, strict=True):
        assert ev.context_ids + ids == tok(prompt + cand)["input_ids"]


def test_truncate_keeps_answer_and_bos_reject_drops():
    tok = byte_bpe_tokenizer(True)
    ex = format_example("rte", RECORDS["rte"][0])
    full = tokenize_train_example(ex, tok, 512)
    n = len(full["input_ids"])
    cut = tokenize_train_example(ex, tok, n - 5)
    assert len(cut["input_ids"]) == n - 5 and cut["truncated"] == 5
    assert cut["input_ids"][0] == tok.bos_token_id  # BOS kept, prompt cut after it
    assert cut["input_ids"][1:] == full["input_ids"][6:]
    assert tokenize_train_example(ex, tok, n - 5, "reject") is None
    assert tokenize_train_example(ex, tok, 2) is None  # the answer and EOS alone do not fit


def test_build_datasets_counts_truncated_and_rejected(tmp_path):
    tok = byte_bpe_tokenizer()
    long = {"passage": "word " * 80, "question": "is it", "label": 1}
    recs = boolq_records(10) + [long, long]
    write_jsonl(str(tmp_path / "train.jsonl"), recs)
    write_jsonl(str(tmp_path / "validation.jsonl"), recs[:4] + [long])
    base = {"model": {"path": "x"}, "lomo": {"lr": 0.03}, "data": {"task": "boolq", "source": str(tmp_path)}}
    for mode in ("truncate", "reject"):
        c = load_run_config(base, {"tokenizer.max_length": 40, "tokenizer.overlong": mode})
        ds = build_datasets(c, tok)
        s = ds.stats
        if mode == "truncate":
            assert (s["train_truncated"], s["train_rejected"], s["train_size"]) == (2, 0, 12)
            assert (s["eval_truncated"], s["eval_rejected"], s["eval_size"]) == (1, 0, 5)
            assert max(len(e["input_ids"]) for e in ds.train) == 40
        else:
            assert (s["train_truncated"], s["train_rejected"], s["train_size"]) == (0, 2, 10)
            assert (s["eval_truncated"], s["eval_rejected"], s["eval_size"]) == (0, 1, 4)
        assert all(len(e.candidate_ids) == 2 for e in ds.eval)
    # sampling: train_samples of a seeded permutation, the same every time
    c = load_run_config(base, {"data.train_samples": 5})
    a, b = build_datasets(c, tok), build_datasets(c, tok)
    assert len(a.train) == 5 and a.train == b.train


def test_instruction_task(tmp_path):
    tok = byte_bpe_tokenizer()
    p = write_jsonl(str(tmp_path / "ins.jsonl"), [{"prompt": "Say hi:", "response": " hi"}] * 3)
    c = load_run_config({"model": {"path": "x"}, "lomo": {"lr": 0.03},
                         "data": {"task": "instruction", "source": p, "eval_file": p}})
    ds = build_datasets(c, tok)
    assert len(ds.train) == 3 and ds.eval == [] and len(ds.eval_lm) == 3
    ex = ds.train[0]
    assert tok.decode([t for t in ex["labels"] if t != -100]) == " hi</s>"


def test_collate_right_pads():
    b = collate([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8]}], pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]


# ----------------------------------------------------------------------------- data order

def test_epoch_order_and_step_batches_reproducible():
    n, world, micro = 21, 2, 4
    o0 = epoch_order(n, 42, 0)
    assert sorted(o0) == list(range(n)) and o0 == epoch_order(n, 42, 0) and o0 != epoch_order(n, 42, 1)
    spe = steps_per_epoch(n, world, micro)
    assert spe == 3
    seen = []
    for s in range(spe):
        for r in range(world):
            b = batches_for_step(o0, s, world, micro, r)
            assert len(b) == micro  # every rank always has a full micro batch
            seen += b
    assert set(seen) == set(range(n))  # every example in every epoch (the last batch tops up)
    assert position_of_step(7, spe) == (2, 1)


def test_accumulation_windows_cover_the_epoch_and_the_last_is_shorter():
    """K = 3 micro-batches per step over an epoch of 10 global micro-batches: steps of 3, 3, 3 and
    a last window of 1 (applied with its own 1/k by the engines); no micro-batch twice, none
    carried over, and K = 1 is the micro-batch order itself."""
    n, world, micro = 40, 2, 2
    assert micro_batches_per_epoch(n, world, micro) == 10
    assert steps_per_epoch(n, world, micro, accumulation=3) == 4
    windows = [window_of_step(s, n, world, micro, 3) for s in range(4)]
    assert [list(w) for w in windows] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert [list(window_of_step(s, n, world, micro)) for s in range(3)] == [[0], [1], [2]]
    assert steps_per_epoch(n, world, micro, accumulation=5) == 2  # divides: no short window
