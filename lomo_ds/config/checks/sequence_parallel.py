"""Sequence parallelism (train.sequence_parallel_size): what it needs of the run that the config
alone shows, before any rank starts. What it needs of the ranks, the model's heads and a batch is
checked where those are known (the parallel layout, before the model is built)."""
from __future__ import annotations

from lomo_ds.config.errors import ConfigError


def check_sequence_parallel(cfg, loading) -> None:
    sp = cfg.train.sequence_parallel_size
    if sp == 1:
        return
    if cfg.train.method != "lomo":
        raise ConfigError(f"train.sequence_parallel_size: {sp} ranks a sequence is LOMO's fused update (train.method "
                          f"'lomo'); train.method {cfg.train.method!r} cannot split its sequences")
    if cfg.tokenizer.max_length % sp:
        raise ConfigError(f"tokenizer.max_length: {cfg.tokenizer.max_length} is not divisible by "
                          f"train.sequence_parallel_size {sp} (each rank holds max_length / sp positions)")
    if cfg.data.packing:
        raise ConfigError("data.packing: with train.sequence_parallel_size the attention is causal over the whole "
                          "row (Ulysses drops the mask), so packed examples would attend to each other")
    if cfg.model.attn_implementation in ("eager", "paged|eager"):
        raise ConfigError(f"model.attn_implementation: {cfg.model.attn_implementation!r} builds the S x S mask "
                          "Ulysses cannot split; use 'sdpa' with train.sequence_parallel_size")
