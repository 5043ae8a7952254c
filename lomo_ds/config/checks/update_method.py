"""The update a method gets (train.method): LOMO's methods need the `lomo` section written, since
the engine's defaults are not the paper's."""
from __future__ import annotations

from lomo_ds.config.errors import ConfigError
from lomo_ds.config.methods import LOMO_METHODS


def check_lomo_section(cfg, loading) -> None:
    if cfg.train.method in LOMO_METHODS and "lomo" not in loading.written:
        raise ConfigError(f"lomo: train.method {cfg.train.method!r} needs a 'lomo' section "
                          "(lr, or the rule's preset)")
