"""Folders from_pretrained loads, for scripts that build their own Trainer: lomo_ds's built-in
model (`builtin:smollm2-135m`, a GGUF file) converted once into the cache, as the recipe does."""
from __future__ import annotations

import os
import shutil

from lomo_ds.config.run import resolve_model_source
from lomo_ds.storage.models import _cache_dir, _convert_once, _save_gguf_model, drop_gguf_marker


def pretrained_folders(path: str, rank: int = 0, barrier=None) -> tuple[str, str]:
    """(model folder, tokenizer folder) for `path`: a hub name or folder as it is; a GGUF model
    (the built-in one) converted by rank 0 into ~/.cache/lomo_ds (or $LOMO_DS_CACHE), the other
    ranks waiting at `barrier`. Call it before TrainingArguments(deepspeed=...): the conversion
    reads the GGUF file whole, outside ZeRO-3."""
    from transformers import AutoTokenizer

    source, gguf = resolve_model_source(path, None)
    if not gguf:
        return source, source
    model_dir = _cache_dir("models", source, gguf)
    _convert_once(model_dir, "config.json", lambda folder: _save_gguf_model(source, gguf, folder), rank, barrier)
    # The converted config still says quant_method "gguf" (its weights are plain fp32 tensors),
    # which the Trainer refuses as a quantized model: a folder beside it without that entry.
    plain_dir = f"{model_dir}-plain"
    _convert_once(plain_dir, "config.json", lambda folder: _without_gguf_marker(model_dir, folder), rank, barrier)
    tokenizer_dir = _cache_dir("tokenizers", source, gguf)
    _convert_once(tokenizer_dir, "tokenizer_config.json",
                  lambda folder: AutoTokenizer.from_pretrained(source, gguf_file=gguf).save_pretrained(folder),
                  rank, barrier)
    return plain_dir, tokenizer_dir


def _without_gguf_marker(model_dir: str, folder: str) -> None:
    os.makedirs(folder)
    for name in os.listdir(model_dir):
        if name != "config.json":
            os.symlink(os.path.join(model_dir, name), os.path.join(folder, name))
    shutil.copyfile(os.path.join(model_dir, "config.json"), os.path.join(folder, "config.json"))
    drop_gguf_marker(os.path.join(folder, "config.json"))
