"""What every config section builds on: `Section` (unknown keys are errors, values are not coerced,
a validated section cannot be changed), `Int` (a whole float such as 2.5e7 read as an int) and
`expects` (the words an out-of-range error uses). The sections themselves: lomo_section.py (the
update rule's `lomo`), engine_sections.py (comm, memory, train), run.py (the run's)."""
from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict


def _whole_float_to_int(value):
    # Counts are often written 2.5e7 (JSON and YAML then give a float): accept whole numbers.
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_whole_float_to_int)]


class Section(BaseModel):
    """A config section: unknown keys are errors, values are not coerced (the string "yes" is not
    true, "3" is not a number), and a validated section cannot be changed."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def expects(text: str) -> dict:
    """`Field(..., json_schema_extra=expects("a positive learning rate"))`: the words an out-of-range
    error uses for what was expected (the field's description is its documentation)."""
    return {"expected": text}
