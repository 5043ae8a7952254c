"""The engine's configuration: DeepSpeed's own keys plus a "lomo" section, validated on load.

`load_config` reads a file (files.py) or copies a dict, validates the "lomo" section (schema.py),
and checks DeepSpeed's keys against lomo_ds/config/ds_options.py: the ones LOMO replaces are copied
into the lomo section or refused. Every problem is a `ConfigError` (errors.py) naming the file, the
key's full dotted path and what was expected, before any model memory is touched. The schema's
names are importable from here too: this module is the engine's one config import.
"""
from __future__ import annotations

import copy
import difflib
import os
from typing import Any

from pydantic import BaseModel, ValidationError

from lomo_ds.config import ds_options, leaf_module
from lomo_ds.config.errors import ConfigError, errors_in, explain, validated
from lomo_ds.config.files import read_config_file
from lomo_ds.config.schema import (
    AdaLomoConfig,
    GradReduction,
    Int,
    LomoConfig,
    LossScaleConfig,
    ParamGather,
    Precision,
    RecipeConfig,
    RecipesConfig,
    ScheduleConfig,
    Section,
    expects,
)

__all__ = ["AdaLomoConfig", "ConfigError", "GradReduction", "Int", "LomoConfig", "LossScaleConfig", "ParamGather",
           "Precision", "RecipeConfig", "RecipesConfig", "ScheduleConfig", "Section", "expects", "load_config",
           "validate_deepspeed_section"]


def load_config(config: dict | str | os.PathLike) -> tuple[dict, LomoConfig]:
    """Split a config (dict, or a JSON/YAML path) into DeepSpeed's dict and the validated LOMO section."""
    if isinstance(config, (str, os.PathLike)):
        src, raw = os.fspath(config), read_config_file(config)
    elif isinstance(config, dict):
        src, raw = "<config>", copy.deepcopy(config)
    else:
        raise ConfigError(f"config: expected a dict or a path to a JSON/YAML file, got {type(config).__name__}")
    with errors_in(src):
        lomo = validated(LomoConfig, raw.pop("lomo", None) or {}, "lomo")
        return validate_deepspeed_section(raw, lomo)


# ----------------------------------------------------------------------------- DeepSpeed's keys

def validate_deepspeed_section(ds: dict, lomo: LomoConfig, lomo_method: bool = True) -> tuple[dict, LomoConfig]:
    """Check DeepSpeed's keys against the option table and copy the mapped ones into `lomo`.

    `ds` gets DeepSpeed's defaults filled in. lomo_method: whether LOMO does the update (the
    baselines use DeepSpeed's optimizer, for which only the rows marked all_methods are refused).
    Returns (ds, lomo with the mapped values)."""
    for name in ("fp16", "bf16", "zero_optimization"):
        if name in ds and not isinstance(ds[name], dict):
            raise ConfigError(f"{name}: expected an object, got {ds[name]!r}")
    for key, value in _deepspeed_values(ds):
        row = ds_options.option(key)
        if row is None:
            # The table lists every top-level and zero_optimization key DeepSpeed knows.
            if "." not in key or key.startswith("zero_optimization."):
                raise ConfigError(f"{key}: unknown key{_did_you_mean(key)}")
        elif row.refuses(value) and (lomo_method or row.all_methods):
            raise ConfigError(f"{key}: {row.reason}" + (f", got {value!r}" if row.accepts else ""))
    leaf_module.check_value(ds.get("zero_optimization", {}).get("leaf_module"))
    if ds.get("fp16", {}).get("enabled", False) and ds.get("bf16", {}).get("enabled", False):
        raise ConfigError("fp16.enabled and bf16.enabled: choose one precision")
    ds.setdefault("zero_optimization", {}).setdefault("stage", 3)
    ds.setdefault("train_micro_batch_size_per_gpu", 1)
    ds.pop("train_batch_size", None)  # derived by DeepSpeed from the micro batch, accumulation and world size
    mb = ds["train_micro_batch_size_per_gpu"]
    if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
        raise ConfigError(f"train_micro_batch_size_per_gpu: expected a positive integer, got {mb!r}")
    lomo = _with_mapped(ds, lomo)
    # One accumulation count for the whole run: the baselines' DeepSpeed optimizer reads it from
    # here, LOMO from lomo.accumulation_steps (set from either key).
    ds["gradient_accumulation_steps"] = lomo.accumulation_steps
    return ds, lomo


def _deepspeed_values(ds: dict):
    """(dotted key, value) of every key the option table may have a row for."""
    for key, value in ds.items():
        yield key, value
        if key in ("fp16", "bf16", "zero_optimization"):
            for sub, sub_value in value.items():
                yield f"{key}.{sub}", sub_value
    offload = ds.get("zero_optimization", {}).get("offload_param")
    if offload is not None:
        if not isinstance(offload, dict):
            raise ConfigError(f"zero_optimization.offload_param: expected an object, got {offload!r}")
        for sub, sub_value in offload.items():
            key = f"zero_optimization.offload_param.{sub}"
            if ds_options.option(key) is None:
                raise ConfigError(f"{key}: unknown key{_did_you_mean(key)}")
            yield key, sub_value


def _did_you_mean(key: str) -> str:
    parent = key.rpartition(".")[0]
    known = [o.key for o in ds_options.OPTIONS if o.key.rpartition(".")[0] == parent]
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
    return f"; did you mean {near[0].rpartition('.')[2]!r}?" if near else ""


def _with_mapped(ds: dict, lomo: LomoConfig) -> LomoConfig:
    """`lomo` with the values of the mapped DeepSpeed keys; an error when both sides set a key and differ."""
    mapped = {}  # lomo dotted key -> (value, DeepSpeed key)
    for row in ds_options.OPTIONS:
        if row.status != ds_options.MAPPED:
            continue
        parent, _, name = row.key.rpartition(".")
        node = ds.get(parent, {}) if parent else ds
        if name not in node:
            continue
        value = row.to_lomo(node[name]) if row.to_lomo else node[name]
        current = _lomo_value(lomo, row.lomo)
        if _is_set(lomo, row.lomo) and current != value:
            raise ConfigError(f"{row.key} ({node[name]!r}) and lomo.{row.lomo} ({current!r}) disagree; "
                              "set only one of them")
        mapped[row.lomo] = (value, row.key)
    if not mapped:
        return lomo
    # Only the keys given, plus the mapped ones: what the author left out stays left out (a rule's
    # recipe fills it again, and describe_update can say so).
    data = lomo.model_dump(exclude_unset=True)
    for lomo_key, (value, _) in mapped.items():
        *parents, name = lomo_key.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        node[name] = value
    try:
        return LomoConfig.model_validate(data)
    except ValidationError as e:
        key, what = explain(LomoConfig, e.errors()[0])
        raise ConfigError(f"{mapped[key][1]} (LOMO's lomo.{key}): {what}") from None


def _lomo_value(lomo: LomoConfig, dotted: str):
    value: Any = lomo
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _is_set(lomo: LomoConfig, dotted: str) -> bool:
    """Whether the user's lomo section gave `dotted` (not just its default)."""
    section: BaseModel = lomo
    *parents, name = dotted.split(".")
    for part in parents:
        if part not in section.model_fields_set:
            return False
        section = getattr(section, part)
    return name in section.model_fields_set

