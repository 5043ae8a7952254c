import json
import os

import pytest
from pydantic import ValidationError

from lomo_ds.config import ds_options
from lomo_ds.config.engine_config import load_config
from lomo_ds.config.engine_sections import EngineConfig
from lomo_ds.config.errors import ConfigError
from tests.tiny import engine_sections

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_defaults_and_split():
    ds, cfg = load_config({"train_micro_batch_size_per_gpu": 2, "lomo": {"lr": 0.03},
                           "train": {"clip_grad_norm": 1.0, "scheduler": {"type": "linear", "warmup_ratio": 0.05}}})
    assert ds["zero_optimization"]["stage"] == 3 and not {"lomo", "comm", "memory", "train"} & set(ds)
    assert cfg.lomo.lr == 0.03 and cfg.train.clip_grad_norm == 1.0 and cfg.train.scheduler.type == "linear"


@pytest.mark.parametrize("cfg, needle", [
    ({"lomo": {"lr": -1}}, "lomo.lr"),
    ({"lomo": {"learning_rate": 1}}, "lomo.learning_rate: unknown key"),
    ({"lomo": {"lr": "fast"}}, "lomo.lr: expected a number"),
    ({"train": {"clip_grad_norm": 0}}, "train.clip_grad_norm"),
    ({"train": {"scheduler": {"type": "step"}}}, "train.scheduler.type"),
    ({"train": {"scheduler": {"warmup_ratio": 1.5}}}, "train.scheduler.warmup_ratio"),
    ({"lomo": {"loss_scale": {"window": 0}}}, "lomo.loss_scale.window"),
    ({"memory": {"two_pass_mode": "twice"}}, "memory.two_pass_mode"),
    ({"lomo": {"stochastic_rounding": "yes"}}, "lomo.stochastic_rounding: expected true or false"),
    ({"optimizer": {"type": "AdamW"}}, "optimizer: LOMO is the optimizer"),
    ({"zero_optimization": {"stage": 2}}, "zero_optimization.stage"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps (LOMO's train.accumulation_steps): expected an "
                                         "integer >= 1, got 0"),
    ({"gradient_accumulation_steps": 4, "train": {"accumulation_steps": 2}},
     "gradient_accumulation_steps (4) and train.accumulation_steps (2) disagree"),
    ({"memory": {"accumulate_dtype": "fp64"}}, "memory.accumulate_dtype: expected one of ['fp32', 'bf16', 'fp16']"),
    ({"memory": {"accumulate_on": "nvme"}}, "memory.accumulate_on: expected one of ['device', 'cpu']"),
    ({"train": {"loss_normalization": "sum"}}, "train.loss_normalization: expected one of ['mean', 'tokens']"),
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
    assert load_config(good)[1].lomo.lr == 0.01


# ----------------------------------------------------------------------------- new lomo fields

def test_new_lomo_fields_defaults():
    lomo = load_config({})[1].lomo
    assert lomo.optimizer == "sgd" and lomo.max_consecutive_skips == 20
    assert (lomo.adalomo.clip_threshold, lomo.adalomo.eps1, lomo.adalomo.eps2, lomo.adalomo.decay_rate) == \
        (1.0, 1e-30, 1e-3, -0.8)
    lomo = load_config({"lomo": {"optimizer": "adalomo", "adalomo": {"eps2": 0.01},
                                 "max_consecutive_skips": 3}})[1].lomo
    assert lomo.optimizer == "adalomo" and lomo.adalomo.eps2 == 0.01 and lomo.max_consecutive_skips == 3


@pytest.mark.parametrize("lomo, match", [
    ({"optimizer": "adam"}, r"lomo\.optimizer: expected one of \['sgd', 'adalomo'\], got 'adam'"),
    ({"adalomo": {"decay_rate": 0.8}}, r"lomo\.adalomo\.decay_rate: expected a number < 0"),
    ({"adalomo": {"eps1": 0}}, r"lomo\.adalomo\.eps1: expected a number > 0"),
    ({"adalomo": {"clip_threshold": -1}}, r"lomo\.adalomo\.clip_threshold: expected a number > 0"),
    ({"adalomo": {"beta1": 0.9}}, r"lomo\.adalomo\.beta1: unknown key"),
    ({"max_consecutive_skips": 0}, r"lomo\.max_consecutive_skips: expected an integer >= 1, got 0"),
    ({"max_consecutive_skips": 2.5}, r"lomo\.max_consecutive_skips: expected an integer, got 2\.5"),
])
def test_new_lomo_fields_validated(lomo, match):
    with pytest.raises(ConfigError, match=match):
        load_config({"lomo": lomo})


def test_validated_config_is_frozen():
    cfg = load_config({"lomo": {"exclude_params": ["lora_*"]}})[1]
    lomo = cfg.lomo
    for change in (lambda: setattr(lomo, "lr", 1.0), lambda: setattr(cfg.train.scheduler, "total_steps", 5),
                   lambda: setattr(cfg, "comm", cfg.comm)):
        with pytest.raises(ValidationError, match="frozen"):
            change()
    assert lomo.exclude_params == ("lora_*",)  # a tuple: not even the list can change


def test_whole_floats_count_as_integers():
    assert load_config({"comm": {"bucket_size": 2.5e7}})[1].comm.bucket_size == 25_000_000


# ----------------------------------------------------------------------------- DeepSpeed options

@pytest.mark.parametrize("ds, lomo_key, expected", [
    ({"gradient_clipping": 1.0}, "train.clip_grad_norm", 1.0),
    ({"gradient_clipping": 0}, "train.clip_grad_norm", None),  # DeepSpeed's "off"
    ({"communication_data_type": "BF16"}, "comm.reduce_dtype", "bf16"),
    ({"fp16": {"enabled": True, "initial_scale_power": 12}}, "lomo.loss_scale.initial_scale_power", 12),
    ({"fp16": {"enabled": True, "loss_scale_window": 50}}, "lomo.loss_scale.window", 50),
    ({"fp16": {"enabled": True, "min_loss_scale": 0.5}}, "lomo.loss_scale.min_scale", 0.5),
    ({"fp16": {"enabled": True, "loss_scale": 0}}, "lomo.loss_scale.initial_scale_power", 16),  # 0: dynamic
    ({"gradient_accumulation_steps": 8}, "train.accumulation_steps", 8),
])
def test_mapped_deepspeed_keys_reach_their_sections(ds, lomo_key, expected):
    lomo = load_config(ds)[1]
    value = lomo
    for part in lomo_key.split("."):
        value = getattr(value, part)
    assert value == expected


def test_every_mapped_row_is_tested():
    tested = {"gradient_clipping", "communication_data_type", "fp16.initial_scale_power", "fp16.loss_scale_window",
              "fp16.min_loss_scale", "gradient_accumulation_steps"}
    assert {o.key for o in ds_options.OPTIONS if o.status == ds_options.MAPPED} == tested


@pytest.mark.parametrize("ds, lomo, names", [
    ({"gradient_clipping": 1.0}, {"clip_grad_norm": 2.0}, ("gradient_clipping", "train.clip_grad_norm")),
    ({"gradient_clipping": 0}, {"clip_grad_norm": 1.0}, ("gradient_clipping", "train.clip_grad_norm")),
    ({"communication_data_type": "fp16"}, {"reduce_dtype": "bf16"}, ("communication_data_type", "comm.reduce_dtype")),
    ({"fp16": {"initial_scale_power": 8}}, {"loss_scale": {"initial_scale_power": 10}},
     ("fp16.initial_scale_power", "lomo.loss_scale.initial_scale_power")),
    ({"fp16": {"loss_scale_window": 8}}, {"loss_scale": {"window": 10}},
     ("fp16.loss_scale_window", "lomo.loss_scale.window")),
    ({"fp16": {"min_loss_scale": 2}}, {"loss_scale": {"min_scale": 1}},
     ("fp16.min_loss_scale", "lomo.loss_scale.min_scale")),
    ({"gradient_accumulation_steps": 4}, {"accumulation_steps": 1}, ("gradient_accumulation_steps",
                                                                    "train.accumulation_steps")),
])
def test_conflicting_deepspeed_and_lomo_keys_name_both(ds, lomo, names):
    with pytest.raises(ConfigError, match="disagree") as e:
        load_config({**ds, **engine_sections(lomo)})
    assert all(name in str(e.value) for name in names)


def test_agreeing_deepspeed_and_lomo_keys_are_fine():
    cfg = load_config({"gradient_clipping": 1, "fp16": {"loss_scale_window": 10},
                       "lomo": {"loss_scale": {"window": 10}}, "train": {"clip_grad_norm": 1.0}})[1]
    assert cfg.train.clip_grad_norm == 1.0 and cfg.lomo.loss_scale.window == 10


def test_gradient_accumulation_steps_maps_both_ways():
    """DeepSpeed's key sets train.accumulation_steps; the lomo key alone sets DeepSpeed's (which the
    baselines' DeepSpeed optimizer reads); agreeing values are fine; the default is 1 on both."""
    ds, cfg = load_config({"gradient_accumulation_steps": 4})
    assert cfg.train.accumulation_steps == 4 and ds["gradient_accumulation_steps"] == 4
    ds, cfg = load_config({"train": {"accumulation_steps": 3}})
    assert cfg.train.accumulation_steps == 3 and ds["gradient_accumulation_steps"] == 3
    ds, cfg = load_config({"gradient_accumulation_steps": 2, "train": {"accumulation_steps": 2}})
    assert cfg.train.accumulation_steps == 2 and ds["gradient_accumulation_steps"] == 2
    ds, cfg = load_config({})
    assert (cfg.train.accumulation_steps, cfg.memory.accumulate_dtype, cfg.memory.accumulate_on,
            cfg.train.loss_normalization) == (1, "fp32", "device", "mean") and ds["gradient_accumulation_steps"] == 1


def test_bad_mapped_value_names_the_deepspeed_key():
    with pytest.raises(ConfigError, match=r"gradient_clipping \(LOMO's train\.clip_grad_norm\): expected a positive"):
        load_config({"gradient_clipping": -1.0})
    with pytest.raises(ConfigError, match=r"communication_data_type \(LOMO's comm\.reduce_dtype\): expected one of"):
        load_config({"communication_data_type": "int8"})


# A value LOMO refuses, for every refused row of the table (a new row without one fails below).
REFUSED_VALUES = {
    "optimizer": {"type": "AdamW"},
    "scheduler": {"type": "WarmupLR"},
    "prescale_gradients": True,
    "gradient_predivide_factor": 2.0,
    "bfloat16": {"enabled": True},
    "fp16.loss_scale": 128,
    "fp16.hysteresis": 2,
    "fp16.consecutive_hysteresis": True,
    "fp16.fp16_master_weights_and_grads": True,
    "bf16.bf16_master_weights_and_grads": True,
    "zero_optimization.stage": 2,
    "tensorboard": {"enabled": True, "output_path": "tb"},
    "wandb": {"enabled": True},
    "csv_monitor": {"enabled": True},
    "comet": {"enabled": True},
    "wall_clock_breakdown": True,
    "flops_profiler": {"enabled": True},
    "amp": {"enabled": True},
    "torch_autocast": {"enabled": True},
    "autotuning": {"enabled": True},
    "compile": {"deepcompile": True},
    "curriculum_learning": {"enabled": True},
    "data_efficiency": {"enabled": True},
    "progressive_layer_drop": {"enabled": True},
    "quantize_training": {"enabled": True},
    "eigenvalue": {"enabled": True},
    "elasticity": {"enabled": True},
    "hybrid_engine": {"enabled": True},
    "nebula": {"enabled": True},
    "checkpoint": {"tag_validation": "FAIL"},
    "datastates_ckpt": {"host_cache_size": 8},
    "compression_training": {"weight_quantization": {}},
    "weight_quantization": {"post_init_quant": {}},
    "data_types": {"grad_accum_dtype": "fp32"},
    "dataloader_drop_last": True,
    "sparse_gradients": True,
    "gradient_allreduce_op": "sum",
    "managed_gradient_accumulation": True,
    "pipeline": {"stages": 2},
    "tensor_parallel": {"autotp_size": 2},
    "expert_parallel": {"enabled": True},
    "use_data_before_expert_parallelism": True,
    "zero_optimization.reduce_bucket_size": 5e8,
    "zero_optimization.offload_optimizer": {"device": "cpu"},
    "zero_optimization.cpu_offload": True,
    "zero_optimization.zenflow": {"topk_ratio": 0.1},
    "zero_optimization.offload_param.device": "nvme",
    "zero_optimization.zero_hpz_partition_size": 8,
    "zero_optimization.zero_quantized_weights": True,
    "zero_optimization.zero_quantized_nontrainable_weights": True,
    "zero_optimization.zero_quantized_gradients": True,
    "zero_optimization.mics_shard_size": 8,
    "zero_optimization.mics_hierarchical_params_gather": True,
    "zero_optimization.zeropp_loco_param": {"err_beta": 0.8},
}


def _nested(dotted: str, value) -> dict:
    *parents, name = dotted.split(".")
    out = node = {}
    for part in parents:
        node[part] = node = {}
    node[name] = value
    return out


def test_every_refused_row_is_tested():
    assert {o.key for o in ds_options.OPTIONS if o.status == ds_options.REFUSED} == set(REFUSED_VALUES)


@pytest.mark.parametrize("key", sorted(REFUSED_VALUES))
def test_refused_deepspeed_keys_name_the_key_and_the_reason(key):
    with pytest.raises(ConfigError) as e:
        load_config(_nested(key, REFUSED_VALUES[key]))
    assert f"{key}: {ds_options.option(key).reason}" in str(e.value)


@pytest.mark.parametrize("key", sorted(k for k in REFUSED_VALUES if ds_options.option(k).accepts))
def test_refused_rows_accept_their_default(key):
    load_config(_nested(key, ds_options.option(key).accepts[0]))


@pytest.mark.parametrize("key", sorted(o.key for o in ds_options.OPTIONS if o.when_enabled))
def test_sections_refused_when_enabled_are_fine_while_off(key):
    row = ds_options.option(key)
    load_config({key: {row.when_enabled: False}})


@pytest.mark.parametrize("monitor", ["tensorboard", "wandb", "csv_monitor", "comet"])
def test_deepspeed_monitors_are_refused_under_lomo_naming_lomo_ds_metrics(monitor):
    """LOMO never runs DeepSpeed's step, from which the monitors write: they would log nothing."""
    with pytest.raises(ConfigError, match="output.metrics_file") as e:
        load_config({monitor: {"enabled": True}})
    assert "output.tensorboard" in str(e.value) and str(e.value).startswith(f"<config>: {monitor}: ")
    # The baselines run DeepSpeed's step: their monitors work.
    from lomo_ds.config.engine_config import validate_deepspeed_section

    validate_deepspeed_section({monitor: {"enabled": True}}, EngineConfig(), lomo_method=False)


def test_unknown_top_level_deepspeed_key_is_refused():
    with pytest.raises(ConfigError, match=r"steps_per_prnt: unknown key; did you mean 'steps_per_print'\?"):
        load_config({"steps_per_prnt": 10})


def test_table_covers_every_top_level_key_of_the_installed_deepspeed():
    """The keys the installed DeepSpeed's config reads, recorded as it reads them, are the table's."""
    from deepspeed.runtime.config import DeepSpeedConfig

    read = set()

    class Keys:
        def __init__(self, d):
            self.d = d

        def __contains__(self, k):
            read.add(k)
            return k in self.d

        def __iter__(self):
            return iter(list(self.d))

    class Recording(dict):
        def get(self, k, default=None):
            read.add(k)
            return super().get(k, default)

        def __contains__(self, k):
            read.add(k)
            return super().__contains__(k)

        def __getitem__(self, k):
            read.add(k)
            return super().__getitem__(k)

        def keys(self):
            return Keys(dict(self))

    DeepSpeedConfig(Recording({"train_micro_batch_size_per_gpu": 1, "train_batch_size": 1,
                               "gradient_accumulation_steps": 1}))
    top = {name for o in ds_options.OPTIONS if "." not in o.key for name in (o.key, *o.aliases)}
    assert len(read) > 40, "recording DeepSpeed's reads found too few keys"
    assert top == read, f"lomo_ds/config/ds_options.py differs from DeepSpeed's top-level keys: " \
                        f"missing {sorted(read - top)}, not DeepSpeed's {sorted(top - read)}"


def test_supported_options_pass_through_to_deepspeed():
    zero = {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}, "stage3_prefetch_bucket_size": 0,
            "prefetch_bucket_size": 0, "stage3_max_live_parameters": 1e9, "overlap_comm": True,
            "stage3_gather_fp16_weights_on_model_save": True, "leaf_module": {"names": ["experts"]}}
    ds, _ = load_config({"zero_optimization": zero, "gradient_clipping": 1.0, "steps_per_print": 5})
    assert ds["zero_optimization"] == zero and ds["gradient_clipping"] == 1.0 and ds["steps_per_print"] == 5


@pytest.mark.parametrize("zero, match", [
    ({"stage3_prefetch_bucket_sise": 1}, r"zero_optimization\.stage3_prefetch_bucket_sise: unknown key; "
                                         r"did you mean 'stage3_prefetch_bucket_size'\?"),
    ({"offload_param": {"devices": "cpu"}}, r"zero_optimization\.offload_param\.devices: unknown key"),
    ({"offload_param": "cpu"}, r"zero_optimization\.offload_param: expected an object"),
])
def test_unknown_zero_keys_are_refused(zero, match):
    with pytest.raises(ConfigError, match=match):
        load_config({"zero_optimization": zero})


def test_table_covers_every_zero_key_of_the_installed_deepspeed():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadParamConfig

    def names(model):
        return {n for name, f in model.model_fields.items() for n in (name, f.alias) if n}

    zero = {name for o in ds_options.OPTIONS if o.key.count(".") == 1 and o.key.startswith("zero_optimization.")
            for name in (o.key.split(".", 1)[1], *o.aliases)}
    removed = {"mics_shard_size", "mics_hierarchical_params_gather", "zeropp_loco_param"}  # DeepSpeed refuses them
    assert zero - removed == names(DeepSpeedZeroConfig), \
        "lomo_ds/config/ds_options.py differs from DeepSpeed's ZeRO keys"
    prefix = "zero_optimization.offload_param."
    offload = {o.key.rsplit(".", 1)[1] for o in ds_options.OPTIONS if o.key.startswith(prefix)}
    assert names(DeepSpeedZeroOffloadParamConfig) == offload


def test_readme_section_is_the_table():
    readme = open(os.path.join(ROOT, "docs", "configs.md")).read()
    section = readme.split("## DeepSpeed options\n", 1)[1].split("\n## ", 1)[0]
    assert ds_options.table_markdown() in section, \
        "docs/configs.md is out of date: regenerate its section with ds_options.table_markdown()"


def test_readme_engine_options_are_the_models():
    """docs/configs.md's engine reference is generated from EngineConfig's sections, a description on
    every field."""
    from lomo_ds.config.docs import options_markdown

    table = options_markdown()
    assert "| None |" not in table, "an engine option has no description (Field(description=...))"
    assert table.count("\n") == 2 + sum(1 for _ in _all_fields(EngineConfig))
    readme = open(os.path.join(ROOT, "docs", "configs.md")).read()
    section = readme.split("## Engine options\n", 1)[1].split("\n## ", 1)[0]
    assert table in section, "docs/configs.md is out of date: regenerate its section with options_markdown()"


def _all_fields(cls):
    from lomo_ds.config.errors import submodel

    for field in cls.model_fields.values():
        yield field
        if submodel(field.annotation) is not None:
            yield from _all_fields(submodel(field.annotation))


# ----------------------------------------------------------------------------- per-rule presets
PRESETS = {"sgd": {"lr": 0.3, "clip_grad_norm": 1.0, "clip_grad_value": 1e-4, "scheduler": {"warmup_ratio": 0.0}},
           "adalomo": {"lr": 1e-3, "clip_grad_norm": 1.0, "clip_grad_value": None, "scheduler": {"warmup_ratio": 0.1}}}


def _update(cfg):
    """(lr, clip_grad_norm, clip_grad_value, schedule type, warm-up ratio) of an engine config."""
    return (cfg.lomo.lr, cfg.train.clip_grad_norm, cfg.train.clip_grad_value, cfg.train.scheduler.type,
            cfg.train.scheduler.warmup_ratio)


def test_the_chosen_rules_preset_fills_the_keys_left_out():
    """One key (lomo.optimizer) switches the update rule and, with it, the learning rate, clipping
    and warm-up the config's preset gives that rule; keys the config sets itself win."""
    def config(optimizer, lomo=None, train=None):
        return {"lomo": {"presets": PRESETS, "optimizer": optimizer, **(lomo or {})},
                "train": {"scheduler": {"type": "linear"}, **(train or {})}}

    assert _update(load_config(config("adalomo"))[1]) == (1e-3, 1.0, None, "linear", 0.1)
    assert _update(load_config(config("sgd"))[1]) == (0.3, 1.0, 1e-4, "linear", 0.0)
    mine = load_config(config("sgd", {"lr": 0.1}, {"scheduler": {"warmup_ratio": 0.2}}))[1]
    assert _update(mine) == (0.1, 1.0, 1e-4, "constant", 0.2)
    # A DeepSpeed key mapped onto a section is the author's too: it wins over the preset.
    assert load_config({"gradient_clipping": 0.5, **config("sgd")})[1].train.clip_grad_norm == 0.5
    # Without a preset for the chosen rule, nothing changes.
    assert load_config({"lomo": {"presets": {"sgd": PRESETS["sgd"]}, "optimizer": "adalomo"}})[1].lomo.lr == 1e-3
    plain = load_config({"lomo": {"presets": {"adalomo": {"lr": 5e-4}}, "lr": 0.05}})[1].lomo
    assert plain.lr == 0.05 and plain.optimizer == "sgd"


def test_a_run_config_switches_rule_by_one_override(tmp_path):
    from lomo_ds.config.run import load_run_config

    path = tmp_path / "run.json"
    path.write_text(json.dumps({"model": {"path": "tiny-llama-in-memory"}, "train": {"method": "lomo"},
                                "lomo": {"optimizer": "adalomo", "presets": PRESETS}}))
    ada = load_run_config(str(path), check_files=False)
    sgd = load_run_config(str(path), {"lomo.optimizer": "sgd"}, check_files=False)
    assert (ada.lomo.optimizer, ada.lomo.lr, ada.train.clip_grad_value) == ("adalomo", 1e-3, None)
    assert (sgd.lomo.optimizer, sgd.lomo.lr, sgd.train.clip_grad_value) == ("sgd", 0.3, 1e-4)


@pytest.mark.parametrize("presets, needle", [
    ({"sgd": {"lr": -1}}, "lomo.presets.sgd.lr: expected a positive learning rate, got -1"),
    ({"sgd": {"learning_rate": 1}}, "lomo.presets.sgd.learning_rate: unknown key"),
    ({"adam": {"lr": 1}}, "lomo.presets.adam: unknown key; expected some of ['adalomo', 'sgd']"),
    ({"adalomo": {"scheduler": {"warmup_ratio": 2}}}, "lomo.presets.adalomo.scheduler.warmup_ratio"),
    ({"sgd": {"clip_grad_value": 0}}, "lomo.presets.sgd.clip_grad_value: expected a positive number or null"),
])
def test_bad_presets_name_the_key(presets, needle):
    """Both rules' presets are checked on load, the one not chosen too (a switch later must not fail)."""
    with pytest.raises(ConfigError) as e:
        load_config({"lomo": {"presets": presets, "optimizer": "adalomo"}})
    assert needle in str(e.value)


SHIPPED = {  # config: its default rule, (LOMO's lr, clip, warm-up, schedule), (AdaLomo's)
    "cpu_default.json": ("adalomo", (0.2, 1.0, 0.1, "cosine"), (1e-3, 1.0, 0.1, "cosine")),
    "cpu_chat.json": ("sgd", (0.05, 1.0, 0.1, "linear"), (1e-3, 1.0, 0.1, "linear")),
    "cpu_long_context.json": ("adalomo", (0.2, 1.0, 0.1, "cosine"), (1e-3, 1.0, 0.1, "cosine")),
    **{f"llama{size}.json": ("adalomo", (0.03, 1.0, 0.05, "linear"), (5e-4, None, 0.03, "linear"))
       for size in ("7b", "13b", "30b", "65b", "7b_chat")},
}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_configs_switch_rule_by_one_key(name):
    """The shipped configs carry both rules' presets and switch by one key: AdaLomo by default where
    the quality sweep put it ahead (docs/results.md), plain LOMO one override away, each with
    its own lr, clipping, warm-up and schedule."""
    from lomo_ds.config.run import load_run_config

    path = os.path.join(ROOT, "ds_configs", name)
    default, want_lomo, want_ada = SHIPPED[name]
    assert load_run_config(path, {}, check_files=False).lomo.optimizer == default
    lomo, ada = (load_run_config(path, {"lomo.optimizer": rule}, check_files=False) for rule in ("sgd", "adalomo"))
    assert (lomo.lomo.optimizer, ada.lomo.optimizer) == ("sgd", "adalomo")
    for cfg, want in zip((lomo, ada), (want_lomo, want_ada), strict=True):
        assert (cfg.lomo.lr, cfg.train.clip_grad_norm, cfg.train.scheduler.warmup_ratio,
                cfg.train.scheduler.type) == want


def test_the_run_says_which_update_and_what_its_preset_filled():
    from lomo_ds.config.presets import describe_update
    from lomo_ds.config.run import load_run_config

    path = os.path.join(ROOT, "ds_configs", "llama7b.json")
    lomo = load_run_config(path, {"lomo.optimizer": "sgd"}, check_files=False)
    ada = load_run_config(path, {"lomo.lr": 2e-3}, check_files=False)  # AdaLomo: the config's default
    assert describe_update(lomo) == ("LOMO (SGD), lr 0.03, clip_grad_norm 1, clip_grad_value none, linear schedule, "
                                      "warm-up 0.05 (clip_grad_norm, lr, scheduler.warmup_ratio from lomo.presets.sgd)")
    assert describe_update(ada) == ("AdaLomo, lr 0.002, clip_grad_norm none, clip_grad_value none, linear schedule, "
                                     "warm-up 0.03 (clip_grad_norm, scheduler.warmup_ratio from lomo.presets.adalomo)")
    plain = load_config({"lomo": {"lr": 0.1}, "train": {"scheduler": {"warmup_steps": 3}}})[1]
    assert describe_update(plain) == "LOMO (SGD), lr 0.1, clip_grad_norm none, clip_grad_value none, constant " \
                                      "schedule, warm-up 3 steps"


# ----------------------------------------------------------------------------- keys that moved
OLD_KEYS = {  # a config written for the keys before the split by concern: each old key, its new one
    "lomo": {"bucket_size": 1000, "clip_grad_norm": 1.0, "scheduler": {"type": "linear"}, "seed": 3,
             "chunked_loss": "off", "accumulation_steps": 2, "recipes": {"sgd": {"lr": 0.1}}},
    "data": {"seed": 42},
    "train": {"baseline_lr": 1e-5, "baseline_weight_decay": 0.1, "lora": {"lr": 5e-4}},
}
NEW_KEYS = {"lomo.bucket_size": "comm.bucket_size", "lomo.clip_grad_norm": "train.clip_grad_norm",
            "lomo.scheduler": "train.scheduler", "lomo.seed": "train.seed", "lomo.chunked_loss": "memory.chunked_loss",
            "lomo.accumulation_steps": "train.accumulation_steps", "lomo.recipes": "lomo.presets",
            "data.seed": "train.seed", "train.baseline_lr": "train.lr",
            "train.baseline_weight_decay": "train.weight_decay", "train.lora.lr": "train.lr"}


def test_a_config_for_the_old_keys_names_each_new_key():
    """One line per old key present, each naming the key that replaced it."""
    from lomo_ds.config.run import load_run_config

    engine_keys = {k: v for k, v in NEW_KEYS.items() if k.startswith("lomo.")}
    with pytest.raises(ConfigError) as e:
        load_config({"lomo": OLD_KEYS["lomo"]})
    assert sorted(str(e.value).splitlines()) == sorted(f"<config>: {old} moved to {new}"
                                                       for old, new in engine_keys.items())
    with pytest.raises(ConfigError) as e:
        load_run_config({**OLD_KEYS, "model": {"path": "tiny-llama-in-memory"}}, check_files=False)
    assert sorted(str(e.value).splitlines()) == sorted(f"<config>: {old} moved to {new}"
                                                       for old, new in NEW_KEYS.items())


def test_every_moved_key_names_a_key_that_exists():
    from lomo_ds.config.errors import submodel
    from lomo_ds.config.moved import MOVED
    from lomo_ds.config.run import RunConfig

    for old, new in MOVED.items():
        section = RunConfig
        for part in new.split("."):
            assert section is not None and part in section.model_fields, (old, new)
            section = submodel(section.model_fields[part].annotation)


def test_an_override_of_an_old_key_names_the_new_key():
    from lomo_ds.config.run import load_run_config

    overrides = {"lomo.bucket_size": 10, "lomo.recipes.sgd.lr": 0.1, "train.baseline_lr": 1e-4}
    with pytest.raises(ConfigError) as e:
        load_run_config({"model": {"path": "tiny-llama-in-memory"}}, overrides, check_files=False)
    assert str(e.value).splitlines() == ["<config>: override 'lomo.bucket_size': lomo.bucket_size moved to "
                                         "comm.bucket_size",
                                         "<config>: override 'lomo.recipes.sgd.lr': lomo.recipes.sgd.lr moved to "
                                         "lomo.presets.sgd.lr",
                                         "<config>: override 'train.baseline_lr': train.baseline_lr moved to train.lr"]
