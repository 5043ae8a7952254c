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


def family_config(family: str, layers: int = 2, hidden: int = 40, vocab: int = VOCAB):
    cls, extra = FAMILIES[family]
    return getattr(transformers, cls)(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + 3, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="eager", use_cache=False,
        **({"experts_implementation": EXPERTS_IMPLEMENTATION} if family in MOE else {}), **extra)


def tiny_family(family: str, seed: int = 0, layers: int = 2, hidden: int = 40):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(family_config(family, layers, hidden))
    with torch.no_grad():  # norms start at exactly 1 (or 0 for Gemma's 1 + w): perturb so their updates matter
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    return model


def expert_names(model) -> list[str]:
    """The stacked expert tensors: every parameter of 3 or more dimensions."""
    return [n for n, p in model.named_parameters() if p.dim() >= 3]
