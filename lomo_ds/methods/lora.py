"""LoRA, and LoRA+LOMO (the paper's Table 3).

"lora"       peft LoRA adapters (train.lora: rank, alpha, targets), base frozen, the adapters
             trained by AdamW through DeepSpeed ZeRO-3's own optimizer path (deepspeed_optim).
"lora_lomo"  from one backward, LOMO updates the base weights while AdamW steps the adapters:
             the LomoEngine is told to leave the adapters alone (`lomo.exclude_params` gains
             "*lora_*"), so their gradients stay in `.grad` (full, tiny, unreduced). After the
             engine's step they are averaged over ranks, a torch AdamW steps fp32 copies of them,
             and each rank writes its slice back into the adapters' ZeRO-3 shards.
"""
from __future__ import annotations

# DeepSpeed, transformers, safetensors and peft are imported inside the functions that use them: the
# CLI and the config checks start without them, and recipe/train.py's show_what_matters sets the
# ranks' logging before their first import.
import fnmatch
from typing import Any

import torch

from lomo_ds.config.engine_config import EngineConfig, Precision
from lomo_ds.config.run import LoraConfig
from lomo_ds.methods.deepspeed_optim import linear_lr_factor
from lomo_ds.methods.lomo import LomoMethodEngine
from lomo_ds.runtime import ds_compat
from lomo_ds.runtime.memory import optimizer_state_bytes, tensor_bytes

ADAPTER_PATTERNS = ("*lora_*",)


def apply_lora(model: torch.nn.Module, lora: LoraConfig) -> torch.nn.Module:
    import peft  # optional: only LoRA runs need it (not a core requirement)

    wrapped = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", r=lora.rank, lora_alpha=lora.alpha,
                                                            target_modules=list(lora.targets), lora_dropout=0.0))
    # The embedding's output must require grad, though a frozen embedding needs none: DeepSpeed's
    # ZeRO-3 hooks on a leaf module (zero_optimization.leaf_module, which the shipped configs set to
    # the decoder layer) release the first layer's weights before its backward when the layer's input
    # does not require grad, and the backward then reads a partitioned (empty) adapter weight. This
    # is transformers' own remedy for frozen embeddings (as with gradient checkpointing); it costs the
    # first layer's input gradient.
    wrapped.enable_input_require_grads()
    return wrapped


def one_pass_adapter_grads(adapters: list, device: torch.device, passes: int, loss_scale: float) -> torch.Tensor:
    """The adapters' gradients of ONE unscaled backward pass, flattened in fp32 on `device`.

    Outside LOMO's hooks, an adapter's `.grad` accumulates over every backward pass of the step
    (two with norm clipping or loss scaling), each taken on the scaled loss. Both passes run the
    same graph, so dividing by passes * loss_scale (powers of two) recovers one pass exactly.
    An adapter no rank's graph reached has no `.grad`: it contributes zeros on the engine's device.
    """
    grads = [p.grad if p.grad is not None else torch.zeros(ds_compat.full_shape(p), device=device)
             for p in adapters]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    return flat.div_(passes * loss_scale)


class LoraLomoEngine(LomoMethodEngine):
    method = "lora_lomo"

    def __init__(self, model: torch.nn.Module, ds_config: dict, config: EngineConfig, total_steps: int, *,
                 lora_lr: float, warmup_steps: int, lora_weight_decay: float = 0.0,
                 precision: Precision | None = None):
        names = [n for n, _ in model.named_parameters() if any(fnmatch.fnmatch(n, pat) for pat in ADAPTER_PATTERNS)]
        if not names:
            raise ValueError("lora_lomo needs a peft LoRA model (no lora_ parameters found)")
        for p in model.parameters():
            p.requires_grad_(True)  # peft froze the base; LOMO trains it
        rule = config.lomo
        excluded = list(rule.exclude_params) + [p for p in ADAPTER_PATTERNS if p not in rule.exclude_params]
        config = config.model_copy(update={"lomo": rule.model_copy(update={"exclude_params": excluded})})
        super().__init__(model, ds_config, config, total_steps, precision)
        by_name = dict(self.module.named_parameters())
        self.adapters = [by_name[n] for n in names]
        import deepspeed

        with deepspeed.zero.GatheredParameters(self.adapters, modifier_rank=None):
            self.masters = [p.data.detach().to(self.device, torch.float32, copy=True).requires_grad_(True)
                            for p in self.adapters]
        self.lora_optimizer = torch.optim.AdamW(self.masters, lr=lora_lr, weight_decay=lora_weight_decay)
        self.lora_scheduler = torch.optim.lr_scheduler.LambdaLR(self.lora_optimizer,
                                                                linear_lr_factor(total_steps, warmup_steps))
        self.lora_clip = config.train.clip_grad_norm  # the run's clipping setting, for both halves
        self._adapter_grad_bytes = 0

    def train_step(self, batch: dict[str, Any]) -> dict[str, Any]:
        """One micro-batch. The adapters' gradients accumulate in their `.grad` over the window
        (outside LOMO's hooks); at its end they are unscaled, summed over ranks and divided as the
        LOMO step divides its own (result["normalizer"]: micro-batches x ranks, or tokens)."""
        out = self.engine.train_step(batch)
        if not out["stepped"]:
            return out
        # A window of one micro-batch is a K = 1 step: two backwards with clipping or loss scaling.
        passes = 2 if self.engine.two_passes and out["micro_batches"] == 1 else 1
        flat = one_pass_adapter_grads(self.adapters, self.device, passes, out["loss_scale"])
        held = tensor_bytes(flat) + sum(tensor_bytes(p.grad) for p in self.adapters if p.grad is not None)
        self._adapter_grad_bytes = max(self._adapter_grad_bytes, held)
        if self.world > 1:
            ds_compat.all_reduce(flat, group=self.group)
        out["lora_lr"] = self.lora_optimizer.param_groups[0]["lr"]
        if not out["skipped"]:
            flat.div_(out["normalizer"])
            offset = 0
            for m in self.masters:
                m.grad = flat[offset:offset + m.numel()].view_as(m)
                offset += m.numel()
            clip = self.lora_clip if self.lora_clip else float("inf")
            out["lora_grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.masters, clip))
            self.lora_optimizer.step()
        self.lora_scheduler.step()
        for p, m in zip(self.adapters, self.masters, strict=True):
            p.grad = None
            m.grad = None
        self._write_adapters()
        return out

    def _write_adapters(self) -> None:
        """Each rank copies its slice of the fp32 masters into the adapters' ZeRO-3 shards (the slice
        of each adapter's own process group, as LOMO's update cuts it)."""
        for p, m in zip(self.adapters, self.masters, strict=True):
            # Copied, or rounded into an 8-bit shard (memory.int8_shards) from the whole master.
            self.engine.write_shard(p, m.detach().reshape(-1))
        # The writes are queued on the compute stream after the step's end ordered ZeRO-3's gather
        # stream: order it again, or the next forward may gather adapters half-written.
        self.engine.shards_written()  # and the next forward gathers the new adapters

    # ----------------------------------------------------------------- resume: both halves
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "adapter_masters": [m.detach().cpu() for m in self.masters],
                "lora_optimizer": self.lora_optimizer.state_dict(),
                "lora_scheduler": self.lora_scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        with torch.no_grad():
            for m, saved in zip(self.masters, state["adapter_masters"], strict=True):
                m.copy_(saved)
        self.lora_optimizer.load_state_dict(state["lora_optimizer"])
        self.lora_scheduler.load_state_dict(state["lora_scheduler"])
        self._write_adapters()

    # ----------------------------------------------------------------- memory accounting
    def _grad_bytes(self) -> int:
        return super()._grad_bytes() + self._adapter_grad_bytes

    def _optimizer_bytes(self) -> int:
        return (super()._optimizer_bytes() + sum(tensor_bytes(m) for m in self.masters)
                + optimizer_state_bytes(self.lora_optimizer))
