"""One loading pipeline (lomo_ds/config/loading.py) for the engine's config and the run's, and each
feature's checks in its own module (lomo_ds/config/checks): no GPU, no model."""
from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from lomo_ds.config import checks
from lomo_ds.config.engine_config import load_config
from lomo_ds.config.errors import ConfigError
from lomo_ds.config.run import load_run_config

ENGINE = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "gradient_accumulation_steps": 3,
          "bf16": {"enabled": True}, "lomo": {"optimizer": "adalomo", "lr": 0.01},
          "comm": {"bucket_size": 1000}, "memory": {"two_pass_mode": "recompute"}, "train": {"seed": 7}}


def test_the_engine_config_is_the_run_configs_engine_part():
    """The same file loaded as an engine config and as a run config gives the same DeepSpeed dict
    and the same engine sections: mapped keys, the preset's fills and the defaults alike."""
    ds, engine = load_config(ENGINE)
    run = load_run_config({**ENGINE, "model": {"path": "m"}})
    assert ds == run.ds
    assert engine.model_dump() == run.engine.model_dump()
    assert engine.train.clip_grad_norm == 1.0 and engine.train.accumulation_steps == 3


def test_both_loaders_take_overrides_and_refuse_the_same_mistakes():
    assert load_config(ENGINE, {"lomo.lr": 0.5})[1].lomo.lr == 0.5
    for bad, message in (({"lomo.recipes": {}}, "lomo.recipes moved to lomo.presets"),
                         ({"comm.nope": 1}, "override 'comm.nope': unknown key")):
        with pytest.raises(ConfigError, match=message):
            load_config(ENGINE, bad)
        with pytest.raises(ConfigError, match=message):
            load_run_config({**ENGINE, "model": {"path": "m"}}, bad)
    for config in ({**ENGINE, "_comment": "x"}, {**ENGINE, "memroy": {}}):
        with pytest.raises(ConfigError, match=r"^<config>: (_comment|memroy): unknown key"):
            load_config(config)


def test_a_sections_own_check_names_the_whole_key():
    """A section's validator names its field; the error names the key from the top of the file."""
    sources = [{"path": "a.jsonl", "format": "text"}, {"path": "b/a.jsonl", "format": "text"}]
    with pytest.raises(ConfigError, match=r"^<config>: data\.sources\[1\]\.name: 'a' names data\.sources\[0\] too"):
        load_run_config({"model": {"path": "m"}, "lomo": {"lr": 0.1}, "data": {"sources": sources}},
                        check_files=False)


def test_every_feature_check_is_run():
    """A check written in lomo_ds/config/checks but left out of RUN_CHECKS would never run."""
    found = set()
    for info in pkgutil.iter_modules(checks.__path__):
        module = importlib.import_module(f"{checks.__name__}.{info.name}")
        found |= {f for name, f in inspect.getmembers(module, inspect.isfunction)
                  if name.startswith("check_") and f.__module__ == module.__name__}
    assert found and found == set(checks.RUN_CHECKS)
