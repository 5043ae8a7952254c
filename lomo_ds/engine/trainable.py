"""Which parameters the engine updates, and which a config pattern names.

module.parameters() lists a tied tensor once: it gets one hook and one update with the gradient
autograd has already summed over its uses. Parameters matching lomo.exclude_params (e.g. LoRA
adapters stepped by another optimizer) keep a plain .grad and are not the engine's."""
from __future__ import annotations

import fnmatch

import torch

from lomo_ds.runtime import ds_compat


def matching(module: torch.nn.Module, patterns) -> list[torch.nn.Parameter]:
    """The trainable parameters whose names match one of the fnmatch `patterns`."""
    return [p for n, p in module.named_parameters() if p.requires_grad and any(fnmatch.fnmatch(n, pat)
                                                                               for pat in patterns)]


def trainable(module: torch.nn.Module, exclude) -> list[torch.nn.Parameter]:
    """The parameters the engine updates: the trainable ones but those `exclude` names, each a ZeRO-3
    parameter (refused otherwise: the model was not partitioned by DeepSpeed)."""
    excluded = {id(p) for p in matching(module, exclude)}
    params = [p for p in module.parameters() if p.requires_grad and id(p) not in excluded]
    if not params:
        raise ValueError("model has no trainable parameters")
    missing = ds_compat.check_param_attrs(params[0])
    if missing:
        raise RuntimeError(f"DeepSpeed ZeRO-3 parameter attributes missing: {missing}")
    return params
