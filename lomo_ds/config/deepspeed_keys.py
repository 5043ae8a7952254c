"""DeepSpeed's part of a config: every top-level key that is not a section of ours. Its keys are
checked against lomo_ds/config/ds_options.py (the ones LOMO replaces are copied into the sections
or refused), and the likely mistakes among the rest (a misspelt section, a comment key) are caught,
since DeepSpeed itself ignores keys it does not know."""
from __future__ import annotations

import difflib
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from lomo_ds.config import ds_options, leaf_module
from lomo_ds.config.errors import ConfigError, explain


def check_deepspeed_keys(ds: dict, sections: tuple[str, ...]) -> None:
    """Top-level keys other than ours are DeepSpeed's, and DeepSpeed ignores keys it does not know.
    Its key list is long and changes between releases, so rather than mirror it, catch the likely
    mistakes: a misspelt section of ours (`sections`), and comment keys."""
    for key in sorted(ds):
        if key.startswith("_"):
            raise ConfigError(f"{key}: unknown key (JSON has no comments; explanations go in docs/configs.md)")
        near = difflib.get_close_matches(key.lower(), list(sections), n=1, cutoff=0.75)
        if near:
            raise ConfigError(f"{key}: unknown key; did you mean {near[0]!r}?")

Sections = TypeVar("Sections", bound=BaseModel)  # an EngineConfig or a RunConfig: the engine's sections


def validate_deepspeed_section(ds: dict, cfg: Sections, lomo_method: bool = True) -> tuple[dict, Sections]:
    """Check DeepSpeed's keys against the option table and copy the mapped ones into `cfg`'s
    sections (an EngineConfig or a RunConfig).

    `ds` gets DeepSpeed's defaults filled in. lomo_method: whether LOMO does the update (the
    baselines use DeepSpeed's optimizer, for which only the rows marked all_methods are refused).
    Returns (ds, cfg with the mapped values)."""
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
    cfg = _with_mapped(ds, cfg)
    # One accumulation count for the whole run: the baselines' DeepSpeed optimizer reads it from
    # here, LOMO from train.accumulation_steps (set from either key).
    ds["gradient_accumulation_steps"] = cfg.train.accumulation_steps
    return ds, cfg


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


def _with_mapped(ds: dict, cfg: Sections) -> Sections:
    """`cfg` with the values of the mapped DeepSpeed keys; an error when both sides set a key and differ."""
    mapped = {}  # dotted key of ours -> (value, DeepSpeed key)
    for row in ds_options.OPTIONS:
        if row.status != ds_options.MAPPED:
            continue
        parent, _, name = row.key.rpartition(".")
        node = ds.get(parent, {}) if parent else ds
        if name not in node:
            continue
        value = row.convert(node[name]) if row.convert else node[name]
        current = _value(cfg, row.maps_to)
        if _is_set(cfg, row.maps_to) and current != value:
            raise ConfigError(f"{row.key} ({node[name]!r}) and {row.maps_to} ({current!r}) disagree; "
                              "set only one of them")
        mapped[row.maps_to] = (value, row.key)
    update = {}
    for section_name in sorted({key.partition(".")[0] for key in mapped}):
        section = getattr(cfg, section_name)
        # Only the keys given, plus the mapped ones: what the author left out stays left out (a
        # rule's preset fills it afterwards, and describe_update can say so).
        data = section.model_dump(exclude_unset=True)
        for key, (value, _) in mapped.items():
            first, _, rest = key.partition(".")
            if first != section_name:
                continue
            *parents, name = rest.split(".")
            node = data
            for part in parents:
                node = node.setdefault(part, {})
            node[name] = value
        try:
            update[section_name] = type(section).model_validate(data)
        except ValidationError as e:
            key, what = explain(type(section), e.errors()[0])
            raise ConfigError(f"{mapped[f'{section_name}.{key}'][1]} (LOMO's {section_name}.{key}): {what}") from None
    return cfg.model_copy(update=update) if update else cfg


def _value(cfg: BaseModel, dotted: str):
    value: Any = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _is_set(cfg: BaseModel, dotted: str) -> bool:
    """Whether the config gave `dotted` (not just its default)."""
    first, *parents, name = dotted.split(".")
    section: BaseModel = getattr(cfg, first)
    for part in parents:
        if part not in section.model_fields_set:
            return False
        section = getattr(section, part)
    return name in section.model_fields_set
