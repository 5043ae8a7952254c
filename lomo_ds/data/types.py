"""The data's types: an example before and after tokenization, and a run's tokenized Datasets."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lomo_ds.data.errors import DataError


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
    mixture: Any = None  # data.sources: the mixed order of train (data/mixture.py Mixture)
    keep_order: bool = False  # train is in its order already, every epoch (a packed mixture)
    eval_by_source: dict[str, list[dict]] = field(default_factory=dict)  # data.sources: eval_lm by source


def check_some_left(data: Datasets, run_cfg, rejected: int, sampled: int) -> None:
    if not data.train and run_cfg.train.method != "zero_shot":
        raise DataError(f"task {run_cfg.data.task!r}: no training examples left (rejected {rejected} of {sampled} "
                        f"as longer than tokenizer.max_length={run_cfg.tokenizer.max_length})")
