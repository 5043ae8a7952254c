"""A mixture of datasets (data.sources): each source names its own evaluation split and is
evaluated by its eval loss, so the single task's evaluation keys do not apply. The section's own
checks (its keys, its files, unique names) are data_section.py's validators."""
from __future__ import annotations

from lomo_ds.config.errors import ConfigError


def check_sources(cfg, loading) -> None:
    if cfg.data.sources is None:
        return
    if cfg.eval.split != "validation":
        raise ConfigError(f"eval.split: {cfg.eval.split!r}: with data.sources each source names its evaluation "
                          f"split (data.sources[i].eval_split)")
    if cfg.eval.generate_samples:
        raise ConfigError("eval.generate_samples: generation is evaluated on a chat task's conversations; "
                          "a run on data.sources is evaluated by each source's eval loss")
