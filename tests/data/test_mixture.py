"""data.sources (lomo_ds/data/mixture.py, formats.py): three sources in three formats mixed by
weight, every window of 1,000 examples within 2 points of the weights, the order a function of the
seeds; the text format; each source's eval set; and the config's one-line refusals."""
from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lomo_ds.config.errors import ConfigError
from lomo_ds.config.run import load_run_config
from lomo_ds.data.errors import DataError
from lomo_ds.data.formats import encode_text
from lomo_ds.data.loading import build_datasets
from lomo_ds.data.mixture import apportion, interleave
from lomo_ds.data.packing import train_order
from tests.helpers_data import chatml_tokenizer, conversation, write_jsonl

WORDS = ["the cat", "sat on", "the mat", "was lovely", "went out", "it was sunny"]


def write_sources(root, n_chat=40, n_pr=30, n_text=20) -> list[dict]:
    """A chat folder (with a validation split), a prompt/response JSONL and a text Parquet file;
    every record's content names its source and number, so an example can be traced back."""
    write_jsonl(str(root / "a" / "train.jsonl"),
                [conversation(f"chat {i} {WORDS[i % 6]}", f"answer {i}") for i in range(n_chat)])
    write_jsonl(str(root / "a" / "validation.jsonl"), [conversation(f"q {i}", f"a {i}") for i in range(4)])
    write_jsonl(str(root / "b.jsonl"), [{"prompt": f"prompt {i}", "response": f"response {i}"} for i in range(n_pr)])
    pq.write_table(pa.Table.from_pylist([{"body": f"text {i} " + "the weather was lovely " * (1 + 3 * (i % 5))}
                                         for i in range(n_text)]), str(root / "c.parquet"))
    return [{"path": str(root / "a"), "format": "chat", "weight": 2},
            {"path": str(root / "b.jsonl"), "format": "prompt_response", "weight": 1},
            {"path": str(root / "c.parquet"), "format": "text", "weight": 1, "columns": {"text": "body"}}]


def cfg(sources, max_length=64, train=None, seed=None, **data):
    """A run config over `sources`; `seed`: the run's one seed (train.seed)."""
    train = {**(train or {}), **({"seed": seed} if seed is not None else {})}
    return load_run_config({"model": {"path": "x"}, "lomo": {"lr": 0.03}, "tokenizer": {"max_length": max_length},
                            "train": train, "data": {"sources": sources, **data}})


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    sources = write_sources(root)
    return root, sources, build_datasets(cfg(sources, train_samples=3000, seed=5), chatml_tokenizer())


def test_three_formats_mixed_within_two_points_over_any_1000_examples(mixed):
    _, _, data = mixed
    shares = np.array([0.5, 0.25, 0.25])
    for epoch in (0, 1):
        src = data.mixture.sources_of(train_order(data, 42, epoch, 4))
        assert len(src) == 3000 and np.bincount(src).tolist() == [1500, 750, 750]
        # Every window of 1,000 consecutive examples (counts by a running sum).
        onehot = np.eye(3)[src]
        sums = np.cumsum(np.vstack([np.zeros(3), onehot]), axis=0)
        windows = (sums[1000:] - sums[:-1000]) / 1000
        worst = np.abs(windows - shares).max()
        assert worst <= 0.02, worst
    # Independent draws by weight would not hold it: the same check on such a sequence fails.
    draws = np.random.default_rng(0).choice(3, size=3000, p=shares)
    sums = np.cumsum(np.vstack([np.zeros(3), np.eye(3)[draws]]), axis=0)
    assert np.abs((sums[1000:] - sums[:-1000]) / 1000 - shares).max() > 0.02


def test_the_order_is_a_function_of_the_seeds(mixed):
    root, sources, data = mixed
    tok = chatml_tokenizer()

    def sequence(d, train_seed=42, epoch=0):
        return [tuple(d.train[i]["input_ids"]) for i in train_order(d, train_seed, epoch, 4)]

    again = build_datasets(cfg(sources, train_samples=3000, seed=5), tok)
    other_seed = build_datasets(cfg(sources, train_samples=3000, seed=6), tok)
    assert sequence(again) == sequence(data)
    assert sequence(data, train_seed=43) != sequence(data)  # which example fills a source's slot
    assert sequence(other_seed) != sequence(data)  # which examples a repeated/sampled source gives
    assert sequence(data, epoch=1) != sequence(data, epoch=0)
    # The pattern of sources is the same in every case: only the examples in a source's slots move.
    pattern = data.mixture.sources_of(train_order(data, 42, 0, 4))
    assert (data.mixture.sources_of(train_order(data, 43, 1, 4)) == pattern).all()


def test_small_sources_are_repeated_and_said_so(mixed):
    _, _, data = mixed
    s = data.stats["sources"]
    # 3000 examples: chat 1500 of 40 records, prompt/response 750 of 30, text 750 of 20.
    assert s["a"]["repeated"] == "37.50x" and s["b"]["repeated"] == "25.00x" and s["c"]["repeated"] == "37.50x"
    assert s["a"]["train"]["read"] == 40 and s["c"]["in_mixture"] == 750
    # Every example of a source appears, each about equally often.
    texts = [json.dumps(e["input_ids"]) for e in data.train]
    assert len(set(texts)) == 90


def test_sampled_without_train_samples_and_eval_per_source(mixed):
    root, sources, _ = mixed
    data = build_datasets(cfg(sources), chatml_tokenizer())  # as many as the sources hold: 90
    s = data.stats["sources"]
    assert [s[n]["in_mixture"] for n in "abc"] == [45, 23, 22]  # 90 x 2/4, 1/4, 1/4 by largest remainder
    assert "repeated" in s["a"] and "repeated" not in s["b"]  # 45 of 40 repeats; 23 of 30 is a sample
    assert list(data.eval_by_source) == ["a"] and len(data.eval_by_source["a"]) == 4  # only a has validation
    assert data.eval_lm == data.eval_by_source["a"] and data.stats["eval_size"] == 4


def test_formats_each_encoded_as_their_tasks_are(mixed):
    root, sources, data = mixed
    tok = chatml_tokenizer()
    by_prefix = {}
    for e in data.train:
        by_prefix.setdefault(tok.decode(e["input_ids"])[:12], e)
    text = next(e for k, e in by_prefix.items() if k.startswith("text "))
    assert text["labels"] == text["input_ids"] and text["input_ids"][-1] == tok.eos_token_id  # every token
    pr = next(e for k, e in by_prefix.items() if k.startswith("prompt "))
    assert pr["labels"][0] == -100 and pr["labels"][-1] == tok.eos_token_id  # the response and EOS only
    chat = next(e for k, e in by_prefix.items() if "<|im_start|>" in k)
    assert -100 in chat["labels"] and tok.convert_tokens_to_ids("<|im_end|>") in chat["labels"]


def test_text_longer_than_max_length_is_split_when_packing_else_truncated():
    tok = chatml_tokenizer()
    text = "the weather was lovely " * 40
    whole = len(tok(text)["input_ids"]) + 1
    pieces, cut = encode_text(tok, text, 32, split_long=True, overlong="truncate")
    assert cut and [len(p["input_ids"]) for p in pieces][:-1] == [32] * (len(pieces) - 1)
    # No token lost (but a 1-token tail: it has nothing to predict).
    assert sum(len(p["input_ids"]) for p in pieces) >= whole - 1
    one, _ = encode_text(tok, text, 32, split_long=False, overlong="truncate")
    assert [len(p["input_ids"]) for p in one] == [32]
    assert encode_text(tok, text, 32, split_long=False, overlong="reject")[0] == []


def test_packed_mixture_rows_fit_and_keep_the_order(mixed):
    root, sources, _ = mixed
    data = build_datasets(cfg(sources, max_length=48, train_samples=200, packing=True), chatml_tokenizer())
    assert data.packed and data.mixture is None
    assert all(len(r["input_ids"]) <= 48 for r in data.train) and data.stats["train_packed_rows"] == len(data.train)
    assert train_order(data, 42, 0, 4) == train_order(data, 43, 3, 4) == list(range(len(data.train)))


def test_apportion_and_interleave():
    assert apportion(10, [2, 1, 1]) == [5, 3, 2] and sum(apportion(7, [0.5, 0.3, 0.2])) == 7
    pattern = interleave([4, 2, 2]).tolist()
    assert pattern == [0, 1, 2, 0, 0, 1, 2, 0]
    assert interleave([0, 3]).tolist() == [1, 1, 1]


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("change, message", [
    (lambda s: s[1].update(weight=0), "data.sources[1].weight: expected a positive number, got 0"),
    (lambda s: s[2].update(weight=-1.5), "data.sources[2].weight: expected a positive number, got -1.5"),
    (lambda s: s[0].update(format="markdown"),
     "data.sources[0].format: expected one of ['chat', 'prompt_response', 'text'], got 'markdown'"),
    (lambda s: s[1].update(path="/nowhere/b.jsonl"),
     "data.sources[1].path: no such file or directory: '/nowhere/b.jsonl'"),
    (lambda s: s[0].update(split="nosuch"), "data.sources[0].split: "),
    (lambda s: s[1].update(name="a"), "data.sources[1].name: 'a' names data.sources[0] too"),
    (lambda s: s[0].update(wieght=2), "data.sources[0].wieght: unknown key"),
])
def test_bad_sources_refused_in_one_line_naming_the_field(tmp_path, change, message):
    sources = write_sources(tmp_path, 3, 3, 3)
    change(sources)
    with pytest.raises(ConfigError) as e:
        cfg(sources)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("extra, message", [
    ({"task": "chat"}, "data.task: data.sources replaces the single dataset's keys"),
    ({"train_file": "x.jsonl"}, "data.train_file: data.sources replaces"),
    ({"sources": []}, "data.sources: expected a list of at least 1 item(s)"),
    ({"streaming": True}, "data.streaming: a stream's length is unknown, so the run's length is too; set "
                          "train.max_steps"),
])
def test_conflicting_data_keys_refused(tmp_path, extra, message):
    sources = write_sources(tmp_path, 3, 3, 3)
    with pytest.raises(ConfigError, match="^<config>: " + message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[")):
        cfg(extra.pop("sources", sources), **extra)


def test_streaming_refusals():
    base = {"model": {"path": "x"}, "lomo": {"lr": 0.03}, "train": {"max_steps": 3}}
    with pytest.raises(ConfigError, match="data.streaming: streams the chat and instruction tasks' records"):
        load_run_config({**base, "data": {"task": "builtin", "streaming": True}})
    with pytest.raises(ConfigError, match="data.streaming: a stream's length is unknown"):
        load_run_config({**base, "train": {}, "data": {"task": "chat", "source": "hub:x/y", "streaming": True}},
                        check_files=False)
    with pytest.raises(ConfigError, match="data.streaming: streams local JSONL and Parquet files"):
        load_run_config({**base, "data": {"task": "chat", "source": "hub:x/y", "streaming": True}}, check_files=False)


def test_a_bad_record_names_its_file_and_line(tmp_path):
    sources = write_sources(tmp_path, 3, 3, 3)
    write_jsonl(str(tmp_path / "b.jsonl"), [{"prompt": "p", "response": "r"}, {"prompt": "p"}])
    with pytest.raises(DataError, match=r"b\.jsonl:2: missing field 'response'"):
        build_datasets(cfg(sources), chatml_tokenizer())
    sources[2]["columns"] = {}  # the Parquet file's column is "body"
    write_jsonl(str(tmp_path / "b.jsonl"), [{"prompt": "p", "response": "r"}])
    with pytest.raises(DataError, match=r"c\.parquet:row 1: text: expected a non-empty string, got no text field"):
        build_datasets(cfg(sources), chatml_tokenizer())
    assert os.path.exists(tmp_path / "c.parquet")
