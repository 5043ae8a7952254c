import json

import pytest

from lomo_ds.config import ConfigError, load_config


def test_defaults_and_split():
    ds, lomo = load_config({"train_micro_batch_size_per_gpu": 2, "lomo": {"lr": 0.03, "clip_grad_norm": 1.0,
                                                                          "scheduler": {"type": "linear", "warmup_ratio": 0.05}}})
    assert ds["zero_optimization"]["stage"] == 3 and "lomo" not in ds
    assert lomo.lr == 0.03 and lomo.clip_grad_norm == 1.0 and lomo.scheduler.type == "linear"


@pytest.mark.parametrize("cfg, needle", [
    ({"lomo": {"lr": -1}}, "lomo.lr"),
    ({"lomo": {"learning_rate": 1}}, "lomo.learning_rate: unknown key"),
    ({"lomo": {"lr": "fast"}}, "lomo.lr: expected a number"),
    ({"lomo": {"clip_grad_norm": 0}}, "lomo.clip_grad_norm"),
    ({"lomo": {"scheduler": {"type": "step"}}}, "lomo.scheduler.type"),
    ({"lomo": {"scheduler": {"warmup_ratio": 1.5}}}, "lomo.scheduler.warmup_ratio"),
    ({"lomo": {"loss_scale": {"window": 0}}}, "lomo.loss_scale.window"),
    ({"lomo": {"two_pass_mode": "twice"}}, "lomo.two_pass_mode"),
    ({"lomo": {"stochastic_rounding": "yes"}}, "lomo.stochastic_rounding: expected true or false"),
    ({"optimizer": {"type": "AdamW"}}, "optimizer: LOMO is the optimizer"),
    ({"zero_optimization": {"stage": 2}}, "zero_optimization.stage"),
    ({"gradient_accumulation_steps": 4}, "gradient_accumulation_steps"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "choose one precision"),
])
def test_bad_values_name_the_key(cfg, needle):
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    assert needle in str(e.value)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json: not valid JSON"):
        load_config(bad)
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"lomo": {"lr": 0.01}}))
    assert load_config(good)[1].lr == 0.01
