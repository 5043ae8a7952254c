"""memory.int8_shards and memory.int8_block: what 8-bit weight shards are refused with, and why
(lomo_ds/config/checks/int8_shards.py: the run config's check, and refuse_int8_conflicts, which the
engine's constructor also runs on the config it is given)."""
from __future__ import annotations

import pytest

from lomo_ds.config.checks.int8_shards import refuse_int8_conflicts
from lomo_ds.config.engine_config import load_config
from lomo_ds.config.errors import ConfigError
from lomo_ds.config.run import load_run_config

BASE = {"model": {"path": "m"}, "lomo": {"lr": 0.03}, "bf16": {"enabled": True},
        "memory": {"int8_shards": True}}


def _with(**sections):
    cfg = {k: dict(v) if isinstance(v, dict) else v for k, v in BASE.items()}
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    return cfg


def test_int8_shards_load_with_their_block():
    cfg = load_run_config(_with(memory={"int8_block": 64}), check_files=False)
    assert cfg.memory.int8_shards and cfg.memory.int8_block == 64
    assert load_run_config({"model": {"path": "m"}, "lomo": {"lr": 0.03}}, check_files=False).memory.int8_block == 128


@pytest.mark.parametrize("sections, pattern", [
    ({"lomo": {"fp32_master_weights": True}}, r"lomo\.fp32_master_weights: expected false with memory\.int8_shards"),
    ({"bf16": {"enabled": False}, "fp16": {"enabled": True}},
     r"fp16\.enabled: expected false with memory\.int8_shards"),
    ({"memory": {"int8_block": 12}}, r"memory\.int8_block: .*multiple of 8"),
    ({"memory": {"int8_block": 0}}, r"memory\.int8_block"),
    ({"train": {"method": "sgd"}}, r"memory\.int8_shards: applied by the fused-update engine"),
    ({"memory": {"host_update": "thread"}, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
     r"memory\.host_update: expected 'inline' .*zero_optimization\.offload_param\.device 'cpu'"),
])
def test_run_config_refuses(sections, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_run_config(_with(**sections), check_files=False)


@pytest.mark.parametrize("flag", ["zero_quantized_weights", "zero_quantized_nontrainable_weights",
                                  "zero_quantized_gradients"])
def test_deepspeed_quantization_is_refused(flag):
    """For LOMO's methods DeepSpeed's own switches are refused whatever memory.int8_shards says
    (ds_options); the int8 check names the switch too when it is reached directly."""
    cfg = _with(zero_optimization={"stage": 3, flag: True})
    with pytest.raises(ConfigError, match=rf"zero_optimization\.{flag}"):
        load_run_config(cfg, check_files=False)
    memory, lomo = load_run_config(BASE, check_files=False).memory, load_run_config(BASE, check_files=False).lomo
    with pytest.raises(ConfigError, match=rf"zero_optimization\.{flag}: expected false with memory\.int8_shards"):
        refuse_int8_conflicts(memory, lomo, {"zero_optimization": {flag: True}})


def test_engine_config_refusals_and_the_check_can_pass():
    ds, cfg = load_config({"bf16": {"enabled": True}, "lomo": {"lr": 0.1, "fp32_master_weights": True},
                           "memory": {"int8_shards": True}})
    with pytest.raises(ConfigError, match=r"lomo\.fp32_master_weights"):
        refuse_int8_conflicts(cfg.memory, cfg.lomo, ds)
    ds, cfg = load_config({"bf16": {"enabled": True}, "lomo": {"lr": 0.1}, "memory": {"int8_shards": True}})
    refuse_int8_conflicts(cfg.memory, cfg.lomo, ds)  # a valid config passes: the check is not a blanket refusal
    ds, cfg = load_config({"fp16": {"enabled": True}, "lomo": {"lr": 0.1}, "memory": {"int8_shards": False}})
    refuse_int8_conflicts(cfg.memory, cfg.lomo, ds)  # off: nothing to refuse


@pytest.mark.parametrize("host_update", ["inline", "auto"])
def test_offload_param_loads_with_the_update_in_the_hook(host_update):
    """offload_param cpu runs 8-bit shards with the update in the gradient hook (the engine equals
    the resident run bit for bit: tests/engine/test_int8_features.py); 'auto' is the hook on CPU
    ranks, and the engine refuses it once it finds an accelerator (its worker would hold shards)."""
    cfg = load_run_config(_with(memory={"host_update": host_update},
                                zero_optimization={"stage": 3, "offload_param": {"device": "cpu"}}), check_files=False)
    assert cfg.memory.int8_shards and cfg.memory.host_update == host_update
