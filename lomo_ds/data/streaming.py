"""The training data as a stream (data.streaming): local JSONL and Parquet files read through
`datasets`' streaming mode, never loaded whole.

    batches = StreamedBatches(run_cfg, tokenizer, world)
    batches.window(step, k)   # step's k global micro-batches, each [rank][micro-batch rows]

The stream, a pure function of the config (so every rank builds the same one, without communication):
  1. each source's records in a seeded shuffle buffer of data.shuffle_buffer records
     (numpy's generator seeded by (train.seed, source, pass)); at its end a source starts its next
     pass, reshuffled: a stream never ends, so a small source repeats as long as the run needs it;
  2. each record tokenized as it comes (data/formats.py; the chat template, the prompt/response
     encoding or the text's tokens);
  3. the sources interleaved by weight: the next example comes from the source whose count is the
     most behind its share (the one whose next example's virtual time (count + 1/2) / weight is the
     earliest; ties: the earlier source), data/mixture.py's rule for an unbounded sequence;
  4. with data.packing, packed on the fly into rows of at most tokenizer.max_length;
  5. cut into global micro-batches of ranks x train_micro_batch_size_per_gpu rows, rank r taking
     its r-th micro-batch (every rank reads and tokenizes the whole stream and keeps its own rows).

A step takes exactly gradient_accumulation_steps global micro-batches (a stream has no epochs, so
no short window), so the rows consumed before step k are the first k x accumulation global
micro-batches. On resume the stream is rebuilt and those are read again and skipped: the steps
after a resume see exactly what an uninterrupted run's saw. The skip costs the time to read and
tokenize what was consumed (the shuffle buffer's contents are not part of a checkpoint).
Evaluation sets are small and loaded whole (data/mixture.py add_eval_sets).
"""
from __future__ import annotations

import functools
import itertools
import os
from typing import Iterator

import numpy as np

from lomo_ds.data.errors import DataError
from lomo_ds.data.mixture import Source, add_eval_sets, chat_of, encoder_for, resolve_sources
from lomo_ds.data.packing import pack_stream
from lomo_ds.data.types import Datasets

_SHUFFLE_STREAM = 13  # the shuffle buffers' seed stream
JSON_BLOCK_BYTES = 1 << 20


def stream_records(path: str) -> Iterator[tuple[dict, str]]:
    """(record, 'path:record N') of a JSONL/JSON or Parquet file through datasets' streaming mode.
    Fields that are null only because another record has them are dropped (datasets gives every
    record the union of the file's columns)."""
    builder = "parquet" if path.endswith(".parquet") else "json"
    try:
        for i, r in enumerate(_streamed(builder, os.path.abspath(path)), 1):
            yield {k: v for k, v in r.items() if v is not None}, f"{path}:record {i}"
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except DataError:
        raise
    except Exception as e:  # pyarrow's and datasets' own error types for a damaged file
        raise DataError(f"{path}: cannot read as {'Parquet' if builder == 'parquet' else 'JSON lines'} "
                        f"({' '.join(str(e).split())[:300]})") from None


@functools.lru_cache(maxsize=64)
def _streamed(builder: str, path: str):
    """The file's datasets.IterableDataset, built once (a small source is read pass after pass)."""
    import datasets  # start-up time: only a streamed run needs it here

    # JSON is parsed in blocks of this many bytes (datasets' default, 10 MB, holds about 100 MB of
    # parser buffers; 1 MB about 15, as fast).
    options = {"chunksize": JSON_BLOCK_BYTES} if builder == "json" else {}
    return datasets.load_dataset(builder, data_files=path, split="train", streaming=True, **options)


def shuffled(items: Iterator, buffer: int, rng: np.random.Generator) -> Iterator:
    """`items` through a shuffle buffer of `buffer` items: each item read replaces a random one of the
    buffer, which is given out; the rest, shuffled, at the end."""
    buf: list = []
    for item in items:
        if len(buf) < buffer:
            buf.append(item)
            continue
        i = int(rng.integers(buffer))
        yield buf[i]
        buf[i] = item
    for i in rng.permutation(len(buf)):
        yield buf[int(i)]


def source_examples(src: Source, index: int, encoder, buffer: int, seed: int) -> Iterator[dict]:
    """A source's training examples, pass after pass, each pass reshuffled."""
    for pass_no in itertools.count():
        rng = np.random.default_rng([seed, _SHUFFLE_STREAM, index, pass_no])
        n = 0
        for record, where in shuffled(stream_records(src.train_path), buffer, rng):
            for ex in encoder(record, where):
                n += 1
                yield ex
        if n == 0:
            raise DataError(f"{src.key} ({src.train_path}): no training examples ({encoder.stats['read']} records "
                            f"read, {encoder.stats['dropped_too_long']} longer than tokenizer.max_length)")


def interleaved(streams: list[Iterator[dict]], weights: list[float]) -> Iterator[dict]:
    """The streams mixed by weight (module docstring, 3), each example tagged with its source's index."""
    counts = [0] * len(streams)
    while True:
        i = min(range(len(streams)), key=lambda s: ((counts[s] + 0.5) / weights[s], s))
        counts[i] += 1
        yield {**next(streams[i]), "source": i}


class StreamedBatches:
    """The stream of a run's training rows (module docstring), cut into steps."""

    def __init__(self, run_cfg, tokenizer, world: int, sources: list[Source] | None = None, chat=None):
        self.cfg, self.tokenizer, self.world = run_cfg, tokenizer, world
        self.micro = run_cfg.micro_batch
        self.sources = sources if sources is not None else resolve_sources(run_cfg)
        self.chat = chat if chat is not None else chat_of(run_cfg, tokenizer, self.sources)
        self.encoders: list = []
        self._batches: Iterator[list[dict]] | None = None
        self._next = 0  # the global micro-batch self._batches gives next

    def rows(self) -> Iterator[dict]:
        """The training rows from the start: examples, or packed rows (data.packing)."""
        d = self.cfg.data
        self.encoders = [encoder_for(s, self.cfg, self.tokenizer, self.chat, split_long=d.packing)
                         for s in self.sources]
        streams = [source_examples(s, i, enc, d.shuffle_buffer, self.cfg.train.seed)
                   for i, (s, enc) in enumerate(zip(self.sources, self.encoders, strict=True))]
        examples = interleaved(streams, [s.weight for s in self.sources])
        return pack_stream(examples, self.cfg.tokenizer.max_length) if d.packing else examples

    def global_micro_batches(self) -> Iterator[list[dict]]:
        rows, size = self.rows(), self.world * self.micro
        while True:
            yield [next(rows) for _ in range(size)]

    def window(self, step: int, accumulation: int) -> list[list[list[dict]]]:
        """Optimizer step `step`'s `accumulation` global micro-batches, each as every rank's rows;
        the stream is rebuilt and the consumed micro-batches skipped where it is not at that step."""
        want = step * accumulation
        if self._batches is None or want < self._next:
            self._batches, self._next = self.global_micro_batches(), 0
        for _ in range(want - self._next):
            next(self._batches)
        out = [next(self._batches) for _ in range(accumulation)]
        self._next = want + accumulation
        return [[g[r * self.micro:(r + 1) * self.micro] for r in range(self.world)] for g in out]

    def check_first_records(self) -> None:
        """Each source's first record read and encoded: a wrong file or format fails here, before a
        model is loaded, not at the first step."""
        for src in self.sources:
            enc = encoder_for(src, self.cfg, self.tokenizer, self.chat, split_long=True)
            for record, where in stream_records(src.train_path):
                enc(record, where)
                break
            else:
                raise DataError(f"{src.key} ({src.train_path}): no records")


def build_streamed_datasets(run_cfg, tokenizer, world: int) -> tuple[StreamedBatches, Datasets]:
    """The training stream (its first records checked) and the evaluation sets, loaded whole."""
    sources = resolve_sources(run_cfg)
    chat = chat_of(run_cfg, tokenizer, sources)
    stream = StreamedBatches(run_cfg, tokenizer, world, sources, chat)
    stream.check_first_records()
    d = run_cfg.data
    shares = np.asarray([s.weight for s in sources]) / sum(s.weight for s in sources)
    out = Datasets(train=[], eval=[], stats={
        "streaming": True, "shuffle_buffer": d.shuffle_buffer, "packing": d.packing,
        "sources": {s.name: {"format": s.format, "share": round(float(w), 4), "path": s.train_path}
                    for s, w in zip(sources, shares, strict=True)},
        "note": "sources repeat (reshuffled) whenever they run out"})
    out.packed = d.packing  # the stream's rows are packed ones
    add_eval_sets(out, run_cfg, tokenizer, sources, chat)
    return stream, out
