"""Packed rows (data.packing) with flash attention: transformers takes flash attention's varlen path
from position ids only for a batch of one row, and its flash mask drops the packed block-diagonal
mask, so with more rows per micro-batch packed examples would attend to each other."""
from __future__ import annotations

from lomo_ds.config.errors import ConfigError


def check_packing(cfg, loading) -> None:
    attn = cfg.model.attn_implementation or ""
    micro = cfg.ds.get("train_micro_batch_size_per_gpu", 1)
    if cfg.data.packing and "flash" in attn and micro != 1:
        raise ConfigError(f"model.attn_implementation: flash attention ({attn!r}) with data.packing needs "
                          f"train_micro_batch_size_per_gpu 1 (got {micro}): with more rows per micro-batch "
                          "packed examples would attend to each other; use 'sdpa', or micro-batches of one row")
