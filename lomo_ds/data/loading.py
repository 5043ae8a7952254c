"""Loading, sampling, tokenization and batching for LOMO runs; the tasks themselves (schemas,
prompts, candidates, where their data lives) are the registry in tasks.py.

The training loss is on the answer tokens and EOS only; evaluation scores every candidate by its
mean token log-probability (lomo_ds/evaluation/scoring.py). The instruction task has no candidates, so its
evaluation is the mean token loss on `eval_file` (Datasets.eval_lm), or nothing without one.

Data order is a pure function of (seed, epoch, step), so a resumed run replays it exactly.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
import torch

from lomo_ds.config.tasks import SUPERGLUE_HUB, TASKS, split_file
from lomo_ds.data.errors import DataError

# SuperGLUE's loading script is not run by datasets >= 4: the loader falls back to the hub's
# Parquet export of the same data.
SUPERGLUE_PARQUET_REVISION = "refs/convert/parquet"
SPLITS = {"train": "train", "eval": "validation"}  # the hub's names; eval.split picks a local folder's


@dataclass
class PromptExample:
    """One classification example before tokenization: the answer follows the prompt."""

    task: str
    prompt: str
    candidates: list[str]
    label: int  # index of the correct candidate


@dataclass
class EvalExample:
    task: str
    context_ids: list[int]
    candidate_ids: list[list[int]]
    label: int


@dataclass
class Datasets:
    train: list[dict]  # {"input_ids", "labels"} per example
    eval: list[EvalExample]  # candidate-scoring examples (empty for the instruction task)
    eval_lm: list[dict] = field(default_factory=list)  # instruction/chat: tokenized eval records (mean loss)
    stats: dict = field(default_factory=dict)
    # chat: prompts to answer by generation ({"prompt_ids", "messages", "reference"}, data/chat.py)
    eval_prompts: list[dict] = field(default_factory=list)
    packed: bool = False  # train holds packed rows (data/packing.py)
    group_by_length: bool = False  # train batches are grouped by length (data/packing.py)


# ----------------------------------------------------------------------------- records

def format_example(task: str, r: dict) -> PromptExample:
    """The prompt, candidates and answer of one record of a task with candidates (tasks.py)."""
    spec = TASKS[task]
    if not spec.has_candidates:
        raise ValueError(f"task {task!r} has no prompt: its records are prompt/response pairs")
    return PromptExample(task, spec.prompt(r), spec.candidates(r), spec.answer(r))


def check_record(task: str, r: Any, where: str) -> dict:
    """Raise DataError (naming `where`, e.g. 'file.jsonl:12') unless `r` has the task's fields."""
    fields = TASKS[task].fields
    if not isinstance(r, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(r).__name__}")
    for name, types in fields.items():
        if name not in r:
            raise DataError(f"{where}: missing field {name!r} (task {task!r} needs {sorted(fields)})")
        if not isinstance(r[name], types):
            raise DataError(f"{where}: field {name!r}: expected {'/'.join(t.__name__ for t in types)}, "
                            f"got {type(r[name]).__name__} {r[name]!r}")
    for name, allowed in TASKS[task].values.items():
        if r[name] not in allowed:
            raise DataError(f"{where}: field {name!r}: expected {' or '.join(map(repr, allowed))}, got {r[name]!r}")
    return r


# ----------------------------------------------------------------------------- reading

def read_jsonl(path: str) -> list[tuple[dict, str]]:
    """[(record, 'path:line')] for every non-blank line; bad JSON raises DataError with the line."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    out.append((json.loads(line.rstrip("\r\n")), f"{path}:{i}"))
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{i}: not valid JSON ({e.msg} at column {e.colno})") from None
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e})") from None
    return out


def read_parquet(path: str) -> list[tuple[dict, str]]:
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except Exception as e:  # pyarrow raises its own error types for a damaged file
        raise DataError(f"{path}: cannot read as Parquet ({e})") from None
    return [(r, f"{path}:row {i}") for i, r in enumerate(rows, 1)]


def read_records(path: str) -> list[tuple[dict, str]]:
    if path.endswith(".parquet"):
        return read_parquet(path)
    if path.endswith((".jsonl", ".json")):
        return read_jsonl(path)
    raise DataError(f"{path}: unknown data file type; expected .jsonl or .parquet")


def _split_file(directory: str, split: str) -> str:
    path = split_file(directory, split)
    if path is None:
        raise DataError(f"{directory}: no {split}.jsonl or {split}.parquet in this directory")
    return path


def load_hub_split(name: str, config: str | None, split: str) -> list[tuple[dict, str]]:
    """Every row of a dataset through datasets.load_dataset: a hub name or a local dataset
    directory (its data files in the hub's layout, e.g. data/train-00000-of-00001.parquet)."""
    import datasets

    try:
        ds = datasets.load_dataset(name, config, split=split)
    except RuntimeError as e:  # "Dataset scripts are no longer supported"
        if "script" not in str(e).lower():
            raise
        ds = datasets.load_dataset(name, config, split=split, revision=SUPERGLUE_PARQUET_REVISION)
    except ValueError as e:  # an unknown split, or a dataset with no such configuration
        raise DataError(f"{name}{f'/{config}' if config else ''}: {e}") from None
    where = f"{name}{f'/{config}' if config else ''}[{split}]"
    return [(dict(r), f"{where}:row {i}") for i, r in enumerate(ds, 1)]


def split_path(data_cfg, split: str, eval_split: str = "validation") -> str | None:
    """The local file for split 'train' or 'eval', or None when it comes from the hub / not at all.
    The evaluation file of a source directory is <eval_split>.jsonl (eval.split: validation or
    heldout); the run config has checked that a held-out split exists where it is asked for."""
    explicit = data_cfg.train_file if split == "train" else data_cfg.eval_file
    if explicit:
        return explicit
    source = data_cfg.source or TASKS[data_cfg.task].default_source
    needs_eval = TASKS[data_cfg.task].has_candidates  # a task without candidates need not have an eval set
    if source is None or source.startswith("hub:"):
        return None
    if os.path.isdir(source):
        try:
            return _split_file(source, "train" if split == "train" else eval_split)
        except DataError:
            if split == "eval" and not needs_eval:
                return None
            raise
    # A single file is the training data; evaluation then needs data.eval_file (or is skipped
    # for a task without candidates).
    if split == "train":
        return source
    if not needs_eval:
        return None
    raise DataError(f"data.source {source!r} is a single file (used for training); "
                    f"set data.eval_file for the evaluation split")


def load_rows(data_cfg, split: str, eval_split: str = "validation") -> list[tuple[dict, str]]:
    """[(record, where it came from)] of split 'train' or 'eval' (the folder's `eval_split`), unchecked."""
    task = TASKS[data_cfg.task]
    path = split_path(data_cfg, split, eval_split)
    hub = data_cfg.source[len("hub:"):] if data_cfg.source and data_cfg.source.startswith("hub:") else None
    if path is not None:
        return read_records(path)
    if task.conversational and hub is not None:
        name = data_cfg.hub_train_split if split == "train" else data_cfg.hub_eval_split
        return load_hub_split(hub, data_cfg.hub_subset, name)
    if task.hub_config is not None:
        return load_hub_split(hub or SUPERGLUE_HUB, task.hub_config, SPLITS[split])
    return []  # a task without candidates and without an eval file


def load_split(data_cfg, split: str, eval_split: str = "validation") -> list[dict]:
    """All records of split 'train' or 'eval' (the folder's `eval_split`), checked against the task's schema."""
    return [check_record(data_cfg.task, r, where) for r, where in load_rows(data_cfg, split, eval_split)]


def sample_indices(n: int, k: int | None, seed: int) -> list[int]:
    """The first k of a seeded permutation of range(n) (all n, permuted, when k is None or >= n)."""
    return [int(i) for i in np.random.RandomState(seed).permutation(n)[:k]]


# ----------------------------------------------------------------------------- tokenization

def _encode(tokenizer, text: str) -> list[int]:
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    eos = tokenizer.eos_token_id
    if len(ids) > 1 and eos is not None and ids[-1] == eos:  # tokenizers that append EOS themselves
        ids = ids[:-1]
    return ids


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):  # a prefix: the shorter one ends it
        if x != y:
            break
        n += 1
    return n


def encode_with_candidates(tokenizer, prompt: str, candidates: list[str]) -> tuple[list[int], list[list[int]]]:
    """Token ids of the prompt and of each candidate such that context + candidate is exactly how
    the tokenizer encodes prompt + candidate as one string.

    Encoding the two parts separately is wrong at the seam: "... so " + "the" is "so", " the" as one
    string but "so", " " + "the" apart, and SentencePiece adds a space before a separately encoded
    word. So each candidate's ids are the tail of the joint encoding after the longest prefix shared
    with the prompt's encoding (shortest over candidates, so all share one context).
    """
    prompt_ids = _encode(tokenizer, prompt)
    full = [_encode(tokenizer, prompt + c) for c in candidates]
    cut = min(_common_prefix(prompt_ids, f) for f in full)
    cands = [f[cut:] for f in full]
    for c, ids in zip(candidates, cands, strict=True):
        if not ids:
            raise DataError(f"candidate {c!r} encodes to no tokens after prompt {prompt[-40:]!r}")
    return prompt_ids[:cut], cands


def _fit(context: list[int], tail_len: int, max_length: int, bos_id: int | None) -> tuple[list[int] | None, int]:
    """Drop prompt tokens from the left (after a leading BOS) until context + tail fits.
    Returns (context or None when even an empty prompt is too long, number of tokens dropped)."""
    excess = len(context) + tail_len - max_length
    if excess <= 0:
        return context, 0
    keep_bos = 1 if bos_id is not None and context[:1] == [bos_id] else 0
    # At least one context token must stay: it predicts the first answer token.
    if len(context) - excess < max(keep_bos, 1):
        return None, excess
    return context[:keep_bos] + context[keep_bos + excess:], excess


def tokenize_train_example(ex: PromptExample | dict, tokenizer, max_length: int,
                           overlong: str = "truncate") -> dict | None:
    """{"input_ids", "labels", "truncated"} for the prompt followed by the correct answer and EOS.

    labels are -100 on the prompt: the loss is on the answer tokens and EOS only. When the sequence
    is longer than max_length, "truncate" drops prompt tokens from the left (the answer is kept;
    "truncated" is the number dropped) and "reject" returns None; None is also returned when the
    answer alone does not fit. `ex` is a PromptExample or an instruction record {"prompt", "response"}.
    """
    if isinstance(ex, PromptExample):
        prompt, answer = ex.prompt, ex.candidates[ex.label]
    else:
        prompt, answer = ex["prompt"], ex["response"]
    context, (ans,) = encode_with_candidates(tokenizer, prompt, [answer])
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the tokenizer has no EOS token; the training target ends with one")
    tail = ans + [eos]
    dropped = 0
    if len(context) + len(tail) > max_length:
        if overlong == "reject":
            return None
        context, dropped = _fit(context, len(tail), max_length, tokenizer.bos_token_id)
        if context is None:
            return None
    return {"input_ids": context + tail, "labels": [-100] * len(context) + tail, "truncated": dropped}


def tokenize_eval_example(ex: PromptExample, tokenizer, max_length: int,
                          overlong: str = "truncate") -> tuple[EvalExample | None, int]:
    """(EvalExample or None when rejected, prompt tokens dropped); the longest candidate must fit."""
    context, cands = encode_with_candidates(tokenizer, ex.prompt, ex.candidates)
    longest = max(len(c) for c in cands)
    dropped = 0
    if len(context) + longest > max_length:
        if overlong == "reject":
            return None, 0
        context, dropped = _fit(context, longest, max_length, tokenizer.bos_token_id)
        if context is None:
            return None, 0
    return EvalExample(ex.task, context, cands, ex.label), dropped


# ----------------------------------------------------------------------------- building

def build_datasets(run_cfg, tokenizer) -> Datasets:
    """Load, sample, format and tokenize both splits of run_cfg.data.task.

    stats: available/sampled records, examples kept, truncated and rejected counts, per split.
    """
    d, t = run_cfg.data, run_cfg.tokenizer
    if TASKS[d.task].conversational:
        from lomo_ds.data.chat import build_chat_datasets

        return build_chat_datasets(run_cfg, tokenizer)
    scored = TASKS[d.task].has_candidates  # else records are prompt/response pairs, evaluated by their loss
    stats: dict[str, Any] = {"task": d.task, "eval_split": run_cfg.eval.split}
    out = Datasets(train=[], eval=[], eval_lm=[], stats=stats)
    for split, n_wanted in (("train", d.train_samples), ("eval", d.eval_samples)):
        records = load_split(d, split, run_cfg.eval.split)
        idx = sample_indices(len(records), n_wanted, d.seed)
        truncated = rejected = 0
        for i in idx:
            r = records[i]
            if split == "train" or not scored:
                ex = format_example(d.task, r) if scored else r
                tok = tokenize_train_example(ex, tokenizer, t.max_length, t.overlong)
                if tok is None:
                    rejected += 1
                    continue
                truncated += tok["truncated"] > 0
                (out.train if split == "train" else out.eval_lm).append(tok)
            else:
                ev, dropped = tokenize_eval_example(format_example(d.task, r), tokenizer, t.max_length, t.overlong)
                if ev is None:
                    rejected += 1
                    continue
                truncated += dropped > 0
                out.eval.append(ev)
        stats[f"{split}_available"] = len(records)
        stats[f"{split}_sampled"] = len(idx)
        stats[f"{split}_truncated"] = truncated
        stats[f"{split}_rejected"] = rejected
    stats["train_size"] = len(out.train)
    stats["eval_size"] = len(out.eval) + len(out.eval_lm)
    check_some_left(out, run_cfg, stats["train_rejected"], stats["train_sampled"])
    if not scored:  # instruction records: packed or grouped by length like conversations
        finish_train_split(out, run_cfg)
    return out


def check_some_left(data: Datasets, run_cfg, rejected: int, sampled: int) -> None:
    if not data.train and run_cfg.train.method != "zero_shot":
        raise DataError(f"task {run_cfg.data.task!r}: no training examples left (rejected {rejected} of {sampled} "
                        f"as longer than tokenizer.max_length={run_cfg.tokenizer.max_length})")


def finish_train_split(data: Datasets, run_cfg) -> None:
    """Pack the training examples (data.packing) or else group their batches by length."""
    from lomo_ds.data.packing import pack

    if run_cfg.data.packing:
        n = len(data.train)
        data.train = pack(data.train, run_cfg.tokenizer.max_length, run_cfg.data.seed)
        data.packed = True
        data.stats["train_packed_rows"] = len(data.train)
        data.stats["train_examples_packed"] = n
    else:
        data.group_by_length = True


def pad_id_of(tokenizer) -> int:
    """Padding is masked out everywhere, so any id works; EOS when the tokenizer has no pad token."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def collate(examples: Iterable[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example: input_ids (pad_id), attention_mask (0), labels (-100)."""
    examples = list(examples)
    if not examples:
        raise ValueError("collate: empty batch")
    width = max(len(e["input_ids"]) for e in examples)
    # Built on the host: every engine's train_step / eval_forward moves the batch to its device.
    host = torch.device("cpu")
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long, device=host)
    mask = torch.zeros((len(examples), width), dtype=torch.long, device=host)
    labels = torch.full((len(examples), width), -100, dtype=torch.long, device=host)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[i, :n] = torch.tensor(e["input_ids"], dtype=torch.long, device=host)
        mask[i, :n] = 1
        labels[i, :n] = torch.tensor(e["labels"], dtype=torch.long, device=host)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


# ----------------------------------------------------------------------------- data order

def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The example order of one epoch: a permutation that depends only on (n, seed, epoch)."""
    return [int(i) for i in np.random.default_rng([seed, epoch]).permutation(n)]


def micro_batches_per_epoch(n: int, world: int, micro: int) -> int:
    """Global micro-batches (one micro batch on every rank) per epoch: every example once; the last
    is topped up (see batches_for_step) so every rank always has a full micro batch, which ZeRO-3
    needs (each backward is a collective every rank must join)."""
    if n < 1:
        raise ValueError("steps_per_epoch: no training examples")
    return math.ceil(n / (world * micro))


def steps_per_epoch(n: int, world: int, micro: int, accumulation: int = 1) -> int:
    """Optimizer steps per epoch: windows of `accumulation` global micro-batches. When that does not
    divide the epoch's micro-batches, the epoch's last window is shorter and its step is the mean
    over its own micro-batches (window_of_step): epochs stay aligned (data order, evaluation), and
    no example is seen twice or carried into the next epoch's order."""
    return math.ceil(micro_batches_per_epoch(n, world, micro) / accumulation)


def window_of_step(step_in_epoch: int, n: int, world: int, micro: int, accumulation: int = 1) -> range:
    """The global micro-batch indices (within the epoch) of optimizer step `step_in_epoch`."""
    start = step_in_epoch * accumulation
    return range(start, min(start + accumulation, micro_batches_per_epoch(n, world, micro)))


def batches_for_step(order: list[int], micro_in_epoch: int, world: int, micro: int, rank: int) -> list[int]:
    """The example indices of rank `rank`'s micro batch in global micro-batch `micro_in_epoch` of an
    epoch (the optimizer step's number when there is no accumulation).

    Global micro-batch s is order[s*world*micro : (s+1)*world*micro], wrapping round to the start of
    the same epoch's order when it runs past the end; rank r takes its r-th micro slice.
    """
    g = world * micro
    start = micro_in_epoch * g + rank * micro
    return [order[(start + j) % len(order)] for j in range(micro)]


def position_of_step(global_step: int, steps_in_epoch: int) -> tuple[int, int]:
    """(epoch, step within the epoch) of the 0-based optimizer step `global_step`."""
    return divmod(global_step, steps_in_epoch)
