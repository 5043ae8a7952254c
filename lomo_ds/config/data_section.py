"""The run config's `data` section: one task's dataset, or a mixture of sources (data.sources), read
whole or streamed. Its own checks (which keys go together, which files must exist) are its
validators; the ones that concern other sections too are lomo_ds/config/checks' features."""
from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, ValidationInfo, model_validator

from lomo_ds.config.errors import SectionError
from lomo_ds.config.section import Int, Section, expects
from lomo_ds.config.tasks import SPLIT_EXTENSIONS, split_file
from lomo_ds.config.tasks import TASK_NAMES as TASKS
from lomo_ds.config.tasks import TASKS as TASK_SPECS

SOURCE_FORMATS = ("chat", "prompt_response", "text")  # the record formats of data.sources (data/formats.py)
# The keys that name a single dataset: data.sources replaces them.
_SINGLE_DATASET_KEYS = ("task", "source", "train_file", "eval_file", "columns", "hub_subset", "hub_train_split",
                        "hub_eval_split")


def checks_files(info: ValidationInfo) -> bool:
    """Whether the loader asked for local paths to exist now (validation context check_files)."""
    return bool((info.context or {}).get("check_files", False))


class SourceConfig(Section):
    """One dataset of data.sources: a local file or folder, its record format and its weight."""

    path: str = Field(min_length=1, description=(
        "a .jsonl/.json/.parquet file (the training data), or a folder holding "
        "<split>.{jsonl,parquet} and, for evaluation, <eval_split>.{jsonl,parquet}"))
    format: Literal[SOURCE_FORMATS] = Field(description=(
        'chat = conversations (data/chat.py\'s formats); prompt_response = {"prompt", "response"} '
        'records (the instruction task\'s); text = {"text"} records, the loss on every token'))
    weight: float = Field(1.0, gt=0, json_schema_extra=expects("a positive number"), description=(
        "its share of the mixture is weight / the sum of the weights (fractions summing to 1 work too)"))
    name: str | None = Field(None, min_length=1, description="in the run's data line and the eval keys (null: "
                                                             "path's stem)")
    split: str = Field("train", min_length=1, description="a folder's training split")
    eval_split: str | None = Field("validation", description="a folder's evaluation split, used where the file "
                                                             "exists (null: none)")
    columns: dict[str, str] = Field(default_factory=dict, description="{our field: the dataset's column}, as "
                                                                      "data.columns")


class DataConfig(Section):
    """The training and evaluation data: one task's dataset, or a mixture (sources)."""

    task: Literal[TASKS] = Field("builtin", description="the task: its data format, prompts and scoring "
                                                        "(lomo_ds/config/tasks.py)")
    source: str | None = Field(None, description=(
        'null: the hub\'s SuperGLUE (or the shipped builtin files); "hub:NAME": another hub copy of SuperGLUE '
        "(chat tasks: a hub dataset); else a local directory ({train,validation}.{jsonl,parquet}) or a single "
        "training file"))
    train_file: str | None = Field(None, description="the training file; explicit files win over `source`")
    eval_file: str | None = Field(None, description="the evaluation file; explicit files win over `source`")
    # (the permutation is seeded by train.seed)
    train_samples: Int | None = Field(None, ge=1, description=(
        "the first N of a seeded permutation of the split (all of it if fewer); null: every record for the chat "
        "and instruction tasks, 1000 for the classification tasks (the paper's protocol)"))
    eval_samples: Int | None = Field(None, ge=1, description="as train_samples, for the evaluation split")
    columns: dict[str, str] = Field(default_factory=dict, description=(
        'chat tasks: {our field: the dataset\'s column}, e.g. {"messages": "dialog"} or '
        '{"instruction": "question", "output": "answer"} (data/chat.py lists the fields)'))
    hub_subset: str | None = Field(None, description='chat tasks from "hub:NAME": the dataset\'s configuration '
                                                     "name")
    hub_train_split: str = Field("train", description='chat tasks from "hub:NAME": the dataset\'s training split')
    hub_eval_split: str = Field("validation", description='chat tasks from "hub:NAME": the dataset\'s '
                                                          "evaluation split")
    packing: bool = Field(False, description=(
        "chat/instruction tasks: concatenate examples into rows of tokenizer.max_length (position ids restart "
        "and attention is block-diagonal per example); off: batches grouped by length"))
    sources: list[SourceConfig] | None = Field(None, min_length=1, description=(
        "several datasets mixed by weight, each in its own format (data/mixture.py); replaces task, source, "
        "train_file, eval_file and columns. train_samples: the mixture's length"))
    streaming: bool = Field(False, description="read the training data as a stream (data/streaming.py): never "
                                               "loaded whole; needs train.max_steps")
    shuffle_buffer: Int = Field(10_000, ge=1, description="streaming: records in the seeded shuffle buffer of each "
                                                          "source")

    @model_validator(mode="before")
    @classmethod
    def _paper_sample_sizes(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and not raw.get("sources") and TASK_SPECS.get(raw.get("task", "builtin")) is not None \
                and TASK_SPECS[raw.get("task", "builtin")].has_candidates:
            raw = {"train_samples": 1000, "eval_samples": 1000, **{k: v for k, v in raw.items() if v is not None}}
        return raw

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo) -> DataConfig:
        if self.sources is not None:
            self._check_sources(checks_files(info))
        self._check_task()
        if checks_files(info):
            for name in ("source", "train_file", "eval_file"):
                p = getattr(self, name)
                if p is not None and not p.startswith("hub:") and not os.path.exists(p):
                    raise SectionError(name, f"no such file or directory: {p!r}")
        return self

    def _check_sources(self, check_files: bool) -> None:
        given = [k for k in _SINGLE_DATASET_KEYS if k in self.model_fields_set]
        if given:
            raise SectionError(given[0], "data.sources replaces the single dataset's keys (task, source, "
                                         "train_file, eval_file, columns, hub_*); each source names its own path "
                                         "and format")
        names: dict[str, int] = {}
        for i, s in enumerate(self.sources):
            key = f"sources[{i}]"
            if s.path.startswith("hub:"):
                raise SectionError(f"{key}.path", f"a source is a local file or folder, got {s.path!r}")
            if check_files:
                _check_source_path(s, key)
            name = source_name(s)
            if name in names:
                raise SectionError(f"{key}.name", f"{name!r} names data.sources[{names[name]}] too; give each "
                                                  "source its own name")
            names[name] = i

    def _check_task(self) -> None:
        """What the task needs of the single dataset's keys."""
        if self.task == "instruction" and self.source is None and self.train_file is None:
            raise SectionError("source", "the 'instruction' task needs a JSONL file of prompt/response records in "
                                         "data.source or data.train_file")
        if self.task == "chat" and self.source is None and self.train_file is None:
            raise SectionError("source", "the 'chat' task needs conversations: a directory ({train,validation}"
                                         ".{jsonl,parquet}), a file, or 'hub:NAME'")
        spec = TASK_SPECS[self.task]
        if self.source is not None and self.source.startswith("hub:") and spec.hub_config is None \
                and not spec.conversational:
            raise SectionError("source", f"'hub:NAME' is for the SuperGLUE and chat tasks; task {self.task!r} "
                                         "reads local files")
        for name, value in (("columns", self.columns), ("hub_subset", self.hub_subset)):
            if value and not spec.conversational:
                raise SectionError(name, f"only the chat tasks map columns; task {self.task!r} has a fixed schema")
        if self.packing and self.sources is None and spec.has_candidates:
            raise SectionError("packing", f"task {self.task!r} is scored by candidates; packing is for the chat and "
                                          "instruction tasks")


def source_name(s: SourceConfig) -> str:
    """A source's name: its own, or its path's last part without the extension."""
    if s.name is not None:
        return s.name
    base = os.path.basename(os.path.normpath(s.path))
    return os.path.splitext(base)[0] if os.path.splitext(base)[1] in SPLIT_EXTENSIONS else base


def _check_source_path(s: SourceConfig, key: str) -> None:
    if os.path.isdir(s.path):
        if split_file(s.path, s.split) is None:
            raise SectionError(f"{key}.split", f"{s.path} has no {s.split}.jsonl or {s.split}.parquet")
    elif not os.path.exists(s.path):
        raise SectionError(f"{key}.path", f"no such file or directory: {s.path!r}")
    elif not s.path.endswith(SPLIT_EXTENSIONS):
        raise SectionError(f"{key}.path", f"expected a .jsonl, .json or .parquet file or a folder, got {s.path!r}")
