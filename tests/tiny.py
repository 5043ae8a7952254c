"""Tiny models, data and tokenizers built locally for tests (nothing is downloaded)."""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 97


def tiny_llama_config(tie: bool = False, layers: int = 2, hidden: int = 40, vocab: int = VOCAB) -> LlamaConfig:
    # Odd sizes on purpose: parameter counts that do not divide by 2 or 3 ranks.
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + 3,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=hidden // 4, max_position_embeddings=64, tie_word_embeddings=tie,
                       attn_implementation="eager")


def save_tiny_model(path, tok) -> None:
    """A tiny LLaMA sized for `tok` (seed 0) and the tokenizer, saved as a Hugging Face folder."""
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config(vocab=len(tok))).save_pretrained(path)
    tok.save_pretrained(path)


def tiny_llama(seed: int = 0, tie: bool = False, layers: int = 2, hidden: int = 40) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(tie=tie, layers=layers, hidden=hidden))
    with torch.no_grad():  # HF initialises norms to exactly 1; perturb so their updates matter
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    return model


class ScaledLlama(torch.nn.Module):
    """A LLaMA with an extra 2-element parameter: smaller than the rank count on 3 ranks."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.llama = tiny_llama(seed)
        torch.manual_seed(seed + 1)
        self.logit_gain = torch.nn.Parameter(torch.tensor([1.0, 0.5]))

    def forward(self, input_ids, labels, attention_mask=None):
        logits = self.llama(input_ids=input_ids).logits * self.logit_gain.sum()
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))


def global_batch(step: int, world: int, micro: int = 2, seq: int = 11, vocab: int = VOCAB) -> list[dict]:
    """The same global batch on every rank, split into `world` micro-batches."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, vocab, (world * micro, seq), generator=g)
    return [{"input_ids": ids[r * micro:(r + 1) * micro], "labels": ids[r * micro:(r + 1) * micro].clone()}
            for r in range(world)]


def engine_sections(options: dict | None = None, **more) -> dict:
    """Engine options named by their keys alone (lr, bucket_size, clip_grad_norm, ...), grouped into
    the config sections whose fields they are (lomo, comm, memory, train): the checks pass options
    through their parameters without caring which section each belongs to."""
    from lomo_ds.config.engine_sections import group_by_section

    return group_by_section({**(options or {}), **more})
