"""Configuration, the bottom layer: the update rule's `lomo` section (schema.py), the engine's other
sections split by concern, comm, memory and train (sections.py), the rules' presets (presets.py),
the engine's loader (lomo.py), the whole run (run.py), every DeepSpeed option, supported, mapped or
refused (ds_options.py), the keys that moved (moved.py), the task registry (tasks.py); errors in
this project's words (errors.py), file reading (files.py), `--set` overrides (overrides.py) and the
generated option tables (docs.py). Validated once, where a config enters."""
from lomo_ds.config.lomo import ConfigError, EngineConfig, LomoConfig, load_config

__all__ = ["ConfigError", "EngineConfig", "LomoConfig", "load_config"]
