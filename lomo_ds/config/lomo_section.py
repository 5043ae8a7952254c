"""The update rule's config section, `lomo`: the rule (a name the registry knows, rules.py), its
options and presets, the schedule, the loss scale; and the run's precision. DeepSpeed's keys stay
DeepSpeed's; the other engine sections (comm, memory, train) are engine_sections.py's, and what
every section builds on is section.py's.

Unknown keys, wrong types and out-of-range values are refused, values are not coerced, and nothing
can change a validated section. Reading files and turning pydantic's errors into `ConfigError`s is
loading.py's and errors.py's job; the option tables are generated from these fields
(docs.py).
"""
from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lomo_ds.config import rules
from lomo_ds.config.errors import SectionError, explain
from lomo_ds.config.section import Int, Section, expects


def _rule_section(model, raw, key: str):
    """`raw` validated by a registered rule's own section model, its first error keyed under `key`."""
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        sub, what = explain(model, e.errors()[0])
        raise SectionError(f"{key}.{sub}" if sub else key, what) from None


def _unknown(key: str, known) -> SectionError:
    return SectionError(key, f"unknown key; expected some of {sorted(known)}")


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
    """One update rule's tuned values (lomo.presets.sgd, lomo.presets.adalomo, lomo.presets.<any
    registered rule>). When lomo.optimizer names the rule, each key given here fills the same key of
    the run, unless the config sets that key itself (in the file or by --set): lr and weight_decay
    fill the lomo section's, the clipping and the schedule the train section's. So a config that
    carries both presets switches between LOMO and AdaLomo by lomo.optimizer alone, each with its
    own learning rate and clipping. A rule's registered preset (config/rules.py) stands where the
    config gives none."""

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
    """Per update rule, the values it runs with when lomo.optimizer names it (see PresetConfig): the
    built-ins' here, any other registered rule's under lomo.presets.<its name>."""

    model_config = ConfigDict(extra="allow")  # a registered rule's preset; anything else refused below

    sgd: PresetConfig | None = Field(None, description="LOMO's (SGD's) values")
    adalomo: PresetConfig | None = Field(None, description="AdaLomo's values")

    @model_validator(mode="before")
    @classmethod
    def _registered_rules(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for key, raw in data.items():
            if key in cls.model_fields:
                continue
            if key not in rules.names():
                raise _unknown(key, set(cls.model_fields) | set(rules.names()))
            out[key] = None if raw is None else _rule_section(PresetConfig, raw, key)
        return out

    def of(self, name: str) -> PresetConfig | None:
        """The preset of rule `name`: the config's, else the one the rule is registered with."""
        given = getattr(self, name, None)
        if given is not None:
            return given
        preset = rules.get(name).preset if name in rules.names() else None
        return PresetConfig.model_validate(preset) if preset is not None else None


class LomoConfig(Section):
    """The `lomo` section: the update rule LOMO fuses into the backward and applies to each rank's
    shard. How gradients travel is the `comm` section's, what the step holds in memory the
    `memory` section's, and what every method shares (clipping, schedule, accumulation) `train`'s.
    A registered rule's options other than AdaLomo's are under lomo.<its config key>, validated by
    its own section (config/rules.py)."""

    model_config = ConfigDict(extra="allow")  # a registered rule's options section; anything else refused below

    plugins: tuple[str, ...] = Field((), strict=False, description="modules to import before the rest is read, "
                                     "so that the update rules they register can be named (a list; docs/rules.md)")
    optimizer: str = Field(rules.DEFAULT, description="the update rule, a registered one's name: sgd (the paper's "
                                                      "LOMO), adalomo (options under lomo.adalomo) or a plug-in's")
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

    @model_validator(mode="before")
    @classmethod
    def _plugins_and_rule_sections(cls, data: Any) -> Any:
        """Import lomo.plugins first (their rules can then be named), and validate each registered
        rule's own options section by its model; any other unknown key is refused."""
        if not isinstance(data, dict):
            return data
        plugins = data.get("plugins") or ()
        for i, module in enumerate(plugins if isinstance(plugins, (list, tuple)) else ()):
            try:
                rules.import_plugin(module)
            except rules.RuleError as e:
                raise SectionError(f"plugins[{i}]", str(e)) from None
        sections = {s.key: s for s in rules.specs() if s.config is not None and s.key not in cls.model_fields}
        out = dict(data)
        for key, raw in data.items():
            if key in cls.model_fields:
                continue
            if key not in sections:
                raise _unknown(key, set(cls.model_fields) | set(sections))
            out[key] = _rule_section(sections[key].config_model(), raw or {}, key)
        return out

    @field_validator("optimizer")
    @classmethod
    def _registered(cls, value: str) -> str:
        if value not in rules.names():
            raise ValueError(f"expected one of {rules.names()}, got {value!r}")
        return value

    @property
    def rule(self) -> rules.RuleSpec:
        """The registry's entry of the rule lomo.optimizer names."""
        return rules.get(self.optimizer)

    @property
    def rule_words(self) -> str:
        """The rule as a run's summary names it after the method: nothing for LOMO's own rule (SGD),
        else " with <its label>" (" with AdaLomo")."""
        return "" if self.optimizer == rules.DEFAULT else f" with {self.rule.label}"

    @property
    def rule_options(self) -> BaseModel | None:
        """The chosen rule's options: its section as the config gives it, or its defaults; None for a
        rule without options."""
        spec = self.rule
        model = spec.config_model()
        if model is None:
            return None
        given = getattr(self, spec.key, None)
        return given if isinstance(given, model) else model()


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
