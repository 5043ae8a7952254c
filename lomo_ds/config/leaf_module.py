"""`zero_optimization.leaf_module`: the unit ZeRO-3 gathers, resolved against the model.

DeepSpeed gathers a leaf module's parameters in one fetch, with one set of hooks, instead of one
per `nn.Linear`; lomo_ds's shipped configs make the decoder layer the leaf (as PyTorch FSDP2 wraps
a layer). The layer's class differs per family (LlamaDecoderLayer, Qwen2DecoderLayer, ...), so:

- `"leaf_module": "auto"` (the shipped configs' value) takes the classes the model itself names as
  the blocks that must not be split: transformers' `_no_split_modules`, which `post_init` gathers
  from the model's submodels (the decoder layer, for a causal LM). DeepSpeed refuses a string
  there, so lomo_ds replaces it with `{"classes": [...]}` before any DeepSpeed code reads the
  config (`resolve`), and leaves it out of the config the model is built under (`for_model_build`:
  the fetch unit plays no part in partitioning).
- A class, name or name suffix the model does not have is a `ConfigError` naming what the model
  has: DeepSpeed would only log a warning on one rank and fall back to one gather per module.

`check_value` runs where the config is loaded (before any model exists): "auto" or an object.
The planner resolves "auto" the same way on the model it builds on the meta device
(lomo_ds/planning/model_tree.py).
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from lomo_ds.config.errors import ConfigError

if TYPE_CHECKING:  # loading a config imports no torch
    import torch

AUTO = "auto"
KEY = "zero_optimization.leaf_module"
_LISTS = ("classes", "names", "name_suffixes")  # DeepSpeed's DeepSpeedZeroLeafModuleConfig fields


def check_value(value) -> None:
    """A config's leaf_module value, before any model exists: "auto", or DeepSpeed's object of
    lists of strings (a single string for a list is accepted, as DeepSpeed does)."""
    if value is None or value == AUTO:
        return
    if isinstance(value, str):
        raise ConfigError(f'{KEY}: expected "auto" or an object {{"classes": [...], "names": [...], '
                          f'"name_suffixes": [...]}}, got {value!r}')
    if not isinstance(value, dict):
        raise ConfigError(f'{KEY}: expected "auto" or an object, got {value!r}')
    for key, entries in value.items():
        if key not in _LISTS:
            raise ConfigError(f"{KEY}.{key}: unknown key; expected one of {list(_LISTS)}")
        entries = [entries] if isinstance(entries, str) else entries
        if not isinstance(entries, list) or not all(isinstance(e, str) and e for e in entries):
            raise ConfigError(f"{KEY}.{key}: expected a list of non-empty strings, got {value[key]!r}")


def no_split_classes(model: torch.nn.Module) -> list[str]:
    """The classes the model names as its unsplittable blocks (the outermost module that names
    any: a peft wrapper's base model, a task head's transformer), sorted."""
    for module in model.modules():
        names = getattr(module, "_no_split_modules", None)
        if names:
            return sorted(names)
    return []


def module_classes(model: torch.nn.Module) -> list[str]:
    """Every module class in the model, by name, in the order first met."""
    return list(dict.fromkeys(type(m).__name__ for m in model.modules()))


def _qualified(module: torch.nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _has_class(model: torch.nn.Module, name: str) -> bool:
    # DeepSpeed matches a class by its name or by its fully qualified name.
    return any(type(m).__name__ == name or _qualified(m) == name for m in model.modules())


def resolve_value(value, model: torch.nn.Module) -> dict | None:
    """The leaf_module object DeepSpeed gets for `model` ("auto" resolved); a ConfigError when
    an entry names nothing in the model."""
    check_value(value)
    if value is None:
        return None
    own = no_split_classes(model)
    if value == AUTO:
        if not own:
            raise ConfigError(f'{KEY}: "auto" takes the model\'s _no_split_modules, and {type(model).__name__} '
                              f"names none; give the classes to gather as one unit, e.g. "
                              f'{{"classes": [...]}} from its module classes {module_classes(model)}')
        return {"classes": own}
    value = {k: [v] if isinstance(v, str) else list(v) for k, v in value.items()}
    hint = f'; "auto" picks {own}' if own else ""
    missing = [c for c in value.get("classes", []) if not _has_class(model, c)]
    if missing:
        raise ConfigError(f"{KEY}.classes: {missing} not in this model ({type(model).__name__}); "
                          f"its module classes are {module_classes(model)}{hint}")
    names = [n for n, _ in model.named_modules()]
    missing = [n for n in value.get("names", []) if n not in names]
    if missing:
        raise ConfigError(f"{KEY}.names: no module named {missing} in this model ({type(model).__name__}); "
                          f"e.g. {names[1:6]}{hint}")
    missing = [s for s in value.get("name_suffixes", []) if not any(n.endswith(s) for n in names)]
    if missing:
        raise ConfigError(f"{KEY}.name_suffixes: no module name ends with {missing} in this model "
                          f"({type(model).__name__}){hint}")
    return value


def resolve(ds_config: dict, model: torch.nn.Module) -> dict:
    """`ds_config` as DeepSpeed may read it for `model`: leaf_module "auto" replaced by the model's
    own classes and every entry checked against the model (a copy; `ds_config` is not changed)."""
    zero = ds_config.get("zero_optimization") or {}
    if "leaf_module" not in zero:
        return ds_config
    out = copy.deepcopy(ds_config)
    leaf = resolve_value(zero["leaf_module"], model)
    if leaf is None:
        out["zero_optimization"].pop("leaf_module")
    else:
        out["zero_optimization"]["leaf_module"] = leaf
    return out


def for_model_build(ds_config: dict) -> dict:
    """`ds_config` for building the model under zero.Init (transformers' HfDeepSpeedConfig, which
    DeepSpeed parses whole): an unresolved "auto" left out, since the model is not there yet and
    the fetch unit does not change how parameters are partitioned."""
    if (ds_config.get("zero_optimization") or {}).get("leaf_module") != AUTO:
        return ds_config
    out = copy.deepcopy(ds_config)
    out["zero_optimization"].pop("leaf_module")
    return out
