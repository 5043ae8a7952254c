"""The engine's config schema: DeepSpeed's keys stay DeepSpeed's, the "lomo" section is these
frozen pydantic models.

Unknown keys, wrong types and out-of-range values are refused, values are not coerced, and nothing
can change a validated section. Reading files and turning pydantic's errors into `ConfigError`s is
lomo_ds/config/lomo.py's and errors.py's job; the option tables are generated from these fields
(docs.py).
"""
from __future__ import annotations

from typing import Annotated, Literal

import torch
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator


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


# How gradient buckets are summed over ranks: the transports of lomo_ds/comm/grad.py.
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
        "elements of a shard slice updated at once (lomo_ds/engine/update/shard.py): the update's fp32 and "
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
        return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[self.dtype]
