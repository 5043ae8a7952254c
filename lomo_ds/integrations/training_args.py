"""Every TrainingArguments field that touches optimization, precision, checkpointing or logging:
supported as the Trainer does it, mapped onto a config key (lomo.*, train.*), or refused with the reason.

`check_training_arguments(args)` is what LomoTrainerMixin runs in its constructor, before the
Trainer builds anything; scripts can call it on their TrainingArguments first. A refusal is one
`TrainingArgumentsError` line naming the field, what it was given and why. `mapped_values(args, ...)`
gives the values the mapped fields set, by config key; a value the DeepSpeed config's own sections
set differently is refused too (one place decides each value). The table in
docs/training_arguments.md is generated from FIELDS (`options_markdown()`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from lomo_ds.config import rules

SUPPORTED, MAPPED, REFUSED = "supported", "mapped", "refused"

# The Trainer classes the mixin has been tested with (by class name and defining package).
TESTED_TRAINERS = {("transformers", "Trainer"), ("trl", "SFTTrainer")}
# Library trainers that need more than the mixin: tested through lomo_ds's own subclass only.
THROUGH_SUBCLASS = {("trl", "DPOTrainer"): "lomo_ds.integrations.dpo.LomoDPOTrainer",
                    ("trl", "GRPOTrainer"): "lomo_ds.integrations.grpo.LomoGRPOTrainer"}
# optim="lomo": the update rule the deepspeed config's lomo.optimizer names (sgd where it names none),
# so a Trainer user picks any registered rule (config/rules.py) with optim="lomo" and that key. The
# other accepted values are shortcuts the rules are registered with (optim="adalomo").
BY_CONFIG = "lomo"


def optim_names() -> list[str]:
    """The `optim` values accepted: "lomo" and each registered rule's own (config/rules.py)."""
    return [BY_CONFIG] + [name for spec in rules.specs() for name in spec.optim]


def rule_of_optim(value) -> str | None:
    """The rule an `optim` value chooses by name; None for "lomo" (the config's lomo.optimizer decides)."""
    value = _str(value)
    spec = rules.by_optim(value)
    return spec.name if spec is not None else None


def optim_choices() -> str:
    """The accepted `optim` values in words: 'lomo' or 'adalomo'."""
    shown = [repr(name) for name in optim_names()]
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"


class TrainingArgumentsError(ValueError):
    """A TrainingArguments value LOMO cannot honour; the message names the field."""


@dataclass(frozen=True)
class Field:
    name: str
    status: str  # SUPPORTED | MAPPED | REFUSED
    what: str  # what it does under LOMO, or why it is refused
    refuses: Callable[[Any], bool] = lambda value: False  # which values are refused
    maps_to: str | None = None  # MAPPED: the dotted config key it sets


def _unless(*accepted):
    return lambda value: value not in accepted


def _str(value) -> str:
    return getattr(value, "value", value)  # the enums TrainingArguments stores (optim, strategies)


def accelerator_name() -> str:
    """The device DeepSpeed's accelerator trains on in this process: `cpu` on a machine without an
    accelerator (or where none is visible), which is what lomo_ds's CPU ranks run on."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name()


# With no GPU visible, torch and DeepSpeed see the machine as one without an accelerator: the CPU
# path the tests run (devkit/launch_local.py launches CPU ranks so).
_USE_CPU_INSTEAD = ("launch with CUDA_VISIBLE_DEVICES= (empty) in every rank's environment, so that DeepSpeed "
                    "picks its CPU accelerator (gloo)")


_NOT_ADAMW = "an AdamW setting; LOMO and AdaLomo keep no moments (AdaLomo's own: the config's lomo.adalomo)"

FIELDS: list[Field] = [
    # ------------------------------------------------------------------ optimization
    Field("optim", MAPPED, "`lomo`: the rule the config's lomo.optimizer names (default `sgd`, any registered "
                           "rule: docs/rules.md); `adalomo` -> lomo.optimizer `adalomo`; any other optimizer is "
                           "refused", lambda v: _str(v) not in optim_names(), maps_to="lomo.optimizer"),
    Field("optim_args", REFUSED, "options of other optimizers; a rule's own are the config's lomo.<its key> "
                                 "(AdaLomo's: lomo.adalomo)",
          _unless(None, "")),
    Field("optim_target_modules", REFUSED, "GaLore/APOLLO's; LOMO updates every trainable parameter",
          _unless(None)),
    Field("learning_rate", MAPPED, "the peak of the Trainer's schedule; the fused update of every step uses the "
                                   "schedule's value for that step (lomo.lr and train.scheduler are not used)",
          maps_to="lomo.lr"),
    Field("lr_scheduler_type", SUPPORTED, "the Trainer's scheduler runs on a stand-in optimizer; its learning "
                                          "rate goes into each step's fused update"),
    Field("lr_scheduler_kwargs", SUPPORTED, "as the Trainer"),
    Field("warmup_steps", SUPPORTED, "as the Trainer (a value below 1 is a fraction of the steps)"),
    Field("weight_decay", REFUSED, "the Trainer decays all but biases and norms; lomo_ds's decoupled decay "
                                   "(lomo.weight_decay in the config's lomo section) decays every parameter: "
                                   "set that instead and leave this 0", _unless(0, 0.0)),
    Field("adam_beta1", REFUSED, _NOT_ADAMW, _unless(0.9)),
    Field("adam_beta2", REFUSED, _NOT_ADAMW, _unless(0.999)),
    Field("adam_epsilon", REFUSED, _NOT_ADAMW, _unless(1e-8)),
    Field("max_grad_norm", MAPPED, "exact global-norm clipping of the window's gradient (train.clip_grad_norm); "
                                   "0 = no clipping. The default 1.0 turns it on, and with gradient_accumulation_steps "
                                   "1 that costs a second backward over the retained graph (never a second "
                                   "forward or compute_loss); with K > 1 it is one pass over the accumulated shards",
          lambda v: v < 0, maps_to="train.clip_grad_norm"),
    Field("gradient_accumulation_steps", MAPPED, "the sharded accumulator (train.accumulation_steps): each rank "
                                                 "sums its 1/N slice of each micro-batch's reduced gradient",
          maps_to="train.accumulation_steps"),
    Field("average_tokens_across_devices", MAPPED, "true (the default): the Trainer's loss, a token mean over the "
                                                   "window and every rank (num_items_in_batch) times the rank count, "
                                                   "is train.loss_normalization `tokens`, applied once (a model whose "
                                                   "loss takes no num_items_in_batch: `mean`). false (each rank's "
                                                   "own token mean) is refused: no lomo_ds normalisation matches it",
          _unless(True), maps_to="train.loss_normalization"),
    Field("label_smoothing_factor", SUPPORTED, "part of the Trainer's loss, which the engine back-propagates "
                                               "(not covered by the tests)"),
    Field("auto_find_batch_size", REFUSED, "retries with a smaller batch by rebuilding the DeepSpeed engine; "
                                           "size the batch with `lomo-ds plan`", _unless(False)),
    Field("torch_compile", REFUSED, "not tested with the fused gradient hooks", _unless(False)),
    Field("use_liger_kernel", REFUSED, "not tested with the fused gradient hooks", _unless(False)),
    Field("neftune_noise_alpha", REFUSED, "not tested with the fused update", _unless(None)),
    Field("fsdp", REFUSED, "LOMO runs on DeepSpeed ZeRO-3 (the deepspeed argument)", lambda v: bool(v)),
    Field("parallelism_config", MAPPED, "accelerate's ParallelismConfig: `sp_size` with `sp_backend` 'deepspeed' -> "
                                        "train.sequence_parallel_size (Ulysses attention; the Trainer's batches "
                                        "split by DeepSpeed's UlyssesSPDataLoaderAdapter, the loss lomo_ds's own); "
                                        "tp_size, cp_size and dp_shard_size above 1 are refused (ZeRO-3 is the "
                                        "sharding; no tensor or context parallelism), and so is sp_size with a "
                                        "trainer that computes its own loss (SFTTrainer, DPO, compute_loss_func)",
          lambda v: parallelism_refusal(v) is not None, maps_to="train.sequence_parallel_size"),
    Field("deepspeed", MAPPED, "required: a DeepSpeed ZeRO-3 config (dict or file) whose optional `lomo`, `comm`, "
                               "`memory` and `train` sections hold LOMO's other options; checked like lomo_ds's "
                               "own configs",
          lambda v: v is None),
    Field("use_cpu", MAPPED, "true: the ranks train on DeepSpeed's CPU accelerator (gloo), which DeepSpeed picks on a "
                             "machine without an accelerator: there the same run as false, but transformers allows "
                             "bf16 on a CPU only with it. Refused where DeepSpeed's accelerator is a GPU (the ranks "
                             f"would train on it whatever use_cpu says): to train on the CPU, {_USE_CPU_INSTEAD}; "
                             "else leave it false",
          lambda v: bool(v) and accelerator_name() != "cpu"),
    # ------------------------------------------------------------------ precision
    Field("bf16", MAPPED, "the DeepSpeed config's bf16.enabled (`auto` is filled from it): bf16 shards, gathers "
                          "and reduce-scatter"),
    Field("fp16", MAPPED, "the DeepSpeed config's fp16.enabled: lomo_ds's dynamic loss scaling (lomo.loss_scale; "
                          "two passes at K = 1); accelerators only (DeepSpeed refuses fp16 on a CPU)"),
    Field("seed", MAPPED, "seeds the Trainer's own RNG as usual (set_seed: the model's initialisation, dropout, "
                          "the data order) and is train.seed, which keys the engine's stochastic-rounding noise "
                          "(bf16 shards, memory.int8_shards): runs at different seeds round differently",
          maps_to="train.seed"),
    Field("bf16_full_eval", REFUSED, "evaluation runs in the training precision", _unless(False)),
    Field("fp16_full_eval", REFUSED, "evaluation runs in the training precision", _unless(False)),
    Field("tf32", SUPPORTED, "a matmul setting of Ampere+ GPUs; the update is unaffected"),
    Field("gradient_checkpointing", SUPPORTED, "the Trainer enables it on the model; the layers' activations "
                                               "are recomputed in the backward (tested with SFTTrainer, whose "
                                               "default it is, at K = 2; norm clipping's two passes at K = 1 "
                                               "recompute in both, not covered by the tests)"),
    Field("gradient_checkpointing_kwargs", SUPPORTED, "as the Trainer"),
    Field("activation_checkpointing", SUPPORTED, "as gradient_checkpointing"),
    Field("activation_checkpointing_kwargs", SUPPORTED, "as the Trainer"),
    Field("torch_empty_cache_steps", SUPPORTED, "as the Trainer: the device cache emptied every N steps"),
    # ------------------------------------------------------------------ checkpointing
    Field("save_strategy", SUPPORTED, "a checkpoint holds the model as save_model writes it, the engine's "
                                      "state (engine_state/: the shards, step, AdaLomo's state; resumable on "
                                      "any rank count), the scheduler, RNG and Trainer state"),
    Field("save_steps", SUPPORTED, "as the Trainer"),
    Field("save_total_limit", SUPPORTED, "the Trainer's rotation of checkpoint folders"),
    Field("save_only_model", SUPPORTED, "no shard state is written: such a checkpoint loads with from_pretrained "
                                        "but cannot be resumed from"),
    Field("save_on_each_node", SUPPORTED, "for nodes that share no storage: the first rank of every node (the "
                                          "Trainer's should_save) makes the checkpoint folder on its node's disk and "
                                          "writes the whole model, the scheduler and the Trainer state there; every "
                                          "rank writes its own shard state and RNG beside them, so each node resumes "
                                          "from its own folder"),
    Field("resume_from_checkpoint", SUPPORTED, "exact: the same parameters as an uninterrupted run (shards, "
                                               "schedule, data order and RNG restored); on another rank count the "
                                               "shards are cut again (docs/cluster.md)"),
    Field("enable_jit_checkpoint", MAPPED, "on SIGTERM or SIGUSR1 every rank finishes the optimizer step it is in "
                                           "(the window: the accumulator is not part of a checkpoint), the ranks "
                                           "agree, the Trainer saves its checkpoint and the process exits 75; a "
                                           "second signal exits 76 at once, the last whole checkpoint kept "
                                           "(transformers' own saves mid-window)"),
    Field("load_best_model_at_end", REFUSED, "reloads through DeepSpeed's checkpoint loader, which LOMO's "
                                             "checkpoints are not; load the best checkpoint with from_pretrained",
          _unless(False)),
    Field("ignore_data_skip", SUPPORTED, "as the Trainer (true makes a resumed run differ from an uninterrupted one)"),
    Field("restore_callback_states_from_checkpoint", SUPPORTED, "as the Trainer"),
    Field("push_to_hub", SUPPORTED, "the Trainer uploads the folders save_model writes (not exercised by the tests: "
                                    "no network)"),
    # ------------------------------------------------------------------ logging and evaluation
    Field("report_to", SUPPORTED, "every tracker gets `loss` (the engine's window loss, agreed over the ranks), "
                                  "`learning_rate` (the lr of the update) and `grad_norm` (the engine's exact global "
                                  "norm; absent when max_grad_norm is 0: no norm is measured) through Trainer.log"),
    Field("logging_strategy", SUPPORTED, "as the Trainer"),
    Field("logging_steps", SUPPORTED, "as the Trainer"),
    Field("logging_first_step", SUPPORTED, "as the Trainer"),
    Field("logging_nan_inf_filter", SUPPORTED, "as the Trainer (a step every rank skipped reports NaN)"),
    Field("include_num_input_tokens_seen", SUPPORTED, "as the Trainer"),
    Field("run_name", SUPPORTED, "as the Trainer"),
    Field("project", SUPPORTED, "as the Trainer"),
    Field("eval_strategy", SUPPORTED, "evaluation forwards through the ZeRO-3 module, no update; only once "
                                      "training has built the engine (see eval_on_start)"),
    Field("eval_steps", SUPPORTED, "as the Trainer"),
    Field("eval_on_start", REFUSED, "before the first step the Trainer would build a DeepSpeed engine of its own "
                                    "for evaluation; evaluate after a step instead", _unless(False)),
    Field("prediction_loss_only", SUPPORTED, "as the Trainer"),
    Field("per_device_eval_batch_size", SUPPORTED, "as the Trainer"),
    Field("skip_memory_metrics", SUPPORTED, "as the Trainer"),
]
BY_NAME = {f.name: f for f in FIELDS}


def check_trainer_class(cls: type) -> None:
    """Refuse a trainer lomo_ds has not been tested inside: the nearest library trainer class in
    `cls`'s bases (a user's own subclass of a tested one is fine) must be Trainer or SFTTrainer."""
    for base in cls.__mro__:
        package = base.__module__.split(".", 1)[0]
        if package in ("transformers", "trl") and base.__name__.endswith("Trainer"):
            through = THROUGH_SUBCLASS.get((package, base.__name__))
            if through is not None:
                if any(f"{c.__module__}.{c.__qualname__}" == through for c in cls.__mro__):
                    return
                raise TrainingArgumentsError(
                    f"{base.__name__}: LomoTrainerMixin is tested with {package}'s {base.__name__} only through "
                    f"{through} (mix that in, or subclass it)")
            if (package, base.__name__) not in TESTED_TRAINERS:
                raise TrainingArgumentsError(
                    f"{base.__name__}: LomoTrainerMixin is tested with transformers' Trainer and TRL's SFTTrainer "
                    f"only, not {package}'s {base.__name__}")
            return
    raise TrainingArgumentsError(f"{cls.__name__}: LomoTrainerMixin must be mixed into a Trainer or SFTTrainer")


def check_training_arguments(args) -> None:
    """Refuse (TrainingArgumentsError naming the field) any value LOMO cannot honour."""
    if args is None:
        raise TrainingArgumentsError(f"args: pass TrainingArguments(optim={optim_choices()}, deepspeed=...)")
    for f in FIELDS:
        if not hasattr(args, f.name):
            continue  # a field this transformers release does not have
        value = getattr(args, f.name)
        if f.refuses(value):
            shown = _str(value)
            if f.name == "optim":
                raise TrainingArgumentsError(f"optim: expected {optim_choices()}, got {shown!r}")
            if f.name == "deepspeed":
                raise TrainingArgumentsError("deepspeed: required; give a DeepSpeed ZeRO-3 config (dict or file), "
                                             "which may carry a `lomo` section")
            if f.name == "use_cpu":
                device = accelerator_name()
                raise TrainingArgumentsError(f"use_cpu: expected False where DeepSpeed's accelerator is {device!r} "
                                             f"(got True; the ranks would train on {device} anyway): to train on the "
                                             f"CPU, {_USE_CPU_INSTEAD}; to train on {device}, set use_cpu=False")
            if f.name == "parallelism_config":
                raise TrainingArgumentsError(parallelism_refusal(value))
            raise TrainingArgumentsError(f"{f.name}: {f.what} (got {shown!r})")


def parallelism_refusal(pc) -> str | None:
    """Why a ParallelismConfig cannot be honoured (naming its field), or None."""
    if pc is None:
        return None
    for name, why in (("tp_size", "tensor parallelism is not supported"),
                      ("cp_size", "context parallelism other than Ulysses (sp_size) is not supported"),
                      ("dp_shard_size", "ZeRO-3 (the deepspeed config) already shards every parameter over "
                                        "the ranks")):
        size = getattr(pc, name, 1) or 1
        if size > 1:
            return f"parallelism_config.{name}: {why} (got {size})"
    sp_size = getattr(pc, "sp_size", 1) or 1
    backend = getattr(pc, "sp_backend", None)
    if sp_size > 1 and backend not in (None, "deepspeed"):
        return (f"parallelism_config.sp_backend: only 'deepspeed' (Ulysses) sequence parallelism is supported "
                f"(got {backend!r})")
    return None


def sequence_parallel_size(args) -> int:
    """train.sequence_parallel_size as TrainingArguments' parallelism_config gives it (1: none)."""
    pc = getattr(args, "parallelism_config", None)
    return int(getattr(pc, "sp_size", 1) or 1) if pc is not None else 1


def mapped_values(args, tokens: bool) -> dict[str, Any]:
    """What the mapped fields set, by dotted config key. `tokens`: whether the Trainer's loss is
    normalised by num_items_in_batch (the model takes it, or a compute_loss_func does)."""
    rule = rule_of_optim(args.optim)
    mapped = {
        **({"lomo.optimizer": rule} if rule is not None else {}),  # "lomo": the config's own lomo.optimizer
        "lomo.lr": float(args.learning_rate),
        "train.clip_grad_norm": float(args.max_grad_norm) if args.max_grad_norm > 0 else None,
        "train.accumulation_steps": int(args.gradient_accumulation_steps),
        "train.loss_normalization": "tokens" if tokens else "mean",
    }
    if getattr(args, "seed", None) is not None:  # TrainingArguments always has one (42 by default)
        mapped["train.seed"] = int(args.seed)
    if getattr(args, "parallelism_config", None) is not None:  # else the config's own value stands
        mapped["train.sequence_parallel_size"] = sequence_parallel_size(args)
    return mapped


# Keys of a config's own sections the Trainer decides (they would be ignored otherwise).
_TRAINER_DECIDES = {"train.scheduler": "lr_scheduler_type / warmup_steps (the Trainer's schedule)",
                    "lomo.presets": "learning_rate / max_grad_norm (the Trainer's arguments)"}
_SOURCE = {f.maps_to: f.name for f in FIELDS if f.maps_to}


def merge_mapped(config: dict, mapped: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed config dict with the mapped values in its sections (lomo, train); a key the
    config sets differently is refused, and so is one the Trainer decides."""
    config = {**config}
    for key, why in _TRAINER_DECIDES.items():
        section, _, name = key.partition(".")
        if name in (config.get(section) or {}):
            raise TrainingArgumentsError(f"deepspeed: {key} is set, but under the Trainer {why} decide it; "
                                         f"remove {key}")
    for key, value in mapped.items():
        section, _, name = key.partition(".")
        given = config[section] = dict(config.get(section) or {})
        if name in given and given[name] != value:
            raise TrainingArgumentsError(f"{_SOURCE[key]}: gives {key} {value!r}, the config's {section} section "
                                         f"says {given[name]!r}; set only one of them")
        given[name] = value
    return config


def options_markdown() -> str:
    """The table of docs/training_arguments.md."""
    rows = ["| field | status | under LOMO |", "|---|---|---|"]
    for f in FIELDS:
        mapped = f" (`{f.maps_to}`)" if f.maps_to else ""
        rows.append(f"| `{f.name}` | {f.status}{mapped} | {f.what} |")
    return "\n".join(rows) + "\n"
