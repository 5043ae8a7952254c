"""Streamed training data (data.streaming, lomo_ds/data/streaming.py): never loaded whole, so its
length is unknown, and only local files of the chat and instruction tasks' records (or
data.sources) are streamed."""
from __future__ import annotations

from lomo_ds.config.errors import ConfigError

STREAMING_TASKS = ("chat", "instruction")  # the tasks data.streaming reads (their records become one source)


def check_streaming(cfg, loading) -> None:
    d = cfg.data
    if not d.streaming:
        return
    if cfg.train.max_steps is None and cfg.train.method != "zero_shot":
        raise ConfigError("data.streaming: a stream's length is unknown, so the run's length is too; set "
                          "train.max_steps")
    if d.sources is None and d.task not in STREAMING_TASKS:
        raise ConfigError(f"data.streaming: streams the chat and instruction tasks' records, or data.sources; "
                          f"task {d.task!r} is loaded whole")
    if d.sources is None and d.source is not None and d.source.startswith("hub:"):
        raise ConfigError(f"data.streaming: streams local JSONL and Parquet files; data.source {d.source!r} is "
                          f"on the hub")
    if d.sources is None and cfg.eval.generate_samples:
        raise ConfigError("eval.generate_samples: a streamed run is evaluated by its eval loss; set it to 0 or "
                          "data.streaming to false")
