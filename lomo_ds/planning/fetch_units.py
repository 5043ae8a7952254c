"""ZeRO-3's fetch units: the module tree of a model, which modules are gathered whole (leaf_module
classes, names or the granularity threshold), and the gathered working set that follows."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from lomo_ds.planning.specs import ModelSpec, RunSpec, resolve_auto


@dataclass
class ModuleNode:
    """One module of a LLaMA as transformers builds it: its class, dotted name, own parameters
    (element counts; a tied weight is the same entry under both modules) and children."""

    cls: str
    name: str
    own: list = field(default_factory=list)  # [(parameter key, numel)]
    children: list = field(default_factory=list)
    container: bool = False  # an nn.ModuleList: never a leaf (DeepSpeed's rule)

    def params(self) -> dict:
        """Every parameter under this module, once each: key -> numel."""
        out = dict(self.own)
        for c in self.children:
            out.update(c.params())
        return out


def module_tree(m: ModelSpec) -> ModuleNode:
    """The model's module tree with parameter sizes: the built model's (model_tree.py), else
    LlamaForCausalLM's (transformers' LLaMA)."""
    if m.tree is not None:
        return m.tree
    h, f, d = m.hidden, m.intermediate, m.d

    def linear(name, numel):
        return ModuleNode("Linear", name, [(name + ".weight", numel)])

    def norm(name):
        return ModuleNode("LlamaRMSNorm", name, [(name + ".weight", h)])

    layers = []
    for i in range(m.layers):
        p = f"model.layers.{i}"
        attn = ModuleNode("LlamaAttention", p + ".self_attn", children=[
            linear(p + ".self_attn.q_proj", h * m.heads * d), linear(p + ".self_attn.k_proj", h * m.k * d),
            linear(p + ".self_attn.v_proj", h * m.k * d), linear(p + ".self_attn.o_proj", m.heads * d * h)])
        mlp = ModuleNode("LlamaMLP", p + ".mlp", children=[
            linear(p + ".mlp.gate_proj", h * f), linear(p + ".mlp.up_proj", h * f), linear(p + ".mlp.down_proj", f * h),
            ModuleNode("SiLU", p + ".mlp.act_fn")])
        layers.append(ModuleNode("LlamaDecoderLayer", p, children=[
            attn, mlp, norm(p + ".input_layernorm"), norm(p + ".post_attention_layernorm")]))
    embed = ModuleNode("Embedding", "model.embed_tokens", [("model.embed_tokens.weight", m.vocab * h)])
    model = ModuleNode("LlamaModel", "model", children=[
        embed, ModuleNode("ModuleList", "model.layers", children=layers, container=True), norm("model.norm"),
        ModuleNode("LlamaRotaryEmbedding", "model.rotary_emb")])
    head_key = "model.embed_tokens.weight" if m.tie else "lm_head.weight"
    head = ModuleNode("Linear", "lm_head", [(head_key, m.vocab * h)])
    return ModuleNode("LlamaForCausalLM", "", children=[model, head])


_MAX_LEAF = 1e9  # DeepSpeed never makes a module of more parameters a leaf by threshold (Z3_MAX_LEAF_SIZE)


def _granularity(node: ModuleNode, out: dict) -> tuple[int, int]:
    """DeepSpeed's module granularity (its parameters over its modules, torch leaves and itself
    counted; a tied weight counted under each module), recorded in out[id(node)]; returns
    (modules, parameters) under `node`."""
    if not node.params():
        out[id(node)] = math.inf
        return 0, 0
    own = sum(n for _, n in node.own)
    if not node.children:
        out[id(node)] = math.inf
        return 1, own
    layers, params = 0, own
    for c in node.children:
        cl, cp = _granularity(c, out)
        layers, params = layers + cl, params + cp
    if node.container:
        out[id(node)] = math.inf
        return layers, params
    layers += 1
    out[id(node)] = params // layers if params <= _MAX_LEAF else math.inf
    return layers, params


def _is_leaf_by_config(node: ModuleNode, run: RunSpec) -> bool:
    return any(node.cls == c or node.name == c or (node.name and node.name.endswith(c)) for c in run.leaf_classes)


def fetch_units(m: ModelSpec, run: RunSpec) -> list[tuple[str, int]]:
    """What ZeRO-3 gathers as one unit under the run's fetch granularity, as (module name,
    elements), each parameter in the first unit that holds it; persistent parameters (at most
    stage3_param_persistence_threshold elements) stay gathered and belong to none."""
    return _fetch_plan(m, run)[0]


def leaf_module_names(m: ModelSpec, run: RunSpec) -> list[str]:
    """The modules ZeRO-3 makes leaves (gathered whole) under the run's settings, by dotted name."""
    return _fetch_plan(m, run)[1]


def _fetch_plan(m: ModelSpec, run: RunSpec) -> tuple[list[tuple[str, int]], list[str]]:
    run = resolve_auto(m, run)
    root = module_tree(m)
    gran: dict = {}
    if run.granularity_threshold:
        _granularity(root, gran)
    units, leaves, seen = [], [], set()

    def add(name, params: dict):
        fresh = {k: n for k, n in params.items() if k not in seen and n > run.persistence}
        seen.update(fresh)
        if fresh:
            units.append((name or "(model)", sum(fresh.values())))

    def walk(node: ModuleNode):
        if not node.params():
            return
        if _is_leaf_by_config(node, run) or gran.get(id(node), math.inf) <= run.granularity_threshold:
            leaves.append(node.name)
            add(node.name, node.params())
            return
        add(node.name, dict(node.own))
        for c in node.children:
            walk(c)

    walk(root)
    return units, leaves


def working_set(m: ModelSpec, run: RunSpec) -> tuple[int, int]:
    """(persistent elements, elements of the gathered working set W)."""
    numels = m.param_numels()
    persist = sum(x for x in numels if x <= run.persistence)
    work = min(sum(numels) - persist, min(run.max_live, run.max_reuse) + largest_fetch_unit(m, run)[1] + run.prefetch)
    return persist, work


def largest_fetch_unit(m: ModelSpec, run: RunSpec) -> tuple[str, int]:
    """The largest unit gathered at once: (module name, elements); ("", 0) when none is."""
    return max(fetch_units(m, run), key=lambda u: u[1], default=("", 0))
