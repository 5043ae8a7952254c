"""LomoEngine: DeepSpeed ZeRO-3 for parameters, lomo_ds for gradients and updates.

DeepSpeed, given no optimizer, partitions the model and gathers/releases each layer's
parameters around its forward and backward. lomo_ds hooks every parameter: when its gradient
is ready it goes into a reduce-scatter bucket, and each rank updates its own slice of the shard
in place (see fused_update.py). One step = one forward and one or two backward passes:

  one pass   plain SGD / value clipping / bf16 / fp32: update as gradients arrive.
  two passes clip by global norm, or fp16 loss scaling: the first pass only measures (this rank's
             sum of squares of its reduced shards, all-reduced into the exact global norm, and
             whether anything overflowed); the second applies the update scaled by
             min(1, max_norm / norm), or the whole step is skipped on every rank on overflow.
             The second pass reuses the first pass's graph (retain_graph) instead of paying a
             second forward, unless two_pass_mode is "recompute".
"""
from __future__ import annotations

import fnmatch
import math
import os
from typing import Any

import torch

from . import ds_compat
from .config import LomoConfig, load_config, model_dtype
from .buckets import ReduceScatterBuckets
from .comm_stats import StepTimers
from .fused_update import ShardUpdater, UpdateRule
from .memory import MemoryTracker
from .precision import DynamicLossScaler
from .schedule import Schedule

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def initialize(model: torch.nn.Module, config: dict | str | os.PathLike) -> "LomoEngine":
    """Wrap `model` (already partitioned by zero.Init, or a plain module) in a LomoEngine."""
    ds_config, lomo = load_config(config)
    return LomoEngine(model, ds_config, lomo)


def init_distributed() -> None:
    """Start the process group once (gloo on a CPU, NCCL on GPUs: DeepSpeed's accelerator picks)."""
    import deepspeed

    if not torch.distributed.is_initialized():
        deepspeed.init_distributed()


def loss_of(outputs) -> torch.Tensor:
    """The loss of a model's outputs (a tensor, or a dict/ModelOutput with "loss")."""
    loss = outputs if torch.is_tensor(outputs) else outputs["loss"]
    if loss is None:
        raise ValueError("the model returned no loss: pass `labels` in the batch")
    return loss


def mean_over_ranks(value: float, world: int, group=None) -> float:
    # fp32: 4 bytes on the wire per step are enough for a reported loss.
    v = torch.tensor([float(value)], dtype=torch.float32)
    if world > 1:
        ds_compat.all_reduce(v, group=group)
    return v.item() / world


def gather_full_state_dict(module: torch.nn.Module, rank: int) -> dict[str, torch.Tensor] | None:
    """Collective: full parameters by name on rank 0 (None elsewhere), gathered one at a time.
    A tied tensor appears under each of its names."""
    import deepspeed

    state: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            if rank == 0:
                state[name] = state[seen[id(p)]]
            continue
        seen[id(p)] = name
        if ds_compat.is_zero_param(p):
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                if rank == 0:
                    state[name] = p.data.detach().to("cpu", copy=True)
        elif rank == 0:
            state[name] = p.data.detach().to("cpu", copy=True)
    return state if rank == 0 else None


class LomoEngine:
    def __init__(self, model: torch.nn.Module, ds_config: dict, lomo: LomoConfig):
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        init_distributed()
        self.config = lomo
        self.ds_config = ds_config
        self.dtype = model_dtype(ds_config)
        self.ds_engine, *_ = deepspeed.initialize(model=model, config=ds_config,
                                                  model_parameters=None, optimizer=None)
        self.module = self.ds_engine.module
        self.offload = ds_compat.offload_of(self.ds_engine)
        # module.parameters() lists a tied tensor once: it gets one hook and one update with the
        # gradient autograd has already summed over its uses. Parameters matching
        # lomo.exclude_params (e.g. LoRA adapters stepped by another optimizer) keep plain .grad.
        self.params = [p for n, p in self.module.named_parameters()
                       if p.requires_grad and not any(fnmatch.fnmatch(n, pat) for pat in lomo.exclude_params)]
        if not self.params:
            raise ValueError("model has no trainable parameters")
        missing = ds_compat.check_param_attrs(self.params[0])
        if missing:
            raise RuntimeError(f"DeepSpeed ZeRO-3 parameter attributes missing: {missing}")
        self.group = ds_compat.process_group(self.params[0])
        # The shard index is this rank's place in the parameters' data-parallel group: right on
        # any number of nodes, unlike LOCAL_RANK.
        self.world = torch.distributed.get_world_size(self.group)
        self.rank = torch.distributed.get_rank(self.group)

        self.updater = ShardUpdater(self.world, self.rank, lomo.stochastic_rounding, lomo.fp32_master_weights,
                                    lomo.seed)
        if lomo.fp32_master_weights and self.dtype != torch.float32:
            self.updater.init_masters(self.params)
        self.memory: MemoryTracker | None = None
        reduce_dtype = _DTYPES[lomo.reduce_dtype] if lomo.reduce_dtype else None
        # Off by default (costs nothing); experiments/bench_step.py turns it on for the breakdown.
        self.timers = StepTimers()
        self.buckets = ReduceScatterBuckets(self.params, self.group, self.world, self.rank, lomo.bucket_size,
                                            reduce_dtype, self.updater.apply_bucket,
                                            device=torch.device(get_accelerator().current_device_name()),
                                            all_reduce=lomo.grad_reduction == "all_reduce", timers=self.timers)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]

        scale_on = lomo.loss_scale.enabled if lomo.loss_scale.enabled is not None else self.dtype == torch.float16
        self.loss_scaler = DynamicLossScaler(scale=2.0**lomo.loss_scale.initial_scale_power,
                                             window=lomo.loss_scale.window,
                                             min_scale=lomo.loss_scale.min_scale) if scale_on else None
        self.schedule = self._make_schedule(lomo)
        self.global_step = 0  # optimizer steps taken (skipped ones included: the schedule moves on)
        self.skipped_steps = 0

    # ----------------------------------------------------------------- configuration
    @staticmethod
    def _make_schedule(lomo: LomoConfig) -> Schedule:
        s = lomo.scheduler
        if s.type != "constant" and s.total_steps <= 0:
            raise ValueError(f"lomo.scheduler.total_steps: a {s.type} schedule needs the total step count")
        warmup = s.warmup_steps or int(round(s.warmup_ratio * s.total_steps))
        return Schedule(s.type, lomo.lr, s.total_steps, warmup, s.min_lr_ratio)

    @property
    def two_passes(self) -> bool:
        return self.config.clip_grad_norm is not None or self.loss_scaler is not None

    def enable_memory_tracking(self) -> MemoryTracker:
        self.memory = MemoryTracker(self.params, master_bytes=sum(m.numel() * 4 for m in self.updater.masters.values()))
        self.buckets.tracker = self.memory
        return self.memory

    # ----------------------------------------------------------------- the step
    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        with self.timers.span("hook"):
            if self.memory is not None:
                self.memory.sample()
            grad = param.grad
            param.grad = None  # the bucket holds the only reference now; freed once packed
            self.buckets.add(param, grad)
            del grad

    def _backward(self, loss: torch.Tensor, retain_graph: bool) -> None:
        self.buckets.reset()
        loss.backward(retain_graph=retain_graph)
        with self.timers.span("flush"):
            self.buckets.flush()

    def forward(self, batch: dict[str, Any]):
        return self.module(**batch)

    def train_step(self, batch: dict[str, Any]) -> dict[str, Any]:
        """One optimizer step on this rank's micro-batch."""
        self.module.train()
        lr = self.schedule.lr_at(self.global_step)
        loss_scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        self.updater.reseed(self.config.seed, self.global_step)
        grad_scale = 1.0 / (self.world * loss_scale)  # averaged over ranks, unscaled
        result = {"lr": lr, "loss_scale": loss_scale, "grad_norm": None, "skipped": False}

        loss = loss_of(self.forward(batch))
        if self.two_passes:
            retain = self.config.two_pass_mode == "retain_graph"
            counters = ds_compat.snapshot_backward_counters(self.module) if retain else None
            self.updater.measuring = True
            self.updater.stats.sum_sq = 0.0
            self.updater.rule = UpdateRule(lr=lr, grad_scale=grad_scale)
            self._backward(loss * loss_scale, retain_graph=retain)
            self.updater.measuring = False
            # A non-finite bucket is never handed to the update rule: it counts as an overflow.
            sum_sq = math.inf if self.buckets.found_nonfinite else self.updater.stats.sum_sq
            total = torch.tensor([sum_sq if math.isfinite(sum_sq) else 0.0, 0.0 if math.isfinite(sum_sq) else 1.0],
                                 dtype=torch.float64)
            if self.world > 1:
                ds_compat.all_reduce(total, group=self.group)
            norm = math.sqrt(total[0].item()) if total[1].item() == 0 and math.isfinite(total[0].item()) else math.inf
            result["grad_norm"] = norm
            if not math.isfinite(norm):
                # Overflow somewhere on some rank: every rank skips, no parameter is touched.
                del loss
                self._end_step()
                if self.loss_scaler is not None:
                    self.loss_scaler.update(overflow=True)
                self.skipped_steps += 1
                self.global_step += 1
                result.update(skipped=True, loss=math.nan)
                return result
            coef = 1.0
            if self.config.clip_grad_norm is not None:
                coef = min(1.0, self.config.clip_grad_norm / (norm + 1e-6))  # as torch's clip_grad_norm_
            if retain:
                ds_compat.restore_backward_counters(counters)
            else:
                loss = loss_of(self.forward(batch))
            self.updater.rule = UpdateRule(lr=lr, grad_scale=grad_scale * coef, clip_value=self.config.clip_grad_value,
                                           weight_decay=self.config.weight_decay)
            self._backward(loss * loss_scale, retain_graph=False)
        else:
            self.updater.rule = UpdateRule(lr=lr, grad_scale=grad_scale, clip_value=self.config.clip_grad_value,
                                           weight_decay=self.config.weight_decay)
            self._backward(loss * loss_scale, retain_graph=False)
        self._end_step(updated=True)
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow=False)
        self.global_step += 1
        result["loss"] = mean_over_ranks(loss.detach().float().item(), self.world, self.group)
        return result

    def _end_step(self, updated: bool = False) -> None:
        ds_compat.release_all(self.offload)
        if updated:
            ds_compat.regather_persistent(self.offload)
        for p in self.params:
            p.grad = None

    # ----------------------------------------------------------------- evaluation and state
    @torch.no_grad()
    def eval_forward(self, batch: dict[str, Any]):
        self.module.eval()
        out = self.forward(batch)
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective: the full parameters by name on rank 0 (None elsewhere), one at a time."""
        return gather_full_state_dict(self.module, self.rank)

    def shard_state_dict(self) -> dict[str, Any]:
        """This rank's part of a resumable checkpoint: its shards, masters and the step state."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        return {
            "world": self.world,
            "rank": self.rank,
            "shards": {names[id(p)]: ds_compat.shard(p).detach().cpu().clone() for p in self.params},
            "masters": {names[id(p)]: self.updater.masters[ds_compat.param_id(p)].cpu().clone()
                        for p in self.params if ds_compat.param_id(p) in self.updater.masters},
            "global_step": self.global_step,
            "skipped_steps": self.skipped_steps,
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None,
        }

    def load_shard_state_dict(self, state: dict[str, Any]) -> None:
        if state["world"] != self.world or state["rank"] != self.rank:
            raise ValueError(f"checkpoint shard was written by rank {state['rank']} of {state['world']}, "
                             f"this is rank {self.rank} of {self.world}")
        by_name = dict(self.module.named_parameters())
        for name, tensor in state["shards"].items():
            if name not in by_name:
                raise ValueError(f"checkpoint has parameter {name!r}, the model does not")
            ds_compat.shard(by_name[name]).copy_(tensor)
        for name, tensor in state["masters"].items():
            self.updater.masters[ds_compat.param_id(by_name[name])].copy_(tensor)
        self.global_step = state["global_step"]
        self.skipped_steps = state["skipped_steps"]
        if self.loss_scaler is not None and state["loss_scaler"] is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        ds_compat.release_all(self.offload)
        ds_compat.regather_persistent(self.offload)
