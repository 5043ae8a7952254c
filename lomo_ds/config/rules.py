"""The registry of update rules: every place that needs to know a rule (the config's
`lomo.optimizer` and its options section, the engine that builds it, the planner that sizes it,
the Trainer's `optim` names, the run's summary) reads its entry here, so a new rule is one entry.

An entry (`RuleSpec`) is data. Its parts that live in higher layers (the rule's class in
`lomo_ds.engine`, the planner's terms in `lomo_ds.planning`) are written as "module:attr" strings
and imported only when used (`resolve`), so this module, at the bottom layer, imports nothing of
the engine or the planner. A rule defined elsewhere (a user's module, a test file) registers its
objects directly:

    register(RuleSpec(name="lion", label="Lion", rule=Lion, config=LionConfig,
                      plan=PlanTerms(state_bytes=..., update_bytes=...)))

after which `lomo: {optimizer: lion, lion: {...}}` selects and configures it (lomo.plugins names
modules to import first, for a run launched from a config file). docs/rules.md walks through one.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

DEFAULT = "sgd"  # lomo.optimizer when a config names none: LOMO's own rule

# The planner's rows of DeepSpeed's own optimizers (the paper's baselines): no rule plans as one.
BASELINE_ROWS = ("sgd", "adamw")


class RuleError(ValueError):
    """A rule that cannot be registered or found; the message names the rule and the registered ones."""


@dataclass(frozen=True)
class PlanTerms:
    """What a rule adds to the planner's per-GPU estimate (planning/estimate.py), as callables the
    planner calls with its own figures (duck-typed: this layer imports nothing of the planner).

    state_bytes(model, gpus): the rule's state on each rank, for the planner's ModelSpec `model`
        (`model.param_shapes()`: every parameter's full shape) sharded over `gpus` ranks.
    update_bytes(model, run, slice_n, bucket_n): transient bytes of one update, where `run` is the
        planner's RunSpec, `slice_n` the largest slice of a parameter on a rank and `bucket_n` the
        shard elements of a reduced bucket.
    offload_update_bytes(model, run, bucket_n): the same on the rank's device where the shards live
        in host memory (offload_param cpu) and the host-update worker applies them; None: 0.
    Each may be a callable or a "module:attr" string naming one."""

    state_bytes: Callable[..., int] | str
    update_bytes: Callable[..., int] | str
    offload_update_bytes: Callable[..., int] | str | None = None


@dataclass(frozen=True)
class RuleSpec:
    """One update rule.

    name      what `lomo.optimizer` says; also the name its checkpointed state is stored under
    label     how summaries and the planner's tables name it
    rule      the rule's class, or a "module:attr" string naming it; the engine builds it with
              `rule.build(ctx)` (engine/update/rule.py, BuildContext)
    config    the pydantic section of its options, or a "module:attr" string; None: it has none
    config_key  where its options are in the lomo section (lomo.<config_key>); default: its name
    plan      its PlanTerms (None: the planner has no row for it and refuses to plan it)
    plan_name the planner's row for it (`lomo-ds plan` tables, Estimate.method); default: its name
    plan_label how the planner's tables name that row; default: its label
    optim     the TrainingArguments / TRL `optim` values that choose it by name (besides `lomo`,
              which means the rule lomo.optimizer names); each must be a value transformers accepts
    preset    tuned defaults it brings (a lomo.presets.<name> section as a dict); a config's own
              lomo.presets.<name> wins over it
    """

    name: str
    label: str
    rule: Any
    config: Any = None
    config_key: str | None = None
    plan: PlanTerms | None = None
    plan_name: str | None = None
    plan_label: str | None = None
    optim: tuple[str, ...] = ()
    preset: dict | None = field(default=None, hash=False)

    @property
    def key(self) -> str:
        return self.config_key or self.name

    @property
    def row(self) -> str:
        return self.plan_name or self.name

    def rule_class(self):
        return resolve(self.rule)

    def config_model(self):
        return resolve(self.config) if self.config is not None else None


_REGISTRY: dict[str, RuleSpec] = {}


def resolve(ref):
    """An object from a "module:attr" string (imported now); anything else as it is."""
    if not isinstance(ref, str):
        return ref
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def register(spec: RuleSpec) -> RuleSpec:
    """Add a rule. The same entry registered again is a no-op (a module imported twice); another
    entry under a name, optim value or planner row already taken is refused."""
    if not isinstance(spec, RuleSpec):
        raise RuleError(f"register: expected a RuleSpec, got {type(spec).__name__}")
    if not spec.name or not spec.name.isidentifier():
        raise RuleError(f"register: a rule's name must be an identifier (it is a config key), got {spec.name!r}")
    old = _REGISTRY.get(spec.name)
    if old is not None:
        if old == spec:
            return old
        raise RuleError(f"register: a rule named {spec.name!r} is already registered ({old.label}); "
                        f"choose another name (registered: {names()})")
    if spec.row in BASELINE_ROWS:
        raise RuleError(f"register {spec.name!r}: the planner's row {spec.row!r} is DeepSpeed's {spec.row}; "
                        f"set plan_name to another")
    for other in _REGISTRY.values():
        taken = set(other.optim) & set(spec.optim)
        if taken:
            raise RuleError(f"register {spec.name!r}: optim {sorted(taken)} already chooses {other.name!r}")
        if other.row == spec.row or other.key == spec.key:
            raise RuleError(f"register {spec.name!r}: planner row or config key {spec.row!r}/{spec.key!r} is "
                            f"{other.name!r}'s")
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove a rule (a test's own, once it is done)."""
    _REGISTRY.pop(name, None)


def get(name: str) -> RuleSpec:
    """The entry of rule `name`; an unknown name is refused with the registered ones."""
    spec = _REGISTRY.get(name)
    if spec is None:
        raise RuleError(f"unknown update rule {name!r}: expected one of {names()}")
    return spec


def names() -> list[str]:
    """The registered rules' names, built-ins first, in the order they were registered."""
    return list(_REGISTRY)


def specs() -> list[RuleSpec]:
    return list(_REGISTRY.values())


def by_optim(value: str) -> RuleSpec | None:
    """The rule a TrainingArguments `optim` value names (None: none does)."""
    return next((s for s in _REGISTRY.values() if value in s.optim), None)


def by_row(row: str) -> RuleSpec | None:
    """The rule the planner's row `row` plans (None: not a rule's row)."""
    return next((s for s in _REGISTRY.values() if s.row == row), None)


def import_plugin(module) -> None:
    """Import a module (lomo.plugins' item), so that the rules it registers are known before a
    config naming them is validated; one that cannot be imported is refused with the reason."""
    if not isinstance(module, str) or not module:
        raise RuleError(f"expected a module name (a string), got {module!r}")
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise RuleError(f"cannot import {module!r} ({e})") from None


# ----------------------------------------------------------------------------- the built-in rules
register(RuleSpec(
    name="sgd", label="LOMO (SGD)", rule="lomo_ds.engine.update.sgd:SGD",
    plan=PlanTerms(state_bytes="lomo_ds.planning.estimate:no_state_bytes",
                   update_bytes="lomo_ds.planning.estimate:sgd_update_bytes"),
    plan_name="lomo", plan_label="LOMO"))  # the planner's row "sgd" is DeepSpeed's SGD baseline, not the fused rule
register(RuleSpec(
    name="adalomo", label="AdaLomo", rule="lomo_ds.engine.update.adalomo:AdaLomo",
    config="lomo_ds.config.lomo_section:AdaLomoConfig",
    plan=PlanTerms(state_bytes="lomo_ds.planning.estimate:adalomo_state_bytes",
                   update_bytes="lomo_ds.planning.estimate:adalomo_update_bytes",
                   offload_update_bytes="lomo_ds.planning.estimate:adalomo_offload_update_bytes"),
    optim=("adalomo",)))
