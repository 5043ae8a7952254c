"""Reading a task's records: local JSONL or Parquet files, a task folder's split files, or the hub's
SuperGLUE; and sampling them by seed. Every record keeps where it came from (file and line) for errors."""
from __future__ import annotations

import json
import os

import numpy as np

from lomo_ds.config.tasks import SUPERGLUE_HUB, TASKS, split_file
from lomo_ds.data.errors import DataError
from lomo_ds.data.examples import check_record

# SuperGLUE's loading script is not run by datasets >= 4: the loader falls back to the hub's
# Parquet export of the same data.
SUPERGLUE_PARQUET_REVISION = "refs/convert/parquet"


SPLITS = {"train": "train", "eval": "validation"}  # the hub's names; eval.split picks a local folder's


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
    import pyarrow.parquet as pq  # start-up time: only Parquet files need it

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
    import datasets  # start-up time, and it logs from its first import on (recipe/train.py show_what_matters)

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
