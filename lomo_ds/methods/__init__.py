"""Every training method behind one interface (methods.base.Engine), built from the typed run config.

    engine = build_engine(cfg, model, total_steps)   # cfg: lomo_ds.config.run.RunConfig

  "lomo"                    lomo_ds's fused SGD-in-backward (methods/lomo.py)
  "adamw", "sgd"            DeepSpeed ZeRO-3 with its own optimizer (methods/deepspeed_optim.py)
  "lora", "lora_lomo"       peft LoRA on DeepSpeed's AdamW; LoRA adapters + LOMO on the base (methods/lora.py)
  "zero_shot"               no training (methods/zero_shot.py)

Every setting comes from the run config's fields, where the defaults live: the engine's sections
(lomo, comm, memory, and train's clipping, schedule and accumulation) for lomo/lora_lomo;
train.lr / train.weight_decay (null lr: the method's default, run.DEFAULT_LR), train's clipping
and schedule and comm.param_gather for adamw/sgd/lora; train.lora for the adapters. No baseline
reads the lomo section.
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
        engine = LomoMethodEngine(model, cfg.ds, cfg.engine, total_steps, cfg.precision)
        engine.io_timeout = cfg.output.io_timeout  # its checkpoint's collectives wait on disks
        return engine
    if method == "zero_shot":
        return ZeroShotEngine(model, cfg.ds, param_gather=cfg.comm.param_gather)
    train = cfg.train
    if method in ("adamw", "sgd"):
        warmup = int(round(train.scheduler.warmup_ratio * total_steps))
        return DeepSpeedOptimizerEngine(model, cfg.ds, method, method, lr=train.optimizer_lr,
                                        clip=train.clip_grad_norm, total_steps=total_steps, warmup_steps=warmup,
                                        weight_decay=train.weight_decay, param_gather=cfg.comm.param_gather)
    model = apply_lora(model, train.lora)
    warmup = int(round(train.lora.warmup_ratio * total_steps))
    if method == "lora":
        return DeepSpeedOptimizerEngine(model, cfg.ds, method, "adamw", lr=train.optimizer_lr,
                                        clip=train.clip_grad_norm, total_steps=total_steps, warmup_steps=warmup,
                                        weight_decay=train.weight_decay, param_gather=cfg.comm.param_gather)
    engine = LoraLomoEngine(model, cfg.ds, cfg.engine, total_steps, lora_lr=train.optimizer_lr, warmup_steps=warmup,
                            lora_weight_decay=train.weight_decay, precision=cfg.precision)
    engine.io_timeout = cfg.output.io_timeout
    return engine

__all__ = ["METHODS", "Engine", "MethodEngine", "build_engine"]
