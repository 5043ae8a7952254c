"""eval.split other than "validation" reads <split>.jsonl from the task's folder: refused where the
evaluation data comes from anywhere else, or the folder has no such file."""
from __future__ import annotations

import os

from lomo_ds.config.errors import ConfigError
from lomo_ds.config.tasks import TASKS, split_file


def check_eval_split(cfg, loading) -> None:
    d, split = cfg.data, cfg.eval.split
    if split == "validation":
        return
    if d.eval_file is not None:
        raise ConfigError(f"eval.split: {split!r} reads {split}.jsonl from the task's folder, but data.eval_file "
                          f"names the evaluation file itself; drop one of them")
    source = d.source or TASKS[d.task].default_source
    if source is None or source.startswith("hub:"):
        raise ConfigError(f"eval.split: {split!r}: task {d.task!r} from the hub has no {split} split; "
                          f"a local folder with {split}.jsonl (data.source) has")
    if loading.check_files and os.path.isfile(source):
        raise ConfigError(f"eval.split: {split!r}: data.source {source!r} is a single file; "
                          f"a folder with {split}.jsonl has a {split} split")
    if loading.check_files and os.path.isdir(source) and split_file(source, split) is None:
        raise ConfigError(f"eval.split: {split!r}: {source} has no {split}.jsonl or {split}.parquet")
