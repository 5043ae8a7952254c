"""Every training method behind one interface (methods.base.Engine), built from the typed run config.

    engine = build_engine(cfg, model, total_steps)   # cfg: lomo_ds.config.run.RunConfig

  "lomo"                    lomo_ds's fused SGD-in-backward (methods/lomo.py)
  "adamw", "sgd"            DeepSpeed ZeRO-3 with its own optimizer (methods/deepspeed_optim.py)
  "lora", "lora_lomo"       peft LoRA on DeepSpeed's AdamW; LoRA adapters + LOMO on the base (methods/lora.py)
  "zero_shot"               no training (methods/zero_shot.py)

Every setting comes from the run config's fields, where the defaults live: the LOMO section for
lomo/lora_lomo (and the clipping of every method), train.baseline_lr / baseline_weight_decay for
adamw/sgd, train.lora for the adapters.
"""
from __future__ import annotations

import torch

from lomo_ds.config.run import METHODS, RunConfig
from lomo_ds.methods.base import Engine, MethodEngine
from lomo_ds.methods.deepspeed_optim import DeepSpeedOptimizerEngine
from lomo_ds.methods.lomo import LomoMethodEngine
from lomo_ds.methods.lora import LoraLomoEngine, apply_lora
from lomo_ds.methods.zero_shot import ZeroShotEngine


def build_engine(cfg: RunConfig, model: torch.nn.Module, total_steps: int) -> Engine:
    """The engine for cfg.train.method over `model`, whose schedules span `total_steps` steps."""
    method = cfg.train.method
    if method not in METHODS:
        raise ValueError(f"train.method: expected one of {list(METHODS)}, got {method!r}")
    if method == "lomo":
        return LomoMethodEngine(model, cfg.ds, cfg.lomo, total_steps, cfg.precision)
    if method == "zero_shot":
        return ZeroShotEngine(model, cfg.ds, param_gather=cfg.lomo.param_gather)
    lora = cfg.train.lora
    if method in ("adamw", "sgd"):
        warmup = int(round(cfg.lomo.scheduler.warmup_ratio * total_steps))
        return DeepSpeedOptimizerEngine(model, cfg.ds, method, method, lr=cfg.train.baseline_lr,
                                        clip=cfg.lomo.clip_grad_norm, total_steps=total_steps, warmup_steps=warmup,
                                        weight_decay=cfg.train.baseline_weight_decay,
                                        param_gather=cfg.lomo.param_gather)
    model = apply_lora(model, lora)
    warmup = int(round(lora.warmup_ratio * total_steps))
    if method == "lora":
        return DeepSpeedOptimizerEngine(model, cfg.ds, method, "adamw", lr=lora.lr, clip=cfg.lomo.clip_grad_norm,
                                        total_steps=total_steps, warmup_steps=warmup,
                                        param_gather=cfg.lomo.param_gather)
    return LoraLomoEngine(model, cfg.ds, cfg.lomo, total_steps, lora_lr=lora.lr, warmup_steps=warmup,
                          precision=cfg.precision)


__all__ = ["METHODS", "Engine", "MethodEngine", "build_engine"]
