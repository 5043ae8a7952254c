"""Command-line overrides of a config: `--set lomo.lr=1e-2` parsed, then applied to the raw config
before it is validated, refusing a key the schema does not have."""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from lomo_ds.config.errors import ConfigError, submodel
from lomo_ds.config.moved import moved_to


def parse_override_args(items: list[str]) -> dict:
    """["lomo.lr=1e-2", "model.path=/x", "train.max_steps=null"] -> dict; values are parsed as JSON
    when they can be (numbers, true/false, null, lists), else kept as strings."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. lomo.lr=0.03")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def _known_path(raw: dict, parts: list[str], schema: type[BaseModel], sections: tuple[str, ...]) -> bool:
    """Whether a dotted override path names a field of `schema`'s `sections` (or the config itself has)."""
    if parts[0] in sections:
        section: Any = schema
        for part in parts:
            if section is None or part not in section.model_fields:
                return False
            section = submodel(section.model_fields[part].annotation)
        return len(parts) > 1
    # DeepSpeed keys: DeepSpeed has hundreds; only ones already present in the config (or the
    # micro batch) can be overridden, so a typo is caught instead of silently ignored.
    node: Any = raw
    for part in parts[:-1]:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return isinstance(node, dict) and (parts[-1] in node or parts in (["train_micro_batch_size_per_gpu"],
                                                                      ["gradient_accumulation_steps"]))


def apply_overrides(raw: dict, overrides: dict, src: str, schema: type[BaseModel], sections: tuple[str, ...]) -> None:
    """Set each dotted key of `overrides` in the raw config `raw` (read from `src`); a key that names no
    field of `schema`'s `sections`, nor a DeepSpeed key already in the config, is an error; a key
    that moved is refused naming its new place, one line per such key."""
    moved = [f"{src}: override {key!r}: {key} moved to {moved_to(key)}" for key in overrides if moved_to(key)]
    if moved:
        raise ConfigError("\n".join(moved))
    for key, value in overrides.items():
        parts = key.split(".")
        if not all(parts) or not _known_path(raw, parts, schema, sections):
            raise ConfigError(f"{src}: override {key!r}: unknown key")
        node = raw
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{src}: override {key!r}: {part!r} is not an object in the config")
        node[parts[-1]] = value
