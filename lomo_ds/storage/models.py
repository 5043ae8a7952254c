"""Loading models and tokenizers for a run, already partitioned.

Under ZeRO-3 a model is built inside `deepspeed.zero.Init` (transformers does this when an
`HfDeepSpeedConfig` is alive): each parameter is partitioned as soon as it is created and the
checkpoint is loaded shard by shard, so no rank ever holds the whole model. That is the only way
a 65B model loads on 8 x 24 GB.
"""
from __future__ import annotations

import os

import torch

from lomo_ds.config.run import RunConfig, resolve_model_source

_hf_ds_config = None  # transformers consults the live HfDeepSpeedConfig through a weak reference


def _converted_tokenizer_dir(source: str, gguf_file: str) -> str:
    base = os.environ.get("LOMO_DS_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "lomo_ds"))
    stem = os.path.splitext(os.path.basename(gguf_file))[0]
    return os.path.join(base, "tokenizers", stem)


def load_tokenizer(cfg: RunConfig, rank: int = 0, barrier=None):
    """The run's tokenizer. A GGUF tokenizer takes ~30 s to convert: rank 0 converts it once
    into a cache directory, the other ranks (and later runs) load the converted copy."""
    from transformers import AutoTokenizer

    path = cfg.tokenizer_path
    source, gguf = resolve_model_source(path, cfg.model.gguf_file if cfg.tokenizer.path is None else None)
    if gguf:
        cached = _converted_tokenizer_dir(source, gguf)
        if rank == 0 and not os.path.exists(os.path.join(cached, "tokenizer_config.json")):
            tok = AutoTokenizer.from_pretrained(source, gguf_file=gguf)
            tmp = f"{cached}.tmp{os.getpid()}"
            tok.save_pretrained(tmp)
            os.makedirs(os.path.dirname(cached), exist_ok=True)
            if not os.path.exists(cached):
                os.replace(tmp, cached)
        if barrier:
            barrier()
        tok = AutoTokenizer.from_pretrained(cached)
    else:
        tok = AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.model.trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(cfg: RunConfig, ds_config: dict) -> torch.nn.Module:
    """A causal LM built partitioned under ZeRO-3 (any architecture transformers knows)."""
    global _hf_ds_config
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    _hf_ds_config = HfDeepSpeedConfig(ds_config)  # must stay alive while the model is built
    source, gguf = resolve_model_source(cfg.model.path, cfg.model.gguf_file)
    kwargs = {"dtype": cfg.precision.torch_dtype, "trust_remote_code": cfg.model.trust_remote_code}
    if gguf:
        kwargs["gguf_file"] = gguf
    model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    return model


def plain_state_dict(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full state dict under the names the base architecture loads: for a peft LoRA model, every
    adapter merged into its base weight (W + scaling * B @ A, in fp32, back to W's dtype) and the
    wrapper's name parts (base_model.model., .base_layer) removed; any other model as it is."""
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
