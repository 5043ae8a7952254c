"""Fails loudly when a DeepSpeed release moves an internal lomo_ds relies on."""
from lomo_ds.runtime import ds_compat


def test_deepspeed_internals_present():
    problems = ds_compat.check_internals()
    assert problems == [], f"DeepSpeed internals lomo_ds relies on have moved: {problems}"


def test_zero3_param_attributes_present(engine_results):
    # The multi-rank checks built real ZeRO-3 parameters; any missing attribute fails there with
    # its name (LomoEngine.__init__ checks them), so a clean sgd run proves they exist.
    assert "error" not in engine_results(2)["sgd"]
