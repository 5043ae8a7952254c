"""The config sections' options as Markdown tables, generated from the fields' types, defaults and
descriptions (docs/configs.md's "Engine options" and "Run options"; tests check the file holds the
current tables)."""
from __future__ import annotations

import json
import typing
from typing import Annotated

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from lomo_ds.config.engine_sections import EngineConfig
from lomo_ds.config.errors import literal_choices, submodel
from lomo_ds.config.run import RunConfig

HEADER = ["| key | type | default | what it does |", "|---|---|---|---|"]
# The run config's sections the training program reads, in the order docs/configs.md lists them (RunConfig
# also holds the engine's sections, DeepSpeed's part `ds`, the precision read from it and the file's path).
RUN_SECTIONS = ("model", "tokenizer", "data", "train", "eval", "output")


def options_markdown(cls: type[BaseModel] = EngineConfig, prefix: str = "") -> str:
    """Every option of a config section (default: the engine's sections, lomo, comm, memory and
    train), nested sections included, as the Markdown table of docs/configs.md's "Engine options"."""
    rows = [] if prefix else list(HEADER)
    rows += _rows(cls.model_fields, prefix)
    return "\n".join(rows) + "\n"


def run_options_markdown() -> str:
    """The run config's own sections (model, tokenizer, data, train, eval, output) as the Markdown
    table of docs/configs.md's "Run options". Keys a section shares with the engine's section of
    the same name (train's seed, clipping, schedule...) are the "Engine options" table's."""
    rows = list(HEADER)
    for name in RUN_SECTIONS:
        cls = submodel(RunConfig.model_fields[name].annotation)
        engine = EngineConfig.model_fields.get(name)
        shared = submodel(engine.annotation).model_fields if engine is not None else {}
        rows.append(f"| `{name}` | section | | {' '.join(cls.__doc__.split())} |")
        rows += _rows({k: f for k, f in cls.model_fields.items() if k not in shared}, name)
    return "\n".join(rows) + "\n"


def _rows(fields: dict[str, FieldInfo], prefix: str) -> list[str]:
    rows = []
    for name, field in fields.items():
        key = f"{prefix}.{name}" if prefix else name
        sub = submodel(field.annotation)
        if sub is not None and typing.get_origin(_without_none(field.annotation)) is list:
            # a list of sections (data.sources): its row, then its items' keys as key[i].name
            rows.append(f"| `{key}` | list of sections{_or_null(field.annotation)} | `{_default(field)}` | "
                        f"{field.description}. {' '.join(sub.__doc__.split())} |")
            rows += _rows(sub.model_fields, f"{key}[i]")
        elif sub is not None:
            rows.append(f"| `{key}` | section | | {' '.join(sub.__doc__.split())} |")
            rows += _rows(sub.model_fields, key)
        else:
            default = "required" if field.is_required() else f"`{_default(field)}`"
            rows.append(f"| `{key}` | {_type_name(field.annotation)} | {default} | {field.description} |")
    return rows


def _default(field: FieldInfo) -> str:
    value = field.get_default(call_default_factory=True)
    return json.dumps(list(value) if isinstance(value, tuple) else value)


def _without_none(annotation):
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if type(None) in typing.get_args(annotation) and len(args) == 1 else annotation


def _or_null(annotation) -> str:
    return " or null" if type(None) in typing.get_args(annotation) else ""


def _type_name(annotation) -> str:
    choices = literal_choices(annotation)
    if typing.get_origin(annotation) is tuple:
        return "list of " + (" \\| ".join(json.dumps(c) for c in choices) if choices else "strings")
    if typing.get_origin(_without_none(annotation)) is dict:
        return "mapping of strings to strings" + _or_null(annotation)
    if choices:
        words = " \\| ".join(json.dumps(c) for c in choices)
    else:
        names = {int: "integer", float: "number", bool: "true/false", str: "string"}
        args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
        words = " or ".join(names.get(typing.get_args(a)[0] if typing.get_origin(a) is Annotated else a, str(a))
                            for a in args)
    return words + _or_null(annotation)
