"""lm-evaluation-harness on the final export (eval.harness_tasks): a run must write one. Whether
lm-eval is installed and each task is found is checked before the model is built
(lomo_ds/recipe/train.py: check_runtime)."""
from __future__ import annotations

import os

from lomo_ds.config.errors import ConfigError


def check_harness(cfg, loading) -> None:
    if not cfg.eval.harness_tasks:
        return
    if not cfg.output.export_hf:
        raise ConfigError("eval.harness_tasks: the harness evaluates the final Hugging Face export; "
                          "output.export_hf is false")
    for folder in cfg.eval.harness_include if loading.check_files else ():
        if not os.path.isdir(folder):
            raise ConfigError(f"eval.harness_include: no such folder: {folder!r}")
