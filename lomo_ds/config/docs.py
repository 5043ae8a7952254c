"""The config sections' options as Markdown tables, generated from the fields' types, defaults and
descriptions (docs/configs.md's "Engine options"; tests check the file holds the current table)."""
from __future__ import annotations

import json
import typing
from typing import Annotated

from pydantic import BaseModel

from lomo_ds.config.errors import literal_choices, submodel
from lomo_ds.config.sections import EngineConfig


def options_markdown(cls: type[BaseModel] = EngineConfig, prefix: str = "") -> str:
    """Every option of a config section (default: the engine's sections, lomo, comm, memory and
    train), nested sections included, as the Markdown table of docs/configs.md's "Engine options"."""
    rows = [] if prefix else ["| key | type | default | what it does |", "|---|---|---|---|"]
    for name, field in cls.model_fields.items():
        key = f"{prefix}.{name}" if prefix else name
        sub = submodel(field.annotation)
        if sub is not None:
            rows.append(f"| `{key}` | section | | {' '.join(sub.__doc__.split())} |")
            rows.extend(options_markdown(sub, key).splitlines())
            continue
        default = json.dumps(list(field.default) if isinstance(field.default, tuple) else field.default)
        rows.append(f"| `{key}` | {_type_name(field.annotation)} | `{default}` | {field.description} |")
    return "\n".join(rows) + "\n"


def _type_name(annotation) -> str:
    choices = literal_choices(annotation)
    if typing.get_origin(annotation) is tuple:
        return "list of strings"
    if choices:
        words = " \\| ".join(json.dumps(c) for c in choices)
    else:
        names = {int: "integer", float: "number", bool: "true/false", str: "string"}
        args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
        words = " or ".join(names.get(typing.get_args(a)[0] if typing.get_origin(a) is Annotated else a, str(a))
                            for a in args)
    return words + (" or null" if type(None) in typing.get_args(annotation) else "")

