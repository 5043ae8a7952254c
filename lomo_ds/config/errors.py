"""Config errors in this project's words: `ConfigError`, and pydantic's validation errors turned
into one line naming the dotted key and what was expected."""
from __future__ import annotations

import contextlib
import typing
from typing import Any, Literal

from pydantic import BaseModel, ValidationError


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range; the message names the key."""


class SectionError(ValueError):
    """Raised by a section's own check (a pydantic validator): `key` is the field it concerns, relative
    to the section (``"source"``, ``"sources[1].name"``), so the error names the whole dotted key
    wherever the section sits."""

    def __init__(self, key: str, what: str):
        super().__init__(f"{key}: {what}")
        self.key, self.what = key, what


def validated(cls: type[BaseModel], raw: Any, where: str = "", context: dict | None = None):
    """`cls` validated from `raw`; pydantic's first error becomes a ConfigError naming the dotted key
    (`where` is the prefix of every key) and what was expected (in the words of `explain`).
    context: what the sections' checks may read (check_files: whether local paths must exist now)."""
    try:
        return cls.model_validate(raw, context=context)
    except ValidationError as e:
        key, what = explain(cls, e.errors()[0])
        raise ConfigError(f"{_dotted(where, key)}: {what}") from None


def explain(cls: type[BaseModel], err: dict) -> tuple[str, str]:
    """(dotted key, what was expected) for one pydantic error of a `cls` validation: the one place
    pydantic's errors are put into this project's words."""
    loc, kind, ctx = err["loc"], err["type"], err.get("ctx") or {}
    got = "null" if err.get("input") is None else repr(err.get("input"))  # the file's word for None
    key = ".".join(str(p) if isinstance(p, str) else f"[{p}]" for p in loc).replace(".[", "[")
    field = _field_at(cls, loc)
    if kind == "missing":
        return key, "required"
    if kind == "extra_forbidden":
        return key, f"unknown key; expected some of {sorted(_model_at(cls, loc[:-1]).model_fields)}"
    if kind == "literal_error":
        choices = literal_choices(field.annotation) if field is not None else ctx["expected"]
        return key, f"expected one of {choices}, got {got}"
    if kind in _BOUNDS:
        expected = (field.json_schema_extra or {}).get("expected") if field is not None else None
        if expected:
            return key, f"expected {expected}, got {got}"
        name, op = _BOUNDS[kind]
        bound = ctx[name]  # pydantic gives an int field's bound as an int, a float field's as a float
        number = "an integer" if isinstance(bound, int) else "a number"
        return key, f"expected {number} {op} {bound:g}, got {got}"
    if kind == "value_error":
        error = ctx["error"]
        return (_dotted(key, error.key), error.what) if isinstance(error, SectionError) else (key, str(error))
    if kind == "string_too_short":
        return key, "expected a non-empty string"
    if kind == "too_short":
        return key, f"expected a list of at least {ctx['min_length']} item(s), got {got}"
    if kind in _TYPES:
        return key, f"expected {_TYPES[kind]}, got {got}"
    return key, f"{err['msg']}, got {got}"


_BOUNDS = {"greater_than": ("gt", ">"), "greater_than_equal": ("ge", ">="),
           "less_than": ("lt", "<"), "less_than_equal": ("le", "<=")}
_TYPES = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
          "string_type": "a string", "tuple_type": "a list of strings", "model_type": "an object"}


def _dotted(where: str, key: str) -> str:
    return f"{where}.{key}" if where and key else where or key


def submodel(annotation) -> type[BaseModel] | None:
    """The config section class an annotation holds (`X` or `X | None`), or None for a value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for m in map(submodel, typing.get_args(annotation)) if m is not None), None)


def _model_at(cls: type[BaseModel] | None, loc) -> type[BaseModel] | None:
    for part in loc:
        if isinstance(part, int):  # an item of a list of sections (data.sources[1]): the same section
            continue
        if cls is None or part not in cls.model_fields:
            return None
        cls = submodel(cls.model_fields[part].annotation)
    return cls


def _field_at(cls, loc):
    owner = _model_at(cls, loc[:-1]) if loc else None
    return owner.model_fields.get(loc[-1]) if owner is not None and isinstance(loc[-1], str) else None


def literal_choices(annotation) -> list:
    if typing.get_origin(annotation) is Literal:
        return list(typing.get_args(annotation))
    return [c for arg in typing.get_args(annotation) for c in literal_choices(arg)]


@contextlib.contextmanager
def errors_in(src: str):
    """Prefix the ConfigErrors raised inside with the config's name (its file)."""
    try:
        yield
    except ConfigError as e:
        if str(e).startswith(f"{src}: "):
            raise
        raise ConfigError(f"{src}: {e}") from None

