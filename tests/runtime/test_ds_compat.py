"""Fails loudly when a DeepSpeed release moves an internal lomo_ds relies on."""
from lomo_ds.runtime import ds_compat


def test_deepspeed_internals_present():
    problems = ds_compat.check_internals()
    assert problems == [], f"DeepSpeed internals lomo_ds relies on have moved: {problems}"

