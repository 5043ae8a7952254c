"""The one way a config is loaded, whether it is an engine's (DeepSpeed's keys and the sections
lomo, comm, memory, train: `EngineConfig`) or a whole run's (those and model, tokenizer, data,
train, eval, output: `RunConfig`). The schema says which sections there are; the steps are the same:

1. read the file (files.py) or copy the dict;
2. refuse keys that moved (moved.py);
3. apply the dotted overrides (overrides.py);
4. validate the sections (each section's own checks are its validators);
5. check DeepSpeed's keys, copying the mapped ones into the sections (deepspeed_keys.py);
6. fill what is left out from the chosen rule's preset (presets.py);
7. run each feature's checks that span sections (checks/).

Every problem is a `ConfigError` (errors.py) naming the file, the dotted key and what was expected,
before any model memory is touched.
"""
from __future__ import annotations

import copy
import os
from typing import Callable, TypeVar

from pydantic import BaseModel

from lomo_ds.config.checks.context import Loading
from lomo_ds.config.deepspeed_keys import check_deepspeed_keys, validate_deepspeed_section
from lomo_ds.config.errors import ConfigError, errors_in, submodel, validated
from lomo_ds.config.files import read_config_file
from lomo_ds.config.lomo_section import Precision
from lomo_ds.config.moved import check_moved
from lomo_ds.config.overrides import apply_overrides
from lomo_ds.config.presets import apply_preset

Config = TypeVar("Config", bound=BaseModel)  # an EngineConfig or a RunConfig


def load_sections(config: dict | str | os.PathLike, schema: type[Config], overrides: dict | None = None,
                  check_files: bool = True,
                  checks: Callable[[Config, Loading], None] | None = None) -> tuple[dict, Config]:
    """(DeepSpeed's dict, the validated `schema`) from a config: a dict, or a JSON/YAML path.

    schema: EngineConfig or RunConfig; its SECTIONS are the top-level keys that are ours (every
    other one is DeepSpeed's), and its `lomo_update` says whether LOMO does the update. A schema
    with a `ds` field gets DeepSpeed's dict, the precision read from it, and the file's path too.
    check_files: whether local paths must exist now. checks: the features' checks (checks/)."""
    raw, src, source_path = _read(config)
    sections = schema.SECTIONS
    with errors_in(src):
        check_moved(raw, src)
        if overrides:
            apply_overrides(raw, dict(overrides), src, schema, sections)
        _check_required(raw, schema)
        ds = {k: v for k, v in copy.deepcopy(raw).items() if k not in sections}
        check_deepspeed_keys(ds, sections)
        given = {name: raw[name] for name in sections if raw.get(name) is not None}
        whole_run = "ds" in schema.model_fields
        if whole_run:
            given.update(ds={}, source_path=source_path)
        cfg = validated(schema, given, context={"check_files": check_files})
        # DeepSpeed's part is checked against the method, and may set keys of ours (the mapped
        # options); the chosen rule's preset then fills what is still left out.
        ds, cfg = validate_deepspeed_section(ds, cfg, lomo_method=cfg.lomo_update)
        if whole_run:
            cfg = cfg.model_copy(update={"ds": ds, "precision": Precision.of(ds)})
        cfg = apply_preset(cfg)
        if checks is not None:
            checks(cfg, Loading(written=frozenset(raw), check_files=check_files))
    return ds, cfg


def _read(config: dict | str | os.PathLike) -> tuple[dict, str, str | None]:
    """(raw config, its name in errors, its path or None)."""
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        return read_config_file(path), path, path
    if isinstance(config, dict):
        return copy.deepcopy(config), "<config>", None
    raise ConfigError(f"config: expected a dict or a path to a JSON/YAML file, got {type(config).__name__}")


def _check_required(raw: dict, schema: type[BaseModel]) -> None:
    """A section the schema cannot default (the run's model) must be written."""
    for name in schema.SECTIONS:
        if schema.model_fields[name].is_required() and name not in raw:
            keys = [k for k, f in submodel(schema.model_fields[name].annotation).model_fields.items()
                    if f.is_required()]
            raise ConfigError(f"{name}: required section (at least {', '.join(f'{name}.{k}' for k in keys)})")
