"""The engine's configuration: DeepSpeed's own keys plus the engine's sections (lomo, comm, memory,
train), validated on load.

`load_config` is the config loader's pipeline (loading.py) with the engine's sections only: a
file or dict read, keys that moved refused, the sections validated (lomo_section.py, engine_sections.py),
DeepSpeed's keys checked against lomo_ds/config/ds_options.py (deepspeed_keys.py), the chosen
update rule's preset applied (presets.py). Every problem is a `ConfigError` (errors.py) naming the
file, the key's full dotted path and what was expected, before any model memory is touched. The
schema's names are importable from here too: this module is the engine's one config import.
"""
from __future__ import annotations

import os

from lomo_ds.config.deepspeed_keys import validate_deepspeed_section
from lomo_ds.config.engine_sections import (
    ENGINE_SECTIONS,
    CommConfig,
    EngineConfig,
    EngineTrainConfig,
    GradReduction,
    MemoryConfig,
    ParamGather,
)
from lomo_ds.config.errors import ConfigError
from lomo_ds.config.loading import load_sections
from lomo_ds.config.lomo_section import (
    AdaLomoConfig,
    LomoConfig,
    LossScaleConfig,
    Precision,
    PresetConfig,
    PresetsConfig,
    ScheduleConfig,
)
from lomo_ds.config.presets import apply_preset, describe_update
from lomo_ds.config.section import Int, Section, expects

__all__ = ["ENGINE_SECTIONS", "AdaLomoConfig", "CommConfig", "ConfigError", "EngineConfig", "EngineTrainConfig",
           "GradReduction", "Int", "LomoConfig", "LossScaleConfig", "MemoryConfig", "ParamGather", "PresetConfig",
           "PresetsConfig", "Precision", "ScheduleConfig", "Section", "apply_preset", "describe_update", "expects",
           "load_config", "validate_deepspeed_section"]


def load_config(config: dict | str | os.PathLike, overrides: dict | None = None) -> tuple[dict, EngineConfig]:
    """Split a config (dict, or a JSON/YAML path) into DeepSpeed's dict and the validated engine
    sections (loading.py's pipeline, with the engine's sections only)."""
    return load_sections(config, EngineConfig, overrides)
