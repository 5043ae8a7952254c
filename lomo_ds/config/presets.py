"""The update rules' presets (lomo.presets.sgd, lomo.presets.adalomo, lomo.presets.<any registered
rule>, else the preset a rule is registered with: config/rules.py): the chosen rule's tuned values
fill the keys a config leaves out, and the run's first lines say which were filled.

A preset spans two sections: lr and weight_decay are the update rule's (lomo), the clipping and
the schedule every method's (train). Filling runs after DeepSpeed's mapped keys are copied in, so a
mapped key (gradient_clipping) is the author's and wins over the preset.
"""
from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel

from lomo_ds.config.lomo_section import LomoConfig, PresetConfig, ScheduleConfig

LOMO_KEYS = ("lr", "weight_decay")  # a preset's keys that fill the lomo section; the rest fill train's

Config = TypeVar("Config", bound=BaseModel)  # an EngineConfig or a RunConfig: both have .lomo and .train


def _preset(lomo: LomoConfig) -> PresetConfig | None:
    return lomo.presets.of(lomo.optimizer)


def _filled(section: BaseModel, update: dict) -> BaseModel:
    # The filled keys stay "not given": the section dumped without defaults names only what was
    # written, and describe_update can tell a filled key from a written one.
    return type(section).model_construct(_fields_set=set(section.model_fields_set), **{**dict(section), **update})


def apply_preset(cfg: Config) -> Config:
    """`cfg` with the chosen rule's preset filling the lomo and train keys the config left out."""
    preset = _preset(cfg.lomo)
    if preset is None:
        return cfg
    given = preset.model_fields_set - {"scheduler"}
    lomo = {k: getattr(preset, k) for k in given & set(LOMO_KEYS) if k not in cfg.lomo.model_fields_set}
    train = {k: getattr(preset, k) for k in given - set(LOMO_KEYS) if k not in cfg.train.model_fields_set}
    if preset.scheduler is not None:
        mine = cfg.train.scheduler
        mine = mine.model_dump(include=mine.model_fields_set) if "scheduler" in cfg.train.model_fields_set else {}
        train["scheduler"] = ScheduleConfig.model_validate(
            {**preset.scheduler.model_dump(include=preset.scheduler.model_fields_set), **mine})
    update = {}
    if lomo:
        update["lomo"] = _filled(cfg.lomo, lomo)
    if train:
        update["train"] = _filled(cfg.train, train)
    return cfg.model_copy(update=update) if update else cfg


def describe_update(cfg: BaseModel) -> str:
    """The update a LOMO run gets, for its first lines: the rule, its lr, clipping and schedule, and
    which of them the rule's preset (lomo.presets) filled in."""
    lomo, train = cfg.lomo, cfg.train
    preset = _preset(lomo)
    filled = []
    if preset is not None:
        for key in sorted(preset.model_fields_set - {"scheduler"}):
            section = lomo if key in LOMO_KEYS else train
            if key not in section.model_fields_set:
                filled.append(key)
        if preset.scheduler is not None:  # merged key by key: the preset's values shown
            filled += [f"scheduler.{k}" for k in sorted(preset.scheduler.model_fields_set)
                       if getattr(train.scheduler, k) == getattr(preset.scheduler, k)]
    sch = train.scheduler
    warmup = f"{sch.warmup_steps} steps" if sch.warmup_steps else f"{sch.warmup_ratio:g}"

    def word(x):
        return "none" if x is None else f"{x:g}"

    text = (f"{lomo.rule.label}, lr {lomo.lr:g}, "
            f"clip_grad_norm {word(train.clip_grad_norm)}, clip_grad_value {word(train.clip_grad_value)}, "
            f"{sch.type} schedule, warm-up {warmup}")
    source = f"lomo.presets.{lomo.optimizer}" if getattr(lomo.presets, lomo.optimizer, None) is not None else \
        f"the preset {lomo.optimizer!r} is registered with"
    return text + (f" ({', '.join(filled)} from {source})" if filled else "")
