"""Sequence parallelism (train.sequence_parallel_size): the groups and DeepSpeed's Ulysses attention.

Ranks are cut into SP groups of consecutive ranks (0..sp-1, sp..2sp-1, ...; DeepSpeed's layout):
the ranks of one group hold slices of the same sequences, and world / sp groups are the
data-parallel replicas. ZeRO-3 keeps sharding every parameter over the whole world, and the
gradient is reduce-scattered over the whole world too: each SP rank's gradient is that of its own
slice of positions, so the world's sum is the sum over data-parallel groups of whole sequences'
gradients, exactly what the update needs (nothing is reduced twice).

Attention is the one place where positions meet: DeepSpeed's UlyssesSPAttentionHF exchanges
query/key/value heads for positions (all-to-all) around the model's own core attention, and back.
It is installed as a dispatcher under the model's attention name in transformers' registry:
modules of a model given to `install` go through their own Ulysses instance while training; any
other model, and evaluation (whole sequences on every rank), calls the original function.

Two things of the model's own attention must survive the exchange:

- a sliding window (Mistral, Phi-3, Qwen2 with use_sliding_window, the local layers of Gemma 2 and
  3): the mask transformers built is the local slice's and is dropped; flash attention takes the
  window as its own `sliding_window` keyword, but sdpa reads it only from the mask, so under sdpa
  the core attention is given the causal sliding-window mask of the gathered row (`_windowed`);
- `num_key_value_groups`: where SP exceeds the key/value heads, DeepSpeed replicates them and sets
  the module's groups to the local ratio without restoring it, and evaluation's whole rows would
  then repeat the key/value heads too few times; the dispatcher puts it back after each call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# Attention that Ulysses can wrap on this machine: eager builds the S x S mask DeepSpeed refuses;
# flash attention runs on CUDA only.
_NEEDS_CUDA = ("flash_attention_2", "flash_attention_3")
# Ulysses drops the model's mask: an attention has to be causal and windowed without it (sdpa: its
# is_causal path, and the window mask `_windowed` builds; flash: its own keywords). flex_attention
# with no block mask attends to the whole row, later tokens included.
_SUPPORTED = ("sdpa", *_NEEDS_CUDA)
_ORIGINAL: dict[str, Any] = {}  # attention name -> transformers' own function, before the dispatcher
_GROUPS: dict[int, Any] = {}  # sp size -> this rank's SP group


@dataclass(frozen=True)
class SequenceParallel:
    size: int  # ranks per sequence
    group: Any  # this rank's SP group (None when size is 1)
    rank: int  # this rank's place in it
    dp_size: int  # data-parallel replicas: world / size
    dp_rank: int


def check_world(sp_size: int, world: int) -> None:
    if world % sp_size:
        raise ValueError(f"train.sequence_parallel_size {sp_size} does not divide the {world} ranks: the "
                         f"data-parallel groups would be uneven; use a divisor of {world}")


def check_model_config(hf_config: Any, sp_size: int, device_type: str = "cpu") -> None:
    """Refuse, before any model is built, a model Ulysses cannot split over `sp_size` ranks."""
    if sp_size == 1:
        return
    if hf_config is None:
        raise ValueError(f"train.sequence_parallel_size {sp_size}: Ulysses attention needs a transformers model "
                         "(one with a config naming its attention heads)")
    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    if heads is None:
        raise ValueError(f"train.sequence_parallel_size {sp_size}: the model's config names no "
                         "num_attention_heads; Ulysses splits attention by heads")
    if heads % sp_size:
        raise ValueError(f"train.sequence_parallel_size {sp_size}: the model's {heads} attention heads are not "
                         f"divisible by it (Ulysses gives each SP rank heads / sp heads); use a divisor of {heads}")
    if kv % sp_size and sp_size % kv:
        raise ValueError(f"train.sequence_parallel_size {sp_size}: the model's {kv} key/value heads neither divide "
                         f"nor are divided by it (Ulysses splits or replicates them); use a divisor of {kv}")
    check_attention(getattr(cfg, "_attn_implementation", None) or "eager", sp_size, device_type)


def check_attention(name: str, sp_size: int, device_type: str) -> None:
    if sp_size == 1:
        return
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


def groups(sp_size: int) -> SequenceParallel:
    """Collective on first use for a size (every rank makes every group, in the same order)."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    check_world(sp_size, world)
    if sp_size == 1:
        return SequenceParallel(1, None, 0, world, rank)
    if sp_size not in _GROUPS:
        mine = None
        for first in range(0, world, sp_size):
            ranks = list(range(first, first + sp_size))
            group = torch.distributed.new_group(ranks)
            if rank in ranks:
                mine = group
        _GROUPS[sp_size] = mine
    return SequenceParallel(sp_size, _GROUPS[sp_size], rank % sp_size, world // sp_size, rank // sp_size)


def install(model: torch.nn.Module, sp: SequenceParallel) -> None:
    """Route `model`'s attention through Ulysses over `sp.group` while it trains."""
    if sp.size == 1:
        return
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    cfg = model.config.get_text_config()
    name = cfg._attn_implementation  # checked by the engine (check_model_config) before it partitioned the model
    if name not in _ORIGINAL:
        _ORIGINAL[name] = ALL_ATTENTION_FUNCTIONS[name]
        ALL_ATTENTION_FUNCTIONS[name] = _dispatcher(name)
    core = _windowed(_ORIGINAL[name]) if name == "sdpa" else _ORIGINAL[name]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    by_batch: dict[int, UlyssesSPAttentionHF] = {}

    def ulysses(batch_size: int) -> UlyssesSPAttentionHF:
        # Its shapes are fixed per batch size (the positions vary): one instance each.
        if batch_size not in by_batch:
            by_batch[batch_size] = UlyssesSPAttentionHF(
                attn=core, batch_size=batch_size, attn_head_count=cfg.num_attention_heads, attn_head_size=head_dim,
                kv_head_count=cfg.num_key_value_heads or cfg.num_attention_heads,
                num_hidden_layers=cfg.num_hidden_layers, process_group=sp.group, seq_length_is_variable=True)
        return by_batch[batch_size]

    for module in model.modules():
        module._lomo_ds_ulysses = ulysses


def _dispatcher(name: str):
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        ulysses = getattr(module, "_lomo_ds_ulysses", None)
        if ulysses is None or not module.training:
            return _ORIGINAL[name](module, query, key, value, attention_mask, *args, **kwargs)
        # The mask transformers built is the local slice's; causal order comes from the gathered
        # position ids instead (right-padded rows: data/sequence_split.py), the window from `_windowed`.
        groups = getattr(module, "num_key_value_groups", None)
        try:
            return ulysses(query.shape[0])(module, query, key, value, None, *args, **kwargs)
        finally:
            if groups is not None:  # DeepSpeed sets it to its local ratio when it replicates key/value heads
                module.num_key_value_groups = groups
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
