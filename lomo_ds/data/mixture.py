"""Several datasets mixed by weight (data.sources), loaded and tokenized in memory; data/streaming.py
streams the same sources.

    data = build_mixture_datasets(run_cfg, tokenizer)   # Datasets with .mixture; eval loss per source

The training list holds N examples (data.train_samples; unset: as many as the sources hold
together), each source's share split by largest remainder: quota_i = N * weight_i / sum(weights).
A source's quota is the first quota_i of a seeded (train.seed) permutation of its examples; a source
smaller than its quota is repeated (the run's data line says how many times), a larger one sampled.

The order interleaves the sources evenly: source i's j-th example is placed at the virtual time
(j + 1/2) / quota_i, and the examples follow in that time's order (ties: the earlier source). Every
prefix of the sequence then holds within about one example of each source's share, so any window of
1,000 consecutive examples is within a fraction of a point of the weights. This pattern is fixed;
what changes with (train.seed, epoch) is which of its examples fills each of a source's slots (a
permutation of the source's examples per epoch), so the order is, like the single dataset's, a pure
function of (seed, epoch, step) and a resumed run replays it exactly. A mixture is therefore never
grouped by length (that would reorder it). With data.packing the examples are packed in the epoch-0
sequence's order into rows that keep that order in every epoch, so the rows carry the same mixture.

Evaluation: each source with an evaluation split (a folder's <eval_split>.{jsonl,parquet}) is
evaluated by its loss (eval/loss/<name>); eval/loss is over all of them, every token weighing the same.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from lomo_ds.config.run import source_name
from lomo_ds.config.tasks import split_file
from lomo_ds.data.chat import chat_format
from lomo_ds.data.errors import DataError
from lomo_ds.data.formats import Encoder
from lomo_ds.data.io import read_records, sample_indices, split_path
from lomo_ds.data.packing import pack_stream
from lomo_ds.data.types import Datasets

_MIX_STREAM = 11  # the mixture's seed stream, apart from the epoch orders' and packing's


@dataclass(frozen=True)
class Source:
    """A source resolved to its files: data.sources[i], or a streamed chat/instruction task's data."""

    name: str
    format: str
    weight: float
    train_path: str
    eval_path: str | None
    columns: dict
    key: str  # the config key errors name: "data.sources[1]", or "data" for a task's data


def resolve_sources(run_cfg) -> list[Source]:
    """The run's sources: data.sources, or the chat / instruction task's files as one source."""
    d = run_cfg.data
    if d.sources is None:
        fmt = {"chat": "chat", "instruction": "prompt_response"}.get(d.task)
        if fmt is None:
            raise ValueError(f"task {d.task!r} has no source format")
        return [Source(d.task, fmt, 1.0, split_path(d, "train", run_cfg.eval.split),
                       split_path(d, "eval", run_cfg.eval.split), dict(d.columns), "data")]
    out = []
    for i, s in enumerate(d.sources):
        key = f"data.sources[{i}]"
        if os.path.isdir(s.path):
            train = split_file(s.path, s.split)
            if train is None:
                raise DataError(f"{key}.split: {s.path} has no {s.split}.jsonl or {s.split}.parquet")
            evaluation = split_file(s.path, s.eval_split) if s.eval_split else None
        else:
            train, evaluation = s.path, None
        out.append(Source(source_name(s), s.format, s.weight, train, evaluation, dict(s.columns), key))
    return out


def apportion(total: int, weights: list[float]) -> list[int]:
    """`total` split by `weights` (largest remainder): whole numbers that sum to `total`."""
    w = np.asarray(weights, dtype=np.float64)
    exact = total * w / w.sum()
    out = np.floor(exact).astype(np.int64)
    # The remainders, largest first (ties: the earlier source), each take one more.
    for i in np.lexsort((np.arange(len(w)), -(exact - out)))[:total - int(out.sum())]:
        out[i] += 1
    return [int(x) for x in out]


def interleave(quotas: list[int]) -> np.ndarray:
    """The source index of every position of an even interleaving of the sources (module docstring)."""
    times = np.concatenate([(np.arange(q) + 0.5) / q for q in quotas if q] or [np.zeros(0)])
    source = np.concatenate([np.full(q, i) for i, q in enumerate(quotas) if q] or [np.zeros(0, dtype=np.int64)])
    return source[np.lexsort((source, times))].astype(np.int64)


@dataclass
class Mixture:
    """The mixed training list's order: `pattern` (the source of each position) and `blocks`
    (each source's indices into Datasets.train)."""

    pattern: np.ndarray
    blocks: list[np.ndarray]

    def order(self, seed: int, epoch: int) -> list[int]:
        """The epoch's order of Datasets.train: the fixed pattern, each source's slots filled by a
        permutation of its block drawn from (seed, epoch)."""
        out = np.empty(len(self.pattern), dtype=np.int64)
        for i, block in enumerate(self.blocks):
            perm = np.random.default_rng([seed, epoch, _MIX_STREAM, i]).permutation(len(block))
            out[self.pattern == i] = block[perm]
        return out.tolist()

    def sources_of(self, order: list[int]) -> np.ndarray:
        """The source of each example index in `order`."""
        of = np.empty(sum(len(b) for b in self.blocks), dtype=np.int64)
        for i, block in enumerate(self.blocks):
            of[block] = i
        return of[np.asarray(order, dtype=np.int64)]


def encoder_for(src: Source, run_cfg, tokenizer, chat, split_long: bool) -> Encoder:
    t = run_cfg.tokenizer
    return Encoder(src.format, tokenizer, t.max_length, t.overlong, chat=chat, columns=src.columns,
                   split_long=split_long)


def chat_of(run_cfg, tokenizer, sources: list[Source]):
    """The tokenizer's ChatFormat where a source is a chat one (its template is then required)."""
    return chat_format(tokenizer, run_cfg.tokenizer.chat_template) if any(s.format == "chat" for s in sources) else None


def add_eval_sets(out: Datasets, run_cfg, tokenizer, sources: list[Source], chat) -> None:
    """Each source's evaluation split, tokenized whole (examples truncated, never split), sampled to
    data.eval_samples per source: out.eval_by_source, and all of them in out.eval_lm."""
    d = run_cfg.data
    for src in sources:
        if src.eval_path is None:
            continue
        enc = encoder_for(src, run_cfg, tokenizer, chat, split_long=False)
        examples = [ex for r, where in read_records(src.eval_path) for ex in enc(r, where)]
        kept = [examples[i] for i in sample_indices(len(examples), d.eval_samples, run_cfg.train.seed)]
        out.eval_by_source[src.name] = kept
        out.eval_lm += kept
        out.stats["sources"][src.name]["eval"] = {**enc.stats, "sampled": len(kept)}
    out.stats["eval_size"] = len(out.eval_lm)


def build_mixture_datasets(run_cfg, tokenizer) -> Datasets:
    """The mixed training list (module docstring) and each source's eval set; stats per source:
    records read, kept, truncated, dropped, the examples it gives the mixture and its repeats."""
    d, t = run_cfg.data, run_cfg.tokenizer
    sources = resolve_sources(run_cfg)
    chat = chat_of(run_cfg, tokenizer, sources)
    out = Datasets(train=[], eval=[], stats={"sources": {}})
    per_source = []
    for src in sources:
        enc = encoder_for(src, run_cfg, tokenizer, chat, split_long=d.packing)
        # Every record is checked, sampled or not: a bad line is an error, never skipped.
        examples = [ex for r, where in read_records(src.train_path) for ex in enc(r, where)]
        if not examples:
            raise DataError(f"{src.key} ({src.train_path}): no training examples left ({enc.stats['read']} records, "
                            f"{enc.stats['dropped_too_long']} longer than tokenizer.max_length={t.max_length})")
        per_source.append(examples)
        out.stats["sources"][src.name] = {"format": src.format, "train": dict(enc.stats)}
    total = d.train_samples or sum(len(e) for e in per_source)
    quotas = apportion(total, [s.weight for s in sources])
    blocks = []
    for i, (src, examples, quota) in enumerate(zip(sources, per_source, quotas, strict=True)):
        perm = np.random.default_rng([run_cfg.train.seed, _MIX_STREAM, i]).permutation(len(examples))
        start = len(out.train)
        out.train += [examples[int(perm[j % len(examples)])] for j in range(quota)]
        blocks.append(np.arange(start, len(out.train), dtype=np.int64))
        entry = out.stats["sources"][src.name]
        entry["share"], entry["in_mixture"] = round(quota / total, 4), quota
        if quota > len(examples):
            entry["repeated"] = f"{quota / len(examples):.2f}x"
    out.mixture = Mixture(interleave(quotas), blocks)
    out.stats["train_size"] = len(out.train)
    if d.packing:
        sequence = [out.train[i] for i in out.mixture.order(run_cfg.train.seed, 0)]
        out.train = list(pack_stream(sequence, t.max_length))
        out.mixture, out.packed, out.keep_order = None, True, True
        out.stats["train_packed_rows"] = len(out.train)
    add_eval_sets(out, run_cfg, tokenizer, sources, chat)
    return out
