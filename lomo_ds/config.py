"""The engine's configuration: DeepSpeed's own keys plus a "lomo" section, validated on load.

Every problem is reported with the key's full path and what was expected, before any model
memory is touched.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range; the message names the key."""


@dataclass
class ScheduleConfig:
    type: str = "constant"  # constant | linear | cosine
    warmup_steps: int = 0
    warmup_ratio: float = 0.0  # of total_steps; used when warmup_steps is 0
    total_steps: int = 0  # required for linear/cosine; the trainer fills it in from the data
    min_lr_ratio: float = 0.0


@dataclass
class LossScaleConfig:
    """Dynamic loss scaling. On by default with fp16; `enabled: true` forces it on in any
    precision (that is how the fp16 logic is tested on a CPU, where DeepSpeed refuses fp16)."""

    enabled: bool | None = None
    initial_scale_power: int = 16
    window: int = 1000
    min_scale: float = 1.0


@dataclass
class AdaLomoConfig:
    """AdaLomo's constants (arXiv 2310.10195; lomo_ds/adalomo.py)."""

    clip_threshold: float = 1.0  # the update is scaled down to RMS <= this
    eps1: float = 1e-30  # added to g^2 in the second moments
    eps2: float = 1e-3  # floor of RMS(param) in the relative step size
    decay_rate: float = -0.8  # beta2_t = 1 - t^decay_rate


@dataclass
class LomoConfig:
    lr: float = 1e-3
    clip_grad_norm: float | None = None  # global L2 norm; costs a second backward pass
    clip_grad_value: float | None = None  # elementwise clamp; free
    weight_decay: float = 0.0  # decoupled: p <- p - lr * (g + wd * p)
    scheduler: ScheduleConfig = field(default_factory=ScheduleConfig)
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    bucket_size: int = 25_000_000  # gradient elements per reduce-scatter bucket
    reduce_dtype: str | None = None  # dtype of the gradient reduce-scatter; default: the model's
    stochastic_rounding: bool = True  # bf16 shards without a master copy
    fp32_master_weights: bool = False  # keep an fp32 copy of this rank's shard (4 bytes/param/world)
    grad_reduction: str = "reduce_scatter"  # reduce_scatter | all_reduce (the reference code's way; benchmarks only)
    two_pass_mode: str = "retain_graph"  # retain_graph | recompute: how the second backward gets its graph
    seed: int = 1234  # for stochastic rounding
    exclude_params: list = field(default_factory=list)  # fnmatch patterns of parameter names LOMO leaves alone
    optimizer: str = "sgd"  # sgd (LOMO) | adalomo
    adalomo: AdaLomoConfig = field(default_factory=AdaLomoConfig)
    max_consecutive_skips: int = 20  # the engine gives up after this many skipped steps in a row


_OPTIMIZERS = ("sgd", "adalomo")
_SCHEDULE_TYPES = ("constant", "linear", "cosine")
_TWO_PASS_MODES = ("retain_graph", "recompute")
_REDUCE_DTYPES = (None, "fp32", "fp16", "bf16")


def build_dataclass(cls, raw: Any, where: str):
    """Build dataclass `cls` from dict `raw`: unknown keys, missing required fields and wrong
    types are rejected with the dotted key (`where.name`) and what was expected."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected an object, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown key; expected some of {sorted(fields)}")
    kwargs = {}
    for f in fields.values():
        key = f"{where}.{f.name}"
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        if f.name not in raw:
            if not has_default:
                raise ConfigError(f"{key}: required ({f.type})")
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            kwargs[f.name] = build_dataclass(type(default), raw[f.name], key)
        else:
            kwargs[f.name] = _coerce(raw[f.name], f.type, key)
    return cls(**kwargs)


def _coerce(value: Any, type_name: Any, key: str):
    type_name = str(type_name).replace(" ", "")
    optional = "None" in type_name
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{key}: must not be null")
    base = type_name.replace("|None", "")
    if base == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if base == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if base == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if base == "list":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key}: expected a list of strings, got {value!r}")
        return value
    if base == "str":
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    return value


def validate_lomo(cfg: LomoConfig, where: str = "lomo") -> LomoConfig:
    if not cfg.lr > 0:
        raise ConfigError(f"{where}.lr: expected a positive learning rate, got {cfg.lr}")
    for name in ("clip_grad_norm", "clip_grad_value"):
        v = getattr(cfg, name)
        if v is not None and not v > 0:
            raise ConfigError(f"{where}.{name}: expected a positive number or null, got {v}")
    if cfg.weight_decay < 0:
        raise ConfigError(f"{where}.weight_decay: expected >= 0, got {cfg.weight_decay}")
    if cfg.bucket_size < 1:
        raise ConfigError(f"{where}.bucket_size: expected a positive element count, got {cfg.bucket_size}")
    if cfg.reduce_dtype not in _REDUCE_DTYPES:
        raise ConfigError(f"{where}.reduce_dtype: expected one of {list(_REDUCE_DTYPES)}, got {cfg.reduce_dtype!r}")
    if cfg.two_pass_mode not in _TWO_PASS_MODES:
        raise ConfigError(f"{where}.two_pass_mode: expected one of {list(_TWO_PASS_MODES)}, got {cfg.two_pass_mode!r}")
    if cfg.grad_reduction not in ("reduce_scatter", "all_reduce"):
        raise ConfigError(f"{where}.grad_reduction: expected 'reduce_scatter' or 'all_reduce', got {cfg.grad_reduction!r}")
    if cfg.optimizer not in _OPTIMIZERS:
        raise ConfigError(f"{where}.optimizer: expected one of {list(_OPTIMIZERS)}, got {cfg.optimizer!r}")
    a = cfg.adalomo
    if not a.clip_threshold > 0:
        raise ConfigError(f"{where}.adalomo.clip_threshold: expected a positive number, got {a.clip_threshold}")
    for name in ("eps1", "eps2"):
        if not getattr(a, name) >= 0:
            raise ConfigError(f"{where}.adalomo.{name}: expected >= 0, got {getattr(a, name)}")
    if not a.decay_rate < 0:
        raise ConfigError(f"{where}.adalomo.decay_rate: expected a negative exponent (beta2_t = 1 - t^decay_rate), "
                          f"got {a.decay_rate}")
    if cfg.max_consecutive_skips < 1:
        raise ConfigError(f"{where}.max_consecutive_skips: expected >= 1, got {cfg.max_consecutive_skips}")
    s = cfg.scheduler
    if s.type not in _SCHEDULE_TYPES:
        raise ConfigError(f"{where}.scheduler.type: expected one of {list(_SCHEDULE_TYPES)}, got {s.type!r}")
    if s.warmup_steps < 0:
        raise ConfigError(f"{where}.scheduler.warmup_steps: expected >= 0, got {s.warmup_steps}")
    if not 0.0 <= s.warmup_ratio < 1.0:
        raise ConfigError(f"{where}.scheduler.warmup_ratio: expected a fraction in [0, 1), got {s.warmup_ratio}")
    if s.total_steps < 0:
        raise ConfigError(f"{where}.scheduler.total_steps: expected >= 0, got {s.total_steps}")
    if not 0.0 <= s.min_lr_ratio <= 1.0:
        raise ConfigError(f"{where}.scheduler.min_lr_ratio: expected a fraction in [0, 1], got {s.min_lr_ratio}")
    ls = cfg.loss_scale
    if ls.window < 1:
        raise ConfigError(f"{where}.loss_scale.window: expected a positive step count, got {ls.window}")
    if not 0 <= ls.initial_scale_power <= 64:
        raise ConfigError(f"{where}.loss_scale.initial_scale_power: expected 0..64, got {ls.initial_scale_power}")
    return cfg


def parse_lomo_section(raw: Any, where: str = "lomo") -> LomoConfig:
    return validate_lomo(build_dataclass(LomoConfig, raw, where), where)


def read_json_config(path: str | os.PathLike) -> Any:
    """A config file's JSON, or a ConfigError naming the file and what is wrong with it."""
    path = os.fspath(path)
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, expected a JSON file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


def load_config(config: dict | str | os.PathLike) -> tuple[dict, LomoConfig]:
    """Split a config (dict or JSON path) into DeepSpeed's dict and the validated LOMO section."""
    if isinstance(config, (str, os.PathLike)):
        raw = read_json_config(config)
    elif isinstance(config, dict):
        raw = copy.deepcopy(config)
    else:
        raise ConfigError(f"config: expected a dict or a path to a JSON file, got {type(config).__name__}")
    lomo = parse_lomo_section(raw.pop("lomo", {}))
    ds_config = validate_deepspeed_section(raw)
    return ds_config, lomo


def validate_deepspeed_section(ds: dict) -> dict:
    """Check the DeepSpeed keys LOMO depends on; everything else is DeepSpeed's to judge."""
    if "optimizer" in ds:
        raise ConfigError("optimizer: LOMO is the optimizer; remove the DeepSpeed 'optimizer' section "
                          "(use the 'lomo' section for lr, clipping and weight decay)")
    if "scheduler" in ds:
        raise ConfigError("scheduler: use lomo.scheduler; a DeepSpeed scheduler needs a DeepSpeed optimizer")
    zero = ds.setdefault("zero_optimization", {"stage": 3})
    if not isinstance(zero, dict) or zero.get("stage", 3) != 3:
        raise ConfigError(f"zero_optimization.stage: LOMO runs on ZeRO stage 3, got {zero.get('stage') if isinstance(zero, dict) else zero!r}")
    zero["stage"] = 3
    for k in ("offload_optimizer",):
        if zero.get(k):
            raise ConfigError(f"zero_optimization.{k}: there is no optimizer state to offload under LOMO")
    if ds.get("gradient_accumulation_steps", 1) != 1:
        raise ConfigError("gradient_accumulation_steps: LOMO applies each gradient as it is produced; expected 1")
    fp16 = ds.get("fp16", {}).get("enabled", False)
    bf16 = ds.get("bf16", {}).get("enabled", False)
    if fp16 and bf16:
        raise ConfigError("fp16.enabled and bf16.enabled: choose one precision")
    ds.setdefault("train_micro_batch_size_per_gpu", 1)
    ds.setdefault("gradient_accumulation_steps", 1)
    ds.pop("train_batch_size", None)  # derived by DeepSpeed from the two above and the world size
    return ds


def model_dtype(ds_config: dict):
    import torch

    if ds_config.get("fp16", {}).get("enabled"):
        return torch.float16
    if ds_config.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    return torch.float32
