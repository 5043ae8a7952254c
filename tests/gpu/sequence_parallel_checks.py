"""Sequence parallelism (Ulysses) on GPUs: the CPU suite's whole-row checks (tests/engine/
dist_sp_checks.py) with the engine on CUDA, under sdpa and under flash_attention_2, which a CPU
cannot run. SP 2 needs two ranks: on one GPU the tests skip.

- sdpa, fp32: a sliding window shorter than the row (Mistral, the window mask lomo_ds builds for
  the gathered row), and one key/value head (DeepSpeed replicates it) followed by evaluation and
  generation on whole rows: within fp32 rounding of one process on the whole rows.
- flash_attention_2, bf16 (flash runs in 16 bits): the same window, passed to the kernel as its
  `sliding_window` keyword, step by step against the reference on the same bf16 weights (whole
  rows, sdpa, on the host), with the CPU family matrix's bounds: SGD within 1 + moved/64 ulps (the
  gradient's bf16 error reaches the update as at most 2^-6 of the step), AdaLomo's difference at
  most half the step. A flash path that lost the window misses both (the CPU matrix: 2-198 ulps).
"""
from __future__ import annotations

from functools import partial

from tests.engine import dist_sp_checks as S
from tests.families import sdpa_family

WINDOW = 3  # of S.SEQ = 12 positions


def _mistral(seed: int):
    return sdpa_family("mistral", seed, window=WINDOW)


def _llama_one_kv(seed: int):
    return sdpa_family("llama", seed)


def flash_available() -> str | None:
    """Why flash_attention_2 cannot run here, or None."""
    import torch
    from transformers.utils import is_flash_attn_2_available

    if not torch.cuda.is_available():
        return "flash_attention_2 needs CUDA"
    if not is_flash_attn_2_available():
        return "flash_attention_2 is not installed (the flash-attn package)"
    return None


def flash_steps(optimizer: str) -> dict:
    why = flash_available()
    if why:
        return {"skipped": why}
    return S.bf16_steps(2, optimizer, _mistral, engine_attn="flash_attention_2")


def sequence_parallel_checks(world: int) -> dict:
    if world < 2:
        return {}
    return {
        "sp_sdpa_window": partial(S.equivalence, 2, build=_mistral),
        "sp_sdpa_window_adalomo": partial(S.equivalence, 2, optimizer="adalomo", normalization="tokens",
                                          build=_mistral),
        "sp_sdpa_one_kv_then_eval": partial(S.equivalence, 2, build=_llama_one_kv, evaluate=True),
        "sp_flash_window_sgd": partial(flash_steps, "sgd"),
        "sp_flash_window_adalomo": partial(flash_steps, "adalomo"),
    }
