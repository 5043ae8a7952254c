"""Configuration, the bottom layer: the engine's `lomo` section (schema.py) and its loader (lomo.py),
the whole run (run.py), every DeepSpeed option, supported, mapped or refused (ds_options.py), the
task registry (tasks.py); errors in this project's words (errors.py), file reading (files.py),
`--set` overrides (overrides.py) and the generated option tables (docs.py). Validated once, where a
config enters."""
from lomo_ds.config.lomo import ConfigError, LomoConfig, load_config

__all__ = ["ConfigError", "LomoConfig", "load_config"]
