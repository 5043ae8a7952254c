"""Loading models and tokenizers for a run, already partitioned.

Under ZeRO-3 a model is built inside `deepspeed.zero.Init` (transformers does this when an
`HfDeepSpeedConfig` is alive): each parameter is partitioned as soon as it is created and the
checkpoint is loaded shard by shard, so no rank ever holds the whole model. That is the only way
a 65B model loads on 8 x 24 GB.
"""
from __future__ import annotations

# DeepSpeed, transformers, safetensors and peft are imported inside the functions that use them: the
# CLI and the config checks start without them, and recipe/train.py's show_what_matters sets the
# ranks' logging before their first import.
import json
import os
import shutil
import socket

import torch

from lomo_ds.config import leaf_module
from lomo_ds.config.run import RunConfig, resolve_model_source

_hf_ds_config = None  # transformers consults the live HfDeepSpeedConfig through a weak reference


def _cache_dir(kind: str, source: str, gguf_file: str) -> str:
    """Where a GGUF file's converted tokenizer or model is kept (LOMO_DS_CACHE, else ~/.cache/lomo_ds).
    A model's folder is named by the file's size and time too: a new release of the file is converted
    again."""
    base = os.environ.get("LOMO_DS_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "lomo_ds"))
    stem = os.path.splitext(os.path.basename(gguf_file))[0]
    if kind == "models":
        st = os.stat(os.path.join(source, gguf_file))
        stem = f"{stem}-{st.st_size}-{int(st.st_mtime)}"
    return os.path.join(base, kind, stem)


def _convert_once(cached: str, marker: str, convert, rank: int, barrier) -> None:
    """The first rank of each node (LOCAL_RANK 0; `rank` 0 without a launcher's LOCAL_RANK) writes
    `cached` with convert(folder) unless it holds `marker` already: the cache is on each node's own
    disk, so every node converts its own copy. Into a private folder first, renamed into place
    whole: a run killed mid-conversion leaves nothing half-written, and where nodes share the disk
    the first rename wins. The other ranks wait for it at `barrier`."""
    first_on_node = int(os.environ.get("LOCAL_RANK", rank)) == 0
    if first_on_node and not os.path.exists(os.path.join(cached, marker)):
        tmp = f"{cached}.tmp{socket.gethostname()}.{os.getpid()}"
        convert(tmp)
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        try:
            os.replace(tmp, cached)
        except OSError:  # another job converted it meanwhile (a folder is not replaced once it has files)
            shutil.rmtree(tmp, ignore_errors=True)
    if barrier:
        barrier()


def _save_gguf_model(source: str, gguf_file: str, folder: str) -> None:
    """The GGUF file's model as a plain Hugging Face folder (fp32 safetensors and its config).
    Reading a GGUF file is slow even for a small model (the reader's tensor-name mapping and memory
    maps run in Python), and it has no sharded loading: converted once, every later load is a
    safetensors load, partitioned under ZeRO-3 as any other checkpoint."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # rank 0 alone reads it: whole, not partitioned (no collective)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf_file, dtype=torch.float32)
    os.makedirs(folder, exist_ok=True)
    # save_pretrained refuses a model loaded from GGUF; the dequantized weights are plain tensors.
    save_model(model, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(folder)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(folder)


def drop_gguf_marker(config_file: str) -> None:
    """Remove quant_method "gguf" from a config.json written for a model read from a GGUF file. The
    tensors such a model holds are plain dequantized ones, but its config keeps the entry, and the
    Trainer refuses a model whose config has it as "purely quantized"."""
    with open(config_file) as f:
        config = json.load(f)
    if config.get("quantization_config", {}).get("quant_method") == "gguf":
        del config["quantization_config"]
        with open(config_file, "w") as f:
            f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_tokenizer(cfg: RunConfig, rank: int = 0, barrier=None):
    """The run's tokenizer. Converting a GGUF tokenizer is slow (it reads the whole file): rank 0
    converts it once into a cache folder, the other ranks (and later runs) load the converted copy."""
    from transformers import AutoTokenizer

    path = cfg.tokenizer_path
    source, gguf = resolve_model_source(path, cfg.model.gguf_file if cfg.tokenizer.path is None else None)
    if gguf:
        cached = _cache_dir("tokenizers", source, gguf)
        _convert_once(cached, "tokenizer_config.json",
                      lambda folder: AutoTokenizer.from_pretrained(source, gguf_file=gguf).save_pretrained(folder),
                      rank, barrier)
        tok = AutoTokenizer.from_pretrained(cached)
    else:
        tok = AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.model.trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(cfg: RunConfig, ds_config: dict, rank: int = 0, barrier=None) -> torch.nn.Module:
    """A causal LM built partitioned under ZeRO-3 (any architecture transformers knows). A GGUF
    model is converted once by rank 0 into a cache folder (`barrier`: every rank waits for it)."""
    global _hf_ds_config
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    source, gguf = resolve_model_source(cfg.model.path, cfg.model.gguf_file)
    if gguf:
        cached = _cache_dir("models", source, gguf)
        _convert_once(cached, "config.json", lambda folder: _save_gguf_model(source, gguf, folder), rank, barrier)
        source = cached
    # Must stay alive while the model is built; DeepSpeed parses it whole, so an unresolved
    # leaf_module "auto" (resolved against the built model by the engine) is left out.
    _hf_ds_config = HfDeepSpeedConfig(leaf_module.for_model_build(ds_config))
    extra = {"attn_implementation": cfg.model.attn_implementation} if cfg.model.attn_implementation else {}
    model = AutoModelForCausalLM.from_pretrained(source, dtype=cfg.precision.torch_dtype,
                                                 trust_remote_code=cfg.model.trust_remote_code, **extra)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    return model


def model_config(cfg: RunConfig):
    """The model's transformers config, read without building the model (None for a GGUF file not
    converted yet: the engine checks the built model then), its attention as it will be loaded with."""
    from transformers import AutoConfig

    source, gguf = resolve_model_source(cfg.model.path, cfg.model.gguf_file)
    if gguf:  # its converted folder, once a run has made it
        source = _cache_dir("models", source, gguf)
        if not os.path.isfile(os.path.join(source, "config.json")):
            return None
    config = AutoConfig.from_pretrained(source, trust_remote_code=cfg.model.trust_remote_code)
    # transformers' default where the model supports it, as from_pretrained would choose.
    config._attn_implementation = cfg.model.attn_implementation or "sdpa"
    return config


def release_model_build_config() -> None:
    """End what load_model began: transformers stops building models partitioned under ZeRO-3.
    Without it every model the process builds later (a reference model, a second run's) is built
    under zero.Init with this run's config."""
    global _hf_ds_config
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    _hf_ds_config = None
    unset_hf_deepspeed_config()


def plain_state_dict(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full state dict (or a part of one holding whole LoRA layers) under the names the base
    architecture loads: for a peft LoRA model, every adapter merged into its base weight
    (W + scaling * B @ A, in fp32, back to W's dtype) and the wrapper's name parts
    (base_model.model., .base_layer) removed; any other model as it is."""
    try:
        from peft import PeftModel
        from peft.tuners.lora import LoraLayer
    except ImportError:  # no peft: no LoRA model either
        return state
    if not isinstance(module, PeftModel):
        return state
    state = dict(state)
    for name, layer in module.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        weight = f"{name}.base_layer.weight"
        if weight not in state:  # a part of the model (export_hf writes it a file at a time)
            continue
        for adapter, scaling in layer.scaling.items():
            if layer.use_dora.get(adapter):
                raise ValueError(f"{name}: DoRA adapters are not merged by this export")
            a, b = state.pop(f"{name}.lora_A.{adapter}.weight"), state.pop(f"{name}.lora_B.{adapter}.weight")
            delta = (b.float() @ a.float()) * scaling
            if layer.fan_in_fan_out:
                delta = delta.T
            state[weight] = (state[weight].float() + delta).to(state[weight].dtype)
    prefix = "base_model.model."
    return {k[len(prefix):].replace(".base_layer.", ".") if k.startswith(prefix) else k: v for k, v in state.items()}
