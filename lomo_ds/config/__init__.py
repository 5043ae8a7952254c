"""Configuration, the bottom layer: what every section builds on (section.py), the update rule's
`lomo` section (lomo_section.py) and the registry of rules it names (rules.py), the engine's other
sections, comm, memory and train (engine_sections.py), the rules' presets (presets.py), the whole
run's sections (run.py, data_section.py) and methods (methods.py). One loader for both
(loading.py): the engine's (engine_config.py: load_config) and the run's (run.py: load_run_config) read,
override and validate the same way; DeepSpeed's keys, supported, mapped or refused (ds_options.py,
deepspeed_keys.py); each feature's checks that span sections (checks/); the keys that moved
(moved.py), the task registry (tasks.py); errors in this project's words (errors.py), file reading
(files.py), `--set` overrides (overrides.py) and the generated option tables (docs.py). Validated
once, where a config enters."""
from lomo_ds.config.engine_config import ConfigError, EngineConfig, LomoConfig, load_config

__all__ = ["ConfigError", "EngineConfig", "LomoConfig", "load_config"]
