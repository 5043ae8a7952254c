"""Sequence parallelism's attention (train.sequence_parallel_size): DeepSpeed's Ulysses around one
model's own attention, and what a model must be for it. The ranks, groups and batches of SP are
the parallel layout's (lomo_ds/runtime/layout.py), which calls into this module.

Attention is the one place where positions meet: DeepSpeed's UlyssesSPAttentionHF exchanges
query/key/value heads for positions (all-to-all) around the model's own core attention, and back.
It is routed per model: `route` registers an attention function under a name of its own
("lomo_ds_ulysses_<n>_<original>", in transformers' attention and mask registries; the original's
mask builder) and sets that name on the trained model's text config alone. transformers' attention
modules look the function up by their config's name at every call, so the trained model attends
through Ulysses while it trains and through its original attention when it evaluates (whole
sequences on every rank), and every other model of the process (a DPO/GRPO reference model, an
evaluation model) keeps its own config, its own name and its original attention.

DeepSpeed's own `register_with_transformers` is not used for this. It creates the SP groups in
process-global state (parallel_state_sp), which asserts on a second call, so a second engine or a
Trainer run after a recipe run in one process fails; it fixes one micro-batch size for the wrapped
attention, where lomo_ds's evaluation and the last window of an epoch use others; and it replaces the
attention registered under a name for the whole process, so every model in the process (the
reference models of DPO and GRPO, evaluation included) would be routed through SP.

Two things of the model's own attention must survive the exchange:

- a sliding window (Mistral, Phi-3, Qwen2 with use_sliding_window, the local layers of Gemma 2 and
  3): the mask transformers built is the local slice's and is dropped; flash attention takes the
  window as its own `sliding_window` keyword, but sdpa reads it only from the mask, so under sdpa
  the core attention is given the causal sliding-window mask of the gathered row (`_windowed`);
- `num_key_value_groups`: where SP exceeds the key/value heads, DeepSpeed replicates them and sets
  the module's groups to the local ratio without restoring it, and evaluation's whole rows would
  then repeat the key/value heads too few times; the routed function puts it back after each call.
"""
from __future__ import annotations

import itertools
from typing import Any

import torch

# Attention that Ulysses can wrap on this machine: eager builds the S x S mask DeepSpeed refuses;
# flash attention runs on CUDA only.
_NEEDS_CUDA = ("flash_attention_2", "flash_attention_3")
# Ulysses drops the model's mask: an attention has to be causal and windowed without it (sdpa: its
# is_causal path, and the window mask `_windowed` builds; flash: its own keywords). flex_attention
# with no block mask attends to the whole row, later tokens included.
_SUPPORTED = ("sdpa", *_NEEDS_CUDA)
_PREFIX = "lomo_ds_ulysses_"
_ROUTED: dict[str, str] = {}  # a routed model's attention name -> the original implementation's
_NAMES = itertools.count()


def original_attention(name: str) -> str:
    """The attention implementation a name stands for: a routed model's, the one it replaced."""
    return _ROUTED.get(name, name)


def model_facts(hf_config: Any, sp_size: int) -> tuple[int, int, str]:
    """(attention heads, key/value heads, attention implementation) of a model's config, as the
    SP checks read them; refuses a model with none to read."""
    if hf_config is None:
        raise ValueError(f"train.sequence_parallel_size {sp_size}: Ulysses attention needs a transformers model "
                         "(one with a config naming its attention heads)")
    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = getattr(cfg, "num_attention_heads", None)
    if heads is None:
        raise ValueError(f"train.sequence_parallel_size {sp_size}: the model's config names no "
                         "num_attention_heads; Ulysses splits attention by heads")
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    return heads, kv, original_attention(getattr(cfg, "_attn_implementation", None) or "eager")


def check_model_facts(heads: int, kv: int, attention: str, sp_size: int, device_type: str) -> None:
    """Refuse heads, key/value heads or an attention implementation Ulysses cannot split over
    `sp_size` ranks computing on `device_type`."""
    if heads % sp_size:
        raise ValueError(f"train.sequence_parallel_size {sp_size}: the model's {heads} attention heads are not "
                         f"divisible by it (Ulysses gives each SP rank heads / sp heads); use a divisor of {heads}")
    if kv % sp_size and sp_size % kv:
        raise ValueError(f"train.sequence_parallel_size {sp_size}: the model's {kv} key/value heads neither divide "
                         f"nor are divided by it (Ulysses splits or replicates them); use a divisor of {kv}")
    check_attention(attention, sp_size, device_type)


def check_attention(name: str, sp_size: int, device_type: str) -> None:
    if name in ("eager", "paged|eager"):
        raise ValueError(f"train.sequence_parallel_size {sp_size}: attention '{name}' builds the whole sequence's "
                         "S x S mask, which Ulysses cannot split; load the model with attn_implementation='sdpa'")
    if name not in _SUPPORTED:
        raise ValueError(f"train.sequence_parallel_size {sp_size}: attention '{name}' reads the model's mask, which "
                         "Ulysses drops (it is the local slice's), so it would attend to later tokens; use 'sdpa' "
                         "(or flash_attention_2 on CUDA)")
    if name in _NEEDS_CUDA and device_type != "cuda":
        raise ValueError(f"train.sequence_parallel_size {sp_size}: attention '{name}' needs CUDA, and these ranks "
                         f"run on '{device_type}'; Ulysses needs another attention here: 'sdpa'")


def route(model: torch.nn.Module, group: Any) -> str:
    """Route `model`'s attention through Ulysses over the SP `group` while it trains (checked by the
    layout before the engine partitioned the model); returns the name it now attends under."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    cfg = model.config.get_text_config()
    original = original_attention(cfg._attn_implementation)
    # The original's name stays in the routed one: transformers tells flash attention by "flash" in it.
    name = f"{_PREFIX}{next(_NAMES)}_{original}"
    core = ALL_ATTENTION_FUNCTIONS[original]
    core = _named(core, original) if "flash" in original else core
    AttentionInterface.register(name, _routed(core, _ulysses(cfg, core, original, group)))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    _ROUTED[name] = original
    cfg._attn_implementation = name
    return name


def _ulysses(cfg: Any, core, original: str, group: Any):
    """Ulysses around the model's original attention `core`, one instance per batch size."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    core = _windowed(core) if original == "sdpa" else core
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    by_batch: dict[int, UlyssesSPAttentionHF] = {}

    def ulysses(batch_size: int) -> UlyssesSPAttentionHF:
        # Its shapes are fixed per batch size (the positions vary): one instance each.
        if batch_size not in by_batch:
            by_batch[batch_size] = UlyssesSPAttentionHF(
                attn=core, batch_size=batch_size, attn_head_count=cfg.num_attention_heads, attn_head_size=head_dim,
                kv_head_count=cfg.num_key_value_heads or cfg.num_attention_heads,
                num_hidden_layers=cfg.num_hidden_layers, process_group=group, seq_length_is_variable=True)
        return by_batch[batch_size]
    return ulysses


def _routed(original, ulysses):
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        if not module.training:  # evaluation: whole sequences on every rank
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        # The mask transformers built is the local slice's; causal order comes from the gathered
        # position ids instead (right-padded rows: data/sequence_split.py), the window from `_windowed`.
        groups = getattr(module, "num_key_value_groups", None)
        try:
            return ulysses(query.shape[0])(module, query, key, value, None, *args, **kwargs)
        finally:
            if groups is not None:  # DeepSpeed sets it to its local ratio when it replicates key/value heads
                module.num_key_value_groups = groups
    return attention


def _named(core, original: str):
    """`core` called with the module's config naming the original attention again: flash attention
    loads its kernels by that name (a routed model's config names the routed function)."""
    def attention(module, *args, **kwargs):
        cfg = module.config
        routed = cfg._attn_implementation_internal
        cfg._attn_implementation_internal = original
        try:
            return core(module, *args, **kwargs)
        finally:
            cfg._attn_implementation_internal = routed
    return attention


def _windowed(core):
    """sdpa that applies the layer's sliding window to the gathered row: a query at position q sees
    keys q - window < k <= q (transformers' sliding_window_causal_mask_function). The window is the
    `sliding_window` keyword the model passes (None on a global layer), else the module's own
    attribute (Qwen2-MoE passes none); a window at least the row's length is plain causal."""
    cached: dict[tuple, torch.Tensor] = {}

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
        seq = key.shape[-2]
        if attention_mask is None and window and window < seq:
            attention_mask = _window_mask(seq, window, key.device, cached)
        return core(module, query, key, value, attention_mask, *args, **kwargs)
    return attention


def _window_mask(seq: int, window: int, device: torch.device, cached: dict) -> torch.Tensor:
    # One S x S boolean mask per row length, shared by the layers (the last one kept).
    key = (seq, window, str(device))
    if key not in cached:
        cached.clear()
        i = torch.arange(seq, device=device)
        back = i[:, None] - i[None, :]  # how far behind the query each key is
        cached[key] = ((back >= 0) & (back < window))[None, None]
    return cached[key]
