"""The planner's model for any config.json transformers knows: the real module tree, built on the
meta device (no memory, no weights), and the sizes the activation and KV-cache terms read.

    spec = spec_from_config(json.load(open("config.json")), name="qwen2.5-7b")
    spec.layer_class, spec.no_split       # "Qwen2DecoderLayer", ("Qwen2DecoderLayer",)
    spec.param_shapes()                   # every parameter's real shape, a tied one once

From the built model, not from the config's names: every parameter's shape (biases, q/k norms, a
head_dim that differs from hidden / heads, stacked MoE experts [E, R, C], a shared expert), which
parameters are tied (the same tensor counted once, under both modules, as DeepSpeed gathers it),
the module tree with each module's class (what zero_optimization.leaf_module names), and the
classes the model names in `_no_split_modules` (what leaf_module "auto" resolves to,
lomo_ds/config/leaf_module.py).
"""
from __future__ import annotations

import torch

from lomo_ds.config import leaf_module
from lomo_ds.planning.fetch_units import ModuleNode
from lomo_ds.planning.specs import ModelSpec


def hf_config(raw: dict, name: str = "model"):
    """A transformers config object from a config.json's dict (its `model_type` picks the class)."""
    from transformers import AutoConfig  # loaded on first use: the CLI and a LLaMA-size plan need none

    model_type = raw.get("model_type")
    if not model_type:
        raise ValueError(f"{name}: config.json has no model_type, so no transformers architecture to build")
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "transformers_version", "architectures")}
    try:
        return AutoConfig.for_model(model_type, **fields)
    except ValueError as e:
        raise ValueError(f"{name}: model_type {model_type!r} is not one transformers knows ({e})") from None


def meta_model(config) -> torch.nn.Module:
    """The causal LM of `config`, built on the meta device: the real modules, no storage."""
    from transformers import AutoModelForCausalLM  # loaded on first use, as in hf_config

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def tree_of(model: torch.nn.Module):
    """The planner's ModuleNode tree of a built model: each module's class, dotted name, its own
    parameters (a tied tensor under its first name, the same entry in every module that holds it)."""

    key = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        key.setdefault(id(p), name)

    def node(module: torch.nn.Module, name: str) -> ModuleNode:
        own = [(key[id(p)], p.numel()) for p in module.parameters(recurse=False)]
        children = [node(child, f"{name}.{n}" if name else n) for n, child in module.named_children()]
        return ModuleNode(type(module).__name__, name, own, children,
                          container=isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)))

    return node(model, "")


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers: the longest ModuleList of the model."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def _first(config, *names, default=None):
    for n in names:
        value = getattr(config, n, None)
        if value is not None:
            return value
    return default


def spec_from_config(raw: dict, name: str = "model"):
    """A ModelSpec (lomo_ds/planning/specs.py) from a config.json dict, its shapes and module tree
    read from the model built on the meta device."""

    config = hf_config(raw, name)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model = meta_model(config)
    shapes = tuple(tuple(p.shape) for p in model.parameters())  # a tied tensor once
    layers = _decoder_layers(model)
    layer = layers[0] if layers else model
    norms = sum(1 for m in layer.modules() if "norm" in type(m).__name__.lower())
    qk_norms = sum(1 for n, m in layer.named_modules() if "norm" in type(m).__name__.lower()
                   and n.split(".")[-1] in ("q_norm", "k_norm"))
    heads = int(_first(text, "num_attention_heads"))
    hidden = int(_first(text, "hidden_size"))
    experts = int(_first(text, "num_local_experts", "num_experts", "n_routed_experts", default=0) or 0)
    moe = {"experts_per_tok": int(_first(text, "num_experts_per_tok", default=0) or 0),
           "expert_intermediate": int(_first(text, "moe_intermediate_size", "intermediate_size", default=0)),
           "shared_intermediate": int(_first(text, "shared_expert_intermediate_size", default=0) or 0)
           } if experts else {}
    return ModelSpec(
        name=name, hidden=hidden, layers=len(layers) or int(_first(text, "num_hidden_layers")),
        intermediate=int(_first(text, "intermediate_size", default=4 * hidden)),
        vocab=int(_first(text, "vocab_size")), heads=heads,
        kv_heads=int(_first(text, "num_key_value_heads", default=heads)),
        head_dim=int(_first(text, "head_dim", default=hidden // heads)),
        tie=len(shapes) < len(list(model.named_parameters(remove_duplicate=False))),
        shapes=shapes, tree=tree_of(model), family=str(getattr(config, "model_type", "")),
        layer_class=type(layer).__name__, no_split=tuple(leaf_module.no_split_classes(model)),
        norms_per_layer=norms - qk_norms, qk_norm=qk_norms > 0, experts=experts, **moe,
        softcap=bool(_first(text, "attn_logit_softcapping", default=None)),
        final_softcap=bool(_first(text, "final_logit_softcapping", default=None)))

