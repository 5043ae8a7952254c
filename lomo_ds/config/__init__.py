"""Configuration: the engine's `lomo` section (lomo.py), the whole run (run.py), and every DeepSpeed
option, supported, mapped or refused (ds_options.py). Validated once, where a config enters."""
from lomo_ds.config.lomo import ConfigError, LomoConfig, load_config

__all__ = ["ConfigError", "LomoConfig", "load_config"]
