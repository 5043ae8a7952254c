"""The engine's configuration: DeepSpeed's own keys plus a "lomo" section, validated on load.

The sections are frozen pydantic models: unknown keys, wrong types and out-of-range values are
refused, and nothing can change a validated config. Every problem is a `ConfigError` naming the
file, the key's full dotted path and what was expected, before any model memory is touched.
DeepSpeed's keys are checked against lomo_ds/config/ds_options.py: the ones LOMO replaces are copied
into the lomo section or refused.
"""
from __future__ import annotations

import contextlib
import copy
import difflib
import json
import os
import typing
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from lomo_ds.config import ds_options


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range; the message names the key."""


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


class ScheduleConfig(Section):
    """The learning-rate schedule: warm-up from 0, then constant or decaying to min_lr_ratio."""

    type: Literal["constant", "linear", "cosine"] = Field("constant", description="the shape after the warm-up")
    warmup_steps: Int = Field(0, ge=0, description="steps of linear warm-up from 0")
    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0, json_schema_extra=expects("a fraction in [0, 1)"),
                                description="warm-up as a fraction of the run's steps, used when warmup_steps is 0")
    total_steps: Int = Field(0, ge=0, description="the steps linear and cosine decay over; the trainer passes the "
                                                  "run's own, so only library users set it")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, json_schema_extra=expects("a fraction in [0, 1]"),
                                description="the learning rate at the end of the decay, as a fraction of lr")


class LossScaleConfig(Section):
    """Dynamic loss scaling. On by default with fp16; `enabled: true` forces it on in any
    precision (that is how the fp16 logic is tested on a CPU, where DeepSpeed refuses fp16)."""

    enabled: bool | None = Field(None, description="null: on with fp16 only; true or false forces it")
    initial_scale_power: Int = Field(16, ge=0, le=64, description="the first scale is 2 to this power")
    window: Int = Field(1000, ge=1, description="clean steps before the scale doubles")
    min_scale: float = Field(1.0, gt=0, description="the scale never halves below this")


class AdaLomoConfig(Section):
    """AdaLomo's update (lomo.optimizer "adalomo"): Adafactor's factored second moment and
    relative step, applied shard by shard like LOMO's SGD."""

    clip_threshold: float = Field(1.0, gt=0, description="the update's RMS is clipped to this")
    eps1: float = Field(1e-30, gt=0, description="added to the squared gradient")
    eps2: float = Field(1e-3, ge=0, description="floor of the parameter scale in the relative step")
    decay_rate: float = Field(-0.8, lt=0, description="second-moment decay: beta2 at step t is 1 - t**decay_rate")


class RecipeConfig(Section):
    """One update rule's tuned values (lomo.recipes.sgd, lomo.recipes.adalomo). When lomo.optimizer
    names the rule, each key given here fills the same key of the lomo section, unless the section
    sets that key itself (in the file or by --set): so a config that carries both recipes switches
    between LOMO and AdaLomo by lomo.optimizer alone, each with its own learning rate and clipping."""

    lr: float | None = Field(None, gt=0, json_schema_extra=expects("a positive learning rate"),
                             description="lomo.lr for this rule")
    clip_grad_norm: float | None = Field(None, gt=0, json_schema_extra=expects("a positive number or null"),
                                         description="lomo.clip_grad_norm for this rule (null: none)")
    clip_grad_value: float | None = Field(None, gt=0, json_schema_extra=expects("a positive number or null"),
                                          description="lomo.clip_grad_value for this rule (null: none)")
    weight_decay: float | None = Field(None, ge=0, description="lomo.weight_decay for this rule")
    scheduler: ScheduleConfig | None = Field(None, description="lomo.scheduler's keys for this rule (the keys given)")


class RecipesConfig(Section):
    """Per update rule, the values it runs with when lomo.optimizer names it (see RecipeConfig)."""

    sgd: RecipeConfig | None = Field(None, description="LOMO's (SGD's) values")
    adalomo: RecipeConfig | None = Field(None, description="AdaLomo's values")


# How gradient buckets are summed over ranks: the routes of lomo_ds/comm/grad.py.
GradReduction = Literal["auto", "reduce_scatter", "shared_memory", "all_reduce"]
# How ZeRO-3's parameter all-gathers are carried: lomo_ds/comm/param_gather.py.
ParamGather = Literal["auto", "shared_memory", "torch"]


class LomoConfig(Section):
    """The `lomo` section: LOMO's update, fused into the backward and applied to each rank's shard."""

    optimizer: Literal["sgd", "adalomo"] = Field("sgd", description="the update rule: SGD (the paper's LOMO) or "
                                                                    "AdaLomo (options under lomo.adalomo)")
    adalomo: AdaLomoConfig = AdaLomoConfig()
    recipes: RecipesConfig = RecipesConfig()
    lr: float = Field(1e-3, gt=0, json_schema_extra=expects("a positive learning rate"),
                      description="the learning rate (the schedule's peak)")
    clip_grad_norm: float | None = Field(None, gt=0, json_schema_extra=expects("a positive number or null"),
                                         description="clip the global L2 norm of the gradient to this; costs a "
                                                     "second backward pass (null: no norm clipping)")
    clip_grad_value: float | None = Field(None, gt=0, json_schema_extra=expects("a positive number or null"),
                                          description="clamp every gradient element to [-v, v]; free (null: none)")
    weight_decay: float = Field(0.0, ge=0, description="decoupled: p <- p - lr * (g + weight_decay * p)")
    scheduler: ScheduleConfig = ScheduleConfig()
    loss_scale: LossScaleConfig = LossScaleConfig()
    max_consecutive_skips: Int = Field(20, ge=1, description="skipped steps (non-finite loss or gradient) in a row "
                                                            "before the engine stops with an error")
    bucket_size: Int = Field(25_000_000, ge=1, description="gradient elements per reduce-scatter bucket")
    reduce_dtype: Literal["fp32", "fp16", "bf16"] | None = Field(None, description="dtype of the reduce-scatter "
                                                                                   "(null: the model's)")
    stochastic_rounding: bool = Field(True, description="round bf16 updates stochastically (bf16 shards without a "
                                                        "master copy)")
    fp32_master_weights: bool = Field(False, description="keep an fp32 copy of this rank's shard "
                                                         "(4 bytes / parameter / rank count)")
    grad_reduction: GradReduction = Field("auto", description=(
        "how gradient buckets are summed over ranks: auto = through shared memory for CPU ranks on one node "
        "(shared_memory), else the backend's overlapped reduce-scatter (reduce_scatter), and on one rank each "
        "gradient applied as it arrives; all_reduce: the reference code's way, twice the bytes (benchmarks only); "
        "a transport named on one rank runs as a one-rank collective"))
    param_gather: ParamGather = Field("auto", description=(
        "how ZeRO-3's parameter all-gathers travel, for LOMO and for the DeepSpeed baselines alike: auto = through "
        "shared memory for CPU ranks on one node (shared_memory), else torch.distributed's (torch); process-wide "
        "(the last engine built decides)"))
    two_pass_mode: Literal["retain_graph", "recompute"] = Field(
        "retain_graph", description="how norm clipping's second backward gets its graph: kept from the first, or "
                                    "recomputed by a second forward (less memory)")
    seed: Int = Field(1234, description="seed of the stochastic rounding")
    exclude_params: tuple[str, ...] = Field((), strict=False, description="fnmatch patterns of parameter names "
                                                                          "LOMO leaves alone (a list)")
    max_in_flight: Int = Field(1, ge=1, description="reduce-scatters outstanding at once (memory: one bucket's "
                                                    "payload and receive buffer each)")
    collective_timeout: float = Field(600.0, gt=0, description="seconds a collective may wait on a peer before the "
                                                               "run fails (NCCL's watchdog, gloo's timeout, the "
                                                               "shared-memory transport's); a dead peer is detected "
                                                               "sooner where it can be")
    host_update: Literal["auto", "thread", "inline"] = Field("auto", description=(
        "where the update of a shard in host memory (offload_param: cpu) runs: on a worker thread while the "
        "backward goes on, its slices copied without blocking into pinned buffers (thread), or in the gradient "
        "hook (inline); auto = thread on accelerators, inline on CPU ranks. With AdaLomo the thread applies "
        "the shard's update only: its statistics, per-bucket collectives and coefficients stay in the hook, "
        "on the device"))
    sparse_params: tuple[str, ...] = Field((), strict=False, description=(
        "fnmatch patterns of parameters that may get no gradient on some rank (mixture-of-experts experts): "
        "reduced at the end of the backward on every rank from the first step on (one found without a gradient "
        "in the first step is treated so from then on)"))
    update_chunk_elements: Int = Field(1 << 22, ge=1, description=(
        "elements of a shard slice updated at once (lomo_ds/engine/fused_update.py): the update's fp32 and "
        "rounding temporaries are bounded by this chunk (about 21 bytes an element for bf16), whatever the "
        "parameter's size; fp32 results are the same for every value"))
    chunked_loss: Literal["auto", "on", "off"] = Field("auto", description=(
        "the causal LM's loss as a linear + cross-entropy over chunks of positions (lomo_ds/engine/chunked_loss.py): "
        "no fp32 logits of every position at once. auto = on for the transformers families whose output head it "
        "knows, the model's own loss for the others; on = refuse a model it does not know; off = the model's own"))
    loss_chunk_logits: Int = Field(1 << 25, ge=1, description=(
        "logits (positions x vocabulary) the chunked loss computes at once: max(1, this // vocabulary) positions "
        "a chunk, so its memory (6 bytes a logit in bf16, 12 with Gemma-2's soft-capping) does not grow with the "
        "vocabulary"))
    # Gradient accumulation (lomo_ds/engine/accumulation.py).
    accumulation_steps: Int = Field(1, ge=1, description=(
        "micro-batches per optimizer step (DeepSpeed's gradient_accumulation_steps maps here): each rank sums "
        "its own reduced shards into an accumulator of 1/N of the model"))
    accumulate_dtype: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="dtype of the shard accumulator (fp16 runs the step as one pass after the last backward)")
    accumulate_on: Literal["device", "cpu"] = Field(
        "device", description="where the shard accumulator lives: beside the shards, or in pinned host memory")
    loss_normalization: Literal["mean", "tokens"] = Field("mean", description=(
        "how a step weighs its micro-batches: mean = each micro-batch's token mean, averaged over the window's "
        "micro-batches x ranks (DeepSpeed's); tokens = every label token of the window weighs the same"))

    @model_validator(mode="after")
    def _apply_recipe(self) -> LomoConfig:
        """The chosen rule's recipe fills the keys this section leaves out (RecipeConfig)."""
        recipe = getattr(self.recipes, self.optimizer)
        if recipe is None:
            return self
        given = self.model_fields_set
        update = {k: getattr(recipe, k) for k in recipe.model_fields_set - {"scheduler"} if k not in given}
        if recipe.scheduler is not None:
            mine = self.scheduler.model_dump(include=self.scheduler.model_fields_set) if "scheduler" in given else {}
            update["scheduler"] = ScheduleConfig.model_validate(
                {**recipe.scheduler.model_dump(include=recipe.scheduler.model_fields_set), **mine})
        if not update:
            return self
        # The filled keys stay "not given": a DeepSpeed key mapped onto them (gradient_clipping) is
        # the author's and wins, and the section dumped without defaults names only what was written.
        return type(self).model_construct(_fields_set=set(given), **{**dict(self), **update})

    def describe_update(self) -> str:
        """The update a run gets, for its first lines: the rule, its lr, clipping and schedule, and
        which of them the rule's recipe (lomo.recipes) filled in."""
        recipe = getattr(self.recipes, self.optimizer)
        filled = sorted((recipe.model_fields_set - {"scheduler"} if recipe is not None else set())
                        - self.model_fields_set)
        if recipe is not None and recipe.scheduler is not None:  # merged key by key: the recipe's values shown
            filled += [f"scheduler.{k}" for k in sorted(recipe.scheduler.model_fields_set)
                       if getattr(self.scheduler, k) == getattr(recipe.scheduler, k)]
        sch = self.scheduler
        warmup = f"{sch.warmup_steps} steps" if sch.warmup_steps else f"{sch.warmup_ratio:g}"
        def word(x):
            return "none" if x is None else f"{x:g}"

        text = (f"{'AdaLomo' if self.optimizer == 'adalomo' else 'LOMO (SGD)'}, lr {self.lr:g}, "
                f"clip_grad_norm {word(self.clip_grad_norm)}, clip_grad_value {word(self.clip_grad_value)}, "
                f"{sch.type} schedule, warm-up {warmup}")
        return text + (f" ({', '.join(filled)} from lomo.recipes.{self.optimizer})" if filled else "")


def options_markdown(cls: type[BaseModel] = None, prefix: str = "lomo") -> str:
    """Every option of a config section (default: the `lomo` section), nested sections included, as
    the Markdown table of ds_configs/README.md's "`lomo` options"."""
    cls = cls or LomoConfig
    rows = ["| key | type | default | what it does |", "|---|---|---|---|"] if prefix == "lomo" else []
    for name, field in cls.model_fields.items():
        key = f"{prefix}.{name}"
        sub = submodel(field.annotation)
        if sub is not None:
            rows.append(f"| `{key}` | section | | {' '.join(sub.__doc__.split())} |")
            rows.extend(options_markdown(sub, key).splitlines())
            continue
        default = json.dumps(list(field.default) if isinstance(field.default, tuple) else field.default)
        rows.append(f"| `{key}` | {_type_name(field.annotation)} | `{default}` | {field.description} |")
    return "\n".join(rows) + "\n"


def _type_name(annotation) -> str:
    choices = _literal_choices(annotation)
    if typing.get_origin(annotation) is tuple:
        return "list of strings"
    if choices:
        words = " \\| ".join(json.dumps(c) for c in choices)
    else:
        names = {int: "integer", float: "number", bool: "true/false", str: "string"}
        args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
        words = " or ".join(names.get(typing.get_args(a)[0] if typing.get_origin(a) is Annotated else a, str(a))
                            for a in args)
    return words + (" or null" if type(None) in typing.get_args(annotation) else "")


# ----------------------------------------------------------------------------- errors

def validated(cls: type[BaseModel], raw: Any, where: str = ""):
    """`cls` validated from `raw`; pydantic's first error becomes a ConfigError naming the dotted key
    (`where` is the prefix of every key) and what was expected (in the words of `explain`)."""
    try:
        return cls.model_validate(raw)
    except ValidationError as e:
        key, what = explain(cls, e.errors()[0])
        raise ConfigError(f"{_dotted(where, key)}: {what}") from None


def explain(cls: type[BaseModel], err: dict) -> tuple[str, str]:
    """(dotted key, what was expected) for one pydantic error of a `cls` validation: the one place
    pydantic's errors are put into this project's words."""
    loc, kind, ctx = err["loc"], err["type"], err.get("ctx") or {}
    got = "null" if err.get("input") is None else repr(err.get("input"))  # the file's word for None
    key = ".".join(str(p) if isinstance(p, str) else f"[{p}]" for p in loc).replace(".[", "[")
    field = _field_at(cls, loc)
    if kind == "missing":
        return key, "required"
    if kind == "extra_forbidden":
        return key, f"unknown key; expected some of {sorted(_model_at(cls, loc[:-1]).model_fields)}"
    if kind == "literal_error":
        choices = _literal_choices(field.annotation) if field is not None else ctx["expected"]
        return key, f"expected one of {choices}, got {got}"
    if kind in _BOUNDS:
        expected = (field.json_schema_extra or {}).get("expected") if field is not None else None
        if expected:
            return key, f"expected {expected}, got {got}"
        name, op = _BOUNDS[kind]
        bound = ctx[name]  # pydantic gives an int field's bound as an int, a float field's as a float
        number = "an integer" if isinstance(bound, int) else "a number"
        return key, f"expected {number} {op} {bound:g}, got {got}"
    if kind == "value_error":
        return key, str(ctx["error"])
    if kind == "string_too_short":
        return key, "expected a non-empty string"
    if kind == "too_short":
        return key, f"expected a list of at least {ctx['min_length']} item(s), got {got}"
    if kind in _TYPES:
        return key, f"expected {_TYPES[kind]}, got {got}"
    return key, f"{err['msg']}, got {got}"


_BOUNDS = {"greater_than": ("gt", ">"), "greater_than_equal": ("ge", ">="),
           "less_than": ("lt", "<"), "less_than_equal": ("le", "<=")}
_TYPES = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
          "string_type": "a string", "tuple_type": "a list of strings", "model_type": "an object"}


def _dotted(where: str, key: str) -> str:
    return f"{where}.{key}" if where and key else where or key


def submodel(annotation) -> type[BaseModel] | None:
    """The config section class an annotation holds (`X` or `X | None`), or None for a value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for m in map(submodel, typing.get_args(annotation)) if m is not None), None)


def _model_at(cls: type[BaseModel] | None, loc) -> type[BaseModel] | None:
    for part in loc:
        if cls is None or part not in cls.model_fields:
            return None
        cls = submodel(cls.model_fields[part].annotation)
    return cls


def _field_at(cls, loc):
    owner = _model_at(cls, loc[:-1]) if loc else None
    return owner.model_fields.get(loc[-1]) if owner is not None and isinstance(loc[-1], str) else None


def _literal_choices(annotation) -> list:
    if typing.get_origin(annotation) is Literal:
        return list(typing.get_args(annotation))
    return [c for arg in typing.get_args(annotation) for c in _literal_choices(arg)]


@contextlib.contextmanager
def errors_in(src: str):
    """Prefix the ConfigErrors raised inside with the config's name (its file)."""
    try:
        yield
    except ConfigError as e:
        if str(e).startswith(f"{src}: "):
            raise
        raise ConfigError(f"{src}: {e}") from None


# ----------------------------------------------------------------------------- files

def read_config_file(path: str | os.PathLike) -> dict:
    """A config file's top-level object: YAML for .yaml/.yml, JSON otherwise; or a ConfigError
    naming the file and what is wrong with it."""
    path = os.fspath(path)
    fmt = "YAML" if path.endswith((".yaml", ".yml")) else "JSON"
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) if fmt == "YAML" else json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, expected a JSON or YAML file") from None
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: not valid {fmt} ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a {fmt} object at the top level, got {type(raw).__name__}")
    return raw


def load_config(config: dict | str | os.PathLike) -> tuple[dict, LomoConfig]:
    """Split a config (dict, or a JSON/YAML path) into DeepSpeed's dict and the validated LOMO section."""
    if isinstance(config, (str, os.PathLike)):
        src, raw = os.fspath(config), read_config_file(config)
    elif isinstance(config, dict):
        src, raw = "<config>", copy.deepcopy(config)
    else:
        raise ConfigError(f"config: expected a dict or a path to a JSON/YAML file, got {type(config).__name__}")
    with errors_in(src):
        lomo = validated(LomoConfig, raw.pop("lomo", None) or {}, "lomo")
        return validate_deepspeed_section(raw, lomo)


# ----------------------------------------------------------------------------- DeepSpeed's keys

def validate_deepspeed_section(ds: dict, lomo: LomoConfig, lomo_method: bool = True) -> tuple[dict, LomoConfig]:
    """Check DeepSpeed's keys against the option table and copy the mapped ones into `lomo`.

    `ds` gets DeepSpeed's defaults filled in. lomo_method: whether LOMO does the update (the
    baselines use DeepSpeed's optimizer, for which only the rows marked all_methods are refused).
    Returns (ds, lomo with the mapped values)."""
    for name in ("fp16", "bf16", "zero_optimization"):
        if name in ds and not isinstance(ds[name], dict):
            raise ConfigError(f"{name}: expected an object, got {ds[name]!r}")
    for key, value in _deepspeed_values(ds):
        row = ds_options.option(key)
        if row is None:
            # The table lists every top-level and zero_optimization key DeepSpeed knows.
            if "." not in key or key.startswith("zero_optimization."):
                raise ConfigError(f"{key}: unknown key{_did_you_mean(key)}")
        elif row.refuses(value) and (lomo_method or row.all_methods):
            raise ConfigError(f"{key}: {row.reason}" + (f", got {value!r}" if row.accepts else ""))
    from lomo_ds.config import leaf_module  # it reads ConfigError from here

    leaf_module.check_value(ds.get("zero_optimization", {}).get("leaf_module"))
    if ds.get("fp16", {}).get("enabled", False) and ds.get("bf16", {}).get("enabled", False):
        raise ConfigError("fp16.enabled and bf16.enabled: choose one precision")
    ds.setdefault("zero_optimization", {}).setdefault("stage", 3)
    ds.setdefault("train_micro_batch_size_per_gpu", 1)
    ds.pop("train_batch_size", None)  # derived by DeepSpeed from the micro batch, accumulation and world size
    mb = ds["train_micro_batch_size_per_gpu"]
    if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
        raise ConfigError(f"train_micro_batch_size_per_gpu: expected a positive integer, got {mb!r}")
    lomo = _with_mapped(ds, lomo)
    # One accumulation count for the whole run: the baselines' DeepSpeed optimizer reads it from
    # here, LOMO from lomo.accumulation_steps (set from either key).
    ds["gradient_accumulation_steps"] = lomo.accumulation_steps
    return ds, lomo


def _deepspeed_values(ds: dict):
    """(dotted key, value) of every key the option table may have a row for."""
    for key, value in ds.items():
        yield key, value
        if key in ("fp16", "bf16", "zero_optimization"):
            for sub, sub_value in value.items():
                yield f"{key}.{sub}", sub_value
    offload = ds.get("zero_optimization", {}).get("offload_param")
    if offload is not None:
        if not isinstance(offload, dict):
            raise ConfigError(f"zero_optimization.offload_param: expected an object, got {offload!r}")
        for sub, sub_value in offload.items():
            key = f"zero_optimization.offload_param.{sub}"
            if ds_options.option(key) is None:
                raise ConfigError(f"{key}: unknown key{_did_you_mean(key)}")
            yield key, sub_value


def _did_you_mean(key: str) -> str:
    parent = key.rpartition(".")[0]
    known = [o.key for o in ds_options.OPTIONS if o.key.rpartition(".")[0] == parent]
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
    return f"; did you mean {near[0].rpartition('.')[2]!r}?" if near else ""


def _with_mapped(ds: dict, lomo: LomoConfig) -> LomoConfig:
    """`lomo` with the values of the mapped DeepSpeed keys; an error when both sides set a key and differ."""
    mapped = {}  # lomo dotted key -> (value, DeepSpeed key)
    for row in ds_options.OPTIONS:
        if row.status != ds_options.MAPPED:
            continue
        parent, _, name = row.key.rpartition(".")
        node = ds.get(parent, {}) if parent else ds
        if name not in node:
            continue
        value = row.to_lomo(node[name]) if row.to_lomo else node[name]
        current = _lomo_value(lomo, row.lomo)
        if _is_set(lomo, row.lomo) and current != value:
            raise ConfigError(f"{row.key} ({node[name]!r}) and lomo.{row.lomo} ({current!r}) disagree; "
                              "set only one of them")
        mapped[row.lomo] = (value, row.key)
    if not mapped:
        return lomo
    # Only the keys given, plus the mapped ones: what the author left out stays left out (a rule's
    # recipe fills it again, and describe_update can say so).
    data = lomo.model_dump(exclude_unset=True)
    for lomo_key, (value, _) in mapped.items():
        *parents, name = lomo_key.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        node[name] = value
    try:
        return LomoConfig.model_validate(data)
    except ValidationError as e:
        key, what = explain(LomoConfig, e.errors()[0])
        raise ConfigError(f"{mapped[key][1]} (LOMO's lomo.{key}): {what}") from None


def _lomo_value(lomo: LomoConfig, dotted: str):
    value: Any = lomo
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _is_set(lomo: LomoConfig, dotted: str) -> bool:
    """Whether the user's lomo section gave `dotted` (not just its default)."""
    section: BaseModel = lomo
    *parents, name = dotted.split(".")
    for part in parents:
        if part not in section.model_fields_set:
            return False
        section = getattr(section, part)
    return name in section.model_fields_set


class Precision(Section):
    """The model's precision, read once from DeepSpeed's fp16/bf16 sections where the config enters
    (the engine and the model loader take this, not the DeepSpeed dict)."""

    dtype: Literal["fp32", "fp16", "bf16"] = "fp32"

    @classmethod
    def of(cls, ds_config: dict) -> "Precision":
        for name in ("fp16", "bf16"):
            if ds_config.get(name, {}).get("enabled"):
                return cls(dtype=name)
        return cls()

    @property
    def torch_dtype(self):
        import torch

        return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[self.dtype]
