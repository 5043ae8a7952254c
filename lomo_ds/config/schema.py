"""The update rule's config schema: the `lomo` section and the pieces every section builds on
(Section, Int, expects, the schedule). DeepSpeed's keys stay DeepSpeed's; the other engine
sections (comm, memory, train) are sections.py's.

Unknown keys, wrong types and out-of-range values are refused, values are not coerced, and nothing
can change a validated section. Reading files and turning pydantic's errors into `ConfigError`s is
lomo_ds/config/lomo.py's and errors.py's job; the option tables are generated from these fields
(docs.py).
"""
from __future__ import annotations

from typing import Annotated, Literal

import torch
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


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


class PresetConfig(Section):
    """One update rule's tuned values (lomo.presets.sgd, lomo.presets.adalomo). When lomo.optimizer
    names the rule, each key given here fills the same key of the run, unless the config sets that
    key itself (in the file or by --set): lr and weight_decay fill the lomo section's, the clipping
    and the schedule the train section's. So a config that carries both presets switches between
    LOMO and AdaLomo by lomo.optimizer alone, each with its own learning rate and clipping."""

    lr: float | None = Field(None, gt=0, json_schema_extra=expects("a positive learning rate"),
                             description="lomo.lr for this rule")
    weight_decay: float | None = Field(None, ge=0, description="lomo.weight_decay for this rule")
    clip_grad_norm: float | None = Field(None, gt=0, json_schema_extra=expects("a positive number or null"),
                                         description="train.clip_grad_norm for this rule (null: none)")
    clip_grad_value: float | None = Field(None, gt=0, json_schema_extra=expects("a positive number or null"),
                                          description="train.clip_grad_value for this rule (null: none)")
    scheduler: ScheduleConfig | None = Field(None, description="train.scheduler's keys for this rule (the keys "
                                                               "given)")


class PresetsConfig(Section):
    """Per update rule, the values it runs with when lomo.optimizer names it (see PresetConfig)."""

    sgd: PresetConfig | None = Field(None, description="LOMO's (SGD's) values")
    adalomo: PresetConfig | None = Field(None, description="AdaLomo's values")


class LomoConfig(Section):
    """The `lomo` section: the update rule LOMO fuses into the backward and applies to each rank's
    shard. How gradients travel is the `comm` section's, what the step holds in memory the
    `memory` section's, and what every method shares (clipping, schedule, accumulation) `train`'s."""

    optimizer: Literal["sgd", "adalomo"] = Field("sgd", description="the update rule: SGD (the paper's LOMO) or "
                                                                    "AdaLomo (options under lomo.adalomo)")
    adalomo: AdaLomoConfig = AdaLomoConfig()
    presets: PresetsConfig = PresetsConfig()
    lr: float = Field(1e-3, gt=0, json_schema_extra=expects("a positive learning rate"),
                      description="the LOMO update's learning rate (the schedule's peak); methods lomo and "
                                  "lora_lomo (the base weights)")
    weight_decay: float = Field(0.0, ge=0, description="decoupled: p <- p - lr * (g + weight_decay * p)")
    stochastic_rounding: bool = Field(True, description="round bf16 updates stochastically (bf16 shards without a "
                                                        "master copy), seeded by train.seed")
    fp32_master_weights: bool = Field(False, description="keep an fp32 copy of this rank's shard "
                                                         "(4 bytes / parameter / rank count)")
    loss_scale: LossScaleConfig = LossScaleConfig()
    max_consecutive_skips: Int = Field(20, ge=1, description="skipped steps (non-finite loss or gradient) in a row "
                                                            "before the engine stops with an error")
    exclude_params: tuple[str, ...] = Field((), strict=False, description="fnmatch patterns of parameter names "
                                                                          "LOMO leaves alone (a list)")


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
