"""data.streaming (lomo_ds/data/streaming.py): a stream resumed at step k gives steps [k, n) exactly
what an uninterrupted stream gave them; packing on the fly; every rank its own rows of the same
global micro-batches; the mixture's shares; the shuffle buffer's bound; and the resident memory of
streaming a file against its size (benchmarks/stream_memory.py at 1 GB)."""
from __future__ import annotations

import os

import numpy as np
import pytest

from lomo_ds.config.run import load_run_config
from lomo_ds.data.errors import DataError
from lomo_ds.data.streaming import StreamedBatches, build_streamed_datasets, shuffled
from tests.data.test_mixture import write_sources
from tests.helpers_data import chatml_tokenizer, conversation, write_jsonl


def stream_cfg(sources, micro=2, packing=True, max_length=48, shuffle_buffer=7, seed=3, **data):
    return load_run_config({"train_micro_batch_size_per_gpu": micro, "model": {"path": "x"}, "lomo": {"lr": 0.03},
                            "tokenizer": {"max_length": max_length}, "train": {"max_steps": 10, "seed": seed},
                            "data": {"sources": sources, "streaming": True, "packing": packing,
                                     "shuffle_buffer": shuffle_buffer, **data}})


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    # Small files and a 7-record shuffle buffer: the steps below cross several passes of each source.
    return write_sources(tmp_path_factory.mktemp("stream"), n_chat=16, n_pr=12, n_text=9)


def seen(windows) -> list:
    """Every row of every rank of every global micro-batch, as token tuples."""
    return [tuple(row["input_ids"]) for w in windows for g in w for rank in g for row in rank]


@pytest.mark.parametrize("packing", [True, False])
def test_resumed_stream_continues_exactly_where_the_step_left_it(sources, packing):
    cfg, tok, n, k, acc = stream_cfg(sources, packing=packing), chatml_tokenizer(), 9, 5, 2
    straight = StreamedBatches(cfg, tok, world=2)
    steps = [straight.window(s, acc) for s in range(n)]
    resumed = StreamedBatches(cfg, tok, world=2)  # a new process: nothing carried over but the step
    after = [resumed.window(s, acc) for s in range(k, n)]
    assert seen(after) == seen(steps[k:])
    assert seen(after[:1]) != seen(steps[:1])  # it did skip: step k's rows are not step 0's
    # 9 steps x 2 micro-batches x 2 ranks x 2 rows = 72 rows of 37 records: the sources were re-read.
    assert sum(enc.stats["read"] for enc in straight.encoders) > 37
    # Asking for an earlier step rebuilds the stream.
    assert seen([straight.window(2, acc)]) == seen(steps[2:3])


def test_packing_on_the_fly_fills_rows_of_at_most_max_length(sources):
    cfg, tok = stream_cfg(sources, max_length=48), chatml_tokenizer()
    stream = StreamedBatches(cfg, tok, 2)
    rows = [r for w in (stream.window(s, 1) for s in range(12)) for g in w for rank in g for r in rank]
    assert all(len(r["input_ids"]) <= 48 for r in rows)
    assert all(sum(r["lengths"]) == len(r["input_ids"]) == len(r["labels"]) for r in rows)
    assert max(len(r["lengths"]) for r in rows) > 1  # rows hold several examples
    assert np.mean([len(r["input_ids"]) for r in rows]) > 36  # and are nearly full
    # texts longer than a row are cut into pieces rather than lost: some rows are exactly full of one
    assert any(r["lengths"] == [48] for r in rows)


def test_every_rank_takes_its_own_rows_of_the_same_global_micro_batches(sources):
    cfg, tok = stream_cfg(sources, micro=3), chatml_tokenizer()
    rank_views = [StreamedBatches(cfg, tok, world=3).window(4, 2) for _ in range(3)]  # each rank builds its own
    assert seen([rank_views[0]]) == seen([rank_views[1]]) == seen([rank_views[2]])
    for g in rank_views[0]:
        assert [len(rows) for rows in g] == [3, 3, 3]
        ids = [id(r) for rows in g for r in rows]
        assert len(set(ids)) == 9  # nine different rows: no rank shares one


def test_the_stream_mixes_by_weight_and_is_seeded(sources):
    tok = chatml_tokenizer()
    cfg = stream_cfg(sources, micro=10, packing=False)
    rows = [r for g in StreamedBatches(cfg, tok, 2).window(0, 50) for rank in g for r in rank]  # 1,000 examples
    counts = np.bincount([r["source"] for r in rows], minlength=3) / len(rows)
    assert len(rows) == 1000 and np.abs(counts - [0.5, 0.25, 0.25]).max() <= 0.02
    again = StreamedBatches(stream_cfg(sources, micro=10, packing=False), tok, 2).window(0, 3)
    other = StreamedBatches(stream_cfg(sources, micro=10, packing=False, seed=4), tok, 2).window(0, 3)
    first = StreamedBatches(cfg, tok, 2).window(0, 3)
    assert seen([again]) == seen([first]) and seen([other]) != seen([first])


def test_the_shuffle_buffer_holds_at_most_its_size():
    consumed = []

    def source():
        for i in range(100):
            consumed.append(i)
            yield i

    out = []
    for x in shuffled(source(), 10, np.random.default_rng(0)):
        assert len(consumed) <= len(out) + 11  # the buffer, and the item being swapped in
        out.append(x)
    assert sorted(out) == list(range(100)) and out != list(range(100))


def test_a_streamed_chat_task_is_one_source_with_its_eval_split(tmp_path):
    write_jsonl(str(tmp_path / "train.jsonl"), [conversation(f"hi {i}", f"the cat {i}") for i in range(6)])
    write_jsonl(str(tmp_path / "validation.jsonl"), [conversation("hi", "the cat")])
    cfg = load_run_config({"model": {"path": "x"}, "lomo": {"lr": 0.03}, "train": {"max_steps": 2},
                           "data": {"task": "chat", "source": str(tmp_path), "streaming": True}})
    stream, data = build_streamed_datasets(cfg, chatml_tokenizer(), world=2)
    assert list(data.stats["sources"]) == ["chat"] and len(data.eval_by_source["chat"]) == 1
    assert len(seen([stream.window(0, 1)])) == 2 * cfg.micro_batch


def test_a_bad_file_fails_before_training(tmp_path):
    sources = write_sources(tmp_path, 3, 3, 3)
    (tmp_path / "b.jsonl").write_text('{"prompt": "p", "answer": "r"}\n')
    with pytest.raises(DataError, match=r"b\.jsonl:record 1: missing field 'response'"):
        build_streamed_datasets(stream_cfg(sources), chatml_tokenizer(), world=1)
    (tmp_path / "b.jsonl").write_text('{"prompt": "p", "response": \n')
    with pytest.raises(DataError, match=r"b\.jsonl: cannot read as JSON lines"):
        build_streamed_datasets(stream_cfg(sources), chatml_tokenizer(), world=1)


FILE_MB = 64
SHUFFLE_BUFFER = 1000  # records: a small buffer, so that what the stream holds stays far below the file


@pytest.mark.long  # writes and tokenizes 64 MB: LOMO_DS_LONG_TESTS=1 (CI)
def test_streaming_a_file_does_not_hold_it_in_memory(tmp_path):
    """The 1 GB check's code (benchmarks/stream_memory.py) on a 64 MB file, read whole once: holding
    the file's records in memory (as loading it whole does) would grow the resident size by more
    than the file's size (its text as Python strings, before any token); a stream holds its shuffle
    buffer of 1,000 records, the reader's blocks and the tokenizer's work: 34 MB here (with the
    default 10,000-record buffer, about 50 MB whatever the file's size: 53 MB for 32 MB, 51 MB for
    64 MB). Importing datasets (about 55-80 MB, once) is not the data's and is left out."""
    from benchmarks.stream_memory import stream_file, write_text_jsonl

    path = str(tmp_path / "corpus.jsonl")
    records = write_text_jsonl(path, FILE_MB)
    r = stream_file(path, records, shuffle_buffer=SHUFFLE_BUFFER)
    print(r)
    assert r["records_read"] >= records  # the whole file went through
    assert os.path.getsize(path) >= FILE_MB * 2**20
    streaming_growth = r["rss_growth_mb"] - r["of_which_import_datasets_mb"]
    assert streaming_growth < FILE_MB * 0.75, r
