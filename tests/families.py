"""Tiny causal LMs of the model families users fine-tune, built from their transformers configs
(nothing downloaded): LLaMA, Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3, Phi-3, OLMo-2, and the two
MoE families whose experts transformers stacks into one [E, R, C] tensor per projection
(Mixtral, Qwen2-MoE). Odd sizes, as tests/tiny.py's: shards that do not divide by 2 or 3 ranks."""
from __future__ import annotations

import torch
import transformers

from tests.tiny import VOCAB

# family -> (config class, its own extra sizes)
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "mistral": ("MistralConfig", {}),
    "gemma2": ("Gemma2Config", {}),
    "gemma3": ("Gemma3TextConfig", {}),
    "phi3": ("Phi3Config", {}),
    "olmo2": ("Olmo2Config", {}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 21,
                                     "shared_expert_intermediate_size": 31}),
}
MOE = ("mixtral", "qwen2_moe")
# The experts as a loop over the stacked tensors: torch's grouped matmul (the default on a CPU)
# needs rows of a multiple of 16 bytes, which these odd sizes are not. The parameters, and so the
# sharding and the update, are the same either way.
EXPERTS_IMPLEMENTATION = "eager"


def family_config(family: str, layers: int = 2, hidden: int = 40, vocab: int = VOCAB, **overrides):
    cls, extra = FAMILIES[family]
    sizes = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + 3, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="eager", use_cache=False,
        **({"experts_implementation": EXPERTS_IMPLEMENTATION} if family in MOE else {}), **extra)
    return getattr(transformers, cls)(**{**sizes, **overrides})


def tiny_family(family: str, seed: int = 0, layers: int = 2, hidden: int = 40, **overrides):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(family_config(family, layers, hidden, **overrides))
    with torch.no_grad():  # norms start at exactly 1 (or 0 for Gemma's 1 + w): perturb so their updates matter
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    return model


def expert_names(model) -> list[str]:
    """The stacked expert tensors: every parameter of 3 or more dimensions."""
    return [n for n, p in model.named_parameters() if p.dim() >= 3]


def sequence_parallel_variant(family: str, window: int) -> dict:
    """What sequence parallelism (SP = 2) must get right in each family's tiny config, on top of its
    own: the sliding window its real checkpoints use, shorter than the row (`window`), on the layers
    the family applies it to (Qwen2/Qwen3: the layers from max_window_layers on; Qwen2-MoE: the even
    ones below it, named by the module alone; Gemma: alternating local and global layers); one
    key/value head, fewer than SP (DeepSpeed replicates it), in every other family; tied embeddings
    (Gemma's own, and LLaMA tied here). Gemma 2's attention logit softcapping is off: sdpa, the
    attention Ulysses wraps on a CPU, cannot apply it, and refuses a model that asks for it."""
    one_kv = {"num_key_value_heads": 1}
    local_global = {"sliding_window": window, "layer_types": ["sliding_attention", "full_attention"]}
    qwen_window = {"use_sliding_window": True, "sliding_window": window}
    return {
        "llama": {**one_kv, "tie_word_embeddings": True},
        "qwen2": {**qwen_window, "max_window_layers": 1},
        "qwen3": {**one_kv, **qwen_window, "max_window_layers": 1},
        "mistral": {"sliding_window": window},
        "gemma2": {**one_kv, **local_global, "attn_logit_softcapping": None},
        "gemma3": local_global,
        "phi3": {**one_kv, "sliding_window": window},
        "olmo2": {},
        "mixtral": {**one_kv, "sliding_window": window},
        "qwen2_moe": {**qwen_window, "max_window_layers": 2},
    }[family]


def sdpa_family(family: str, seed: int = 0, window: int = 5, **overrides):
    """A tiny model of `family` as sequence parallelism runs it: sdpa attention (what Ulysses wraps
    on a CPU), with `sequence_parallel_variant`'s window, key/value heads and tying."""
    model = tiny_family(family, seed, **{**sequence_parallel_variant(family, window), **overrides})
    model.config._attn_implementation = "sdpa"
    return model
