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

Before any backward, one all-reduce of three numbers agrees on the loss: a non-finite loss on
any rank skips the step on every rank with no weight touched. A gradient that turns non-finite
only in a backward is flagged by the buckets on every rank at once; the step is then skipped
from that bucket on. After lomo.max_consecutive_skips skipped steps in a row the run stops.

lomo.optimizer "adalomo" swaps the SGD update for AdaLomo's (lomo_ds/engine/adalomo.py) on the same
reduced shards and passes; its state goes into the shard checkpoint and the memory tracker.
"""
from __future__ import annotations

import fnmatch
import math
import os
from typing import Any

import torch

from lomo_ds.config.lomo import LomoConfig, Precision, load_config
from lomo_ds.engine.adalomo import AdaLomo
from lomo_ds.engine.buckets import GradientBuckets
from lomo_ds.engine.comm_stats import StepTimers
from lomo_ds.engine.fused_update import PassStats, ShardGeometries, ShardUpdater, UpdateRule
from lomo_ds.engine.precision import DynamicLossScaler
from lomo_ds.engine.schedule import Schedule
from lomo_ds.planning.memory import MemoryTracker
from lomo_ds.runtime import ds_compat
from lomo_ds.runtime.device import accelerator_device, capture_rng, move_batch, restore_rng
from lomo_ds.runtime.dist import gather_full_state_dict, has_labelled_tokens, init_distributed, loss_of, sum_over_ranks

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def initialize(model: torch.nn.Module, config: dict | str | os.PathLike,
               total_steps: int | None = None) -> "LomoEngine":
    """Wrap `model` (already partitioned by zero.Init, or a plain module) in a LomoEngine.
    `total_steps`, when given, wins over lomo.scheduler.total_steps."""
    ds_config, lomo = load_config(config)
    return LomoEngine(model, ds_config, lomo, total_steps=total_steps, precision=Precision.of(ds_config))


class LomoEngine:
    def __init__(self, model: torch.nn.Module, ds_config: dict, lomo: LomoConfig, total_steps: int | None = None,
                 precision: Precision | None = None):
        """`ds_config` goes to deepspeed.initialize as it is; the engine reads its settings from the
        typed `lomo` section and `precision` (default: read from `ds_config`'s fp16/bf16)."""
        import deepspeed

        init_distributed(timeout_s=lomo.collective_timeout)
        self.config = lomo
        self.ds_config = ds_config
        self.dtype = (precision or Precision.of(ds_config)).torch_dtype
        self.schedule = self._make_schedule(lomo, total_steps)
        # This rank's device: batches are moved here and every tensor the engine makes lives here.
        self.device = accelerator_device()
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
        # Every rank is a data-parallel rank (no tensor or pipeline parallelism): the loss and the
        # norm are reduced over all of them, and every parameter must be sharded over all of them
        # (the buckets refuse a group that does not span them). Shard indices come from each
        # parameter's own group (ShardUpdater).
        self.group = torch.distributed.group.WORLD
        self.world = torch.distributed.get_world_size(self.group)
        self.rank = torch.distributed.get_rank(self.group)

        # Shards live on the accelerator, or in host memory with offload_param: the update runs
        # where each one lives; the pass statistics stay on this rank's device.
        geometries = ShardGeometries()
        adalomo = (AdaLomo(lomo.adalomo, self.module, self.params, self.group, geometries)
                   if lomo.optimizer == "adalomo" else None)
        masters = self.params if lomo.fp32_master_weights and self.dtype != torch.float32 else ()
        self.updater = ShardUpdater(lomo.stochastic_rounding, lomo.seed, self.device, geometries, adalomo, masters)
        self.memory: MemoryTracker | None = None
        # Each parameter is reduced over its own ds_process_group: one bucket set per group.
        reduce_dtype = _DTYPES[lomo.reduce_dtype] if lomo.reduce_dtype else None
        # Off by default (costs nothing); experiments/bench_step.py turns it on for the breakdown.
        self.timers = StepTimers(device=self.device)
        # One object for every parameter: it splits them by their own ds_process_group and refuses
        # a group that does not span every rank.
        self.buckets = GradientBuckets(self.params, self.group, self.world, self.rank, lomo.bucket_size,
                                       reduce_dtype, self.updater.apply_bucket, device=self.device,
                                       transport=lomo.grad_reduction, max_in_flight=lomo.max_in_flight,
                                       timers=self.timers, timeout_s=lomo.collective_timeout,
                                       sparse=[p for n, p in self.module.named_parameters() if p.requires_grad
                                               and any(fnmatch.fnmatch(n, pat) for pat in lomo.sparse_params)])
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]

        scale_on = lomo.loss_scale.enabled if lomo.loss_scale.enabled is not None else self.dtype == torch.float16
        self.loss_scaler = DynamicLossScaler(scale=2.0**lomo.loss_scale.initial_scale_power,
                                             window=lomo.loss_scale.window,
                                             min_scale=lomo.loss_scale.min_scale) if scale_on else None
        self.global_step = 0  # optimizer steps taken (skipped ones included: the schedule moves on)
        self.skipped_steps = 0
        self.consecutive_skips = 0

    # ----------------------------------------------------------------- configuration
    @staticmethod
    def _make_schedule(lomo: LomoConfig, total_steps: int | None) -> Schedule:
        s = lomo.scheduler
        total = s.total_steps if total_steps is None else total_steps
        if total < 0:
            raise ValueError(f"total_steps: expected >= 0, got {total}")
        if s.type != "constant" and total <= 0:
            raise ValueError(f"lomo.scheduler.total_steps: a {s.type} schedule needs the total step count "
                             f"(or pass total_steps= to the engine)")
        warmup = s.warmup_steps or int(round(s.warmup_ratio * total))
        return Schedule(s.type, lomo.lr, total, warmup, s.min_lr_ratio)

    @property
    def two_passes(self) -> bool:
        return self.config.clip_grad_norm is not None or self.loss_scaler is not None

    def enable_memory_tracking(self) -> MemoryTracker:
        self.memory = MemoryTracker(self.params, master_bytes=sum(m.numel() * 4 for m in self.updater.masters.values()),
                                    state_bytes=self.updater.adalomo.state_bytes() if self.updater.adalomo else 0)
        self.buckets.track_memory(self.memory)
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

    def _backward(self, loss: torch.Tensor, rule: UpdateRule, measure: bool, retain_graph: bool) -> PassStats:
        """One backward pass (measuring, or updating by `rule`); its statistics stay on the device
        (the buckets fold every bucket's verdict into them, and from the first non-finite bucket
        on apply nothing more)."""
        stats = self.updater.begin_pass(rule, measure=measure, step=self.global_step)
        self.buckets.reset(stats)
        try:
            loss.backward(retain_graph=retain_graph)
            with self.timers.span("flush"):
                self.buckets.flush()
        except BaseException:
            self.buckets.abandon()
            raise
        return stats

    def forward(self, batch: dict[str, Any]):
        return self.module(**batch)

    def _agree_on_loss(self, loss: torch.Tensor, labelled: bool) -> tuple[float, bool, bool]:
        """Before any backward, ONE all-reduce of three fp32 numbers: the summed loss of the ranks
        with labelled tokens, how many such ranks, and how many of them have a non-finite loss.
        Returns (the mean loss over the labelled ranks, some loss is non-finite, no rank has labels)."""
        value = float(loss.detach()) if labelled else 0.0  # an unlabelled batch's loss is 0/0
        finite = math.isfinite(value)
        total, n_labelled, n_nonfinite = sum_over_ranks(
            [value if finite else 0.0, float(labelled), float(not finite)], self.world, self.group, name="loss")
        if n_nonfinite or not n_labelled:
            return math.nan, n_nonfinite > 0, n_labelled == 0
        return total / n_labelled, False, False

    def train_step(self, batch: dict[str, Any]) -> dict[str, Any]:
        """One optimizer step on this rank's micro-batch."""
        self.module.train()
        batch = move_batch(batch, self.device)
        lr = self.schedule.lr_at(self.global_step)
        loss_scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        grad_scale = 1.0 / (self.world * loss_scale)  # averaged over ranks, unscaled
        result = {"lr": lr, "loss_scale": loss_scale, "grad_norm": None, "skipped": False}
        recompute = self.two_passes and self.config.two_pass_mode == "recompute"
        rng = capture_rng(self.device) if recompute else None

        labelled = has_labelled_tokens(batch)
        loss = loss_of(self.forward(batch))
        result["loss"], nonfinite, unlabelled = self._agree_on_loss(loss, labelled)
        if nonfinite or unlabelled:
            # A non-finite loss on some rank (or nothing to learn anywhere): known before the
            # backward, so no rank starts one.
            del loss
            return self._skip(result, overflow=nonfinite)
        if not labelled:
            # Nothing to learn on this rank, but its backward still runs (ZeRO-3's gathers and
            # the reduce-scatter are collectives) and contributes a zero gradient. transformers'
            # 0/0 loss already back-propagates zeros; a model's own loss may not.
            loss = loss * 0.0
        if self.two_passes:
            retain = not recompute
            counters = ds_compat.snapshot_backward_counters(self.module) if retain else None
            stats = self._backward(loss * loss_scale, UpdateRule(lr=lr, grad_scale=grad_scale), measure=True,
                                   retain_graph=retain)
            # fp64, and a non-finite sum stays non-finite through the sum: 8 bytes carry both, and
            # reading the reduced sum is the pass's one host sync.
            (total,) = sum_over_ranks(stats.norm_sq_or_inf().reshape(1), self.world, self.group,
                                      name="squared norm")
            norm = math.sqrt(total) if math.isfinite(total) else math.inf
            result["grad_norm"] = norm
            if not math.isfinite(norm):
                # Overflow somewhere on some rank: every rank skips, no parameter is touched.
                del loss
                return self._skip(result, overflow=True)
            coef = 1.0
            if self.config.clip_grad_norm is not None:
                coef = min(1.0, self.config.clip_grad_norm / (norm + 1e-6))  # as torch's clip_grad_norm_
            if retain:
                ds_compat.restore_backward_counters(counters)
            else:
                # The same random draws (dropout) as the measured forward: the same graph.
                restore_rng(rng, self.device)
                loss = loss_of(self.forward(batch))
                if not labelled:
                    loss = loss * 0.0
            grad_scale *= coef
        rule = UpdateRule(lr=lr, grad_scale=grad_scale, clip_value=self.config.clip_grad_value,
                          weight_decay=self.config.weight_decay)
        stats = self._backward(loss * loss_scale, rule, measure=False, retain_graph=False)
        # The pass's one read, agreed over the ranks (a slice that overflowed only in the last
        # bucket's reduction is known to its own rank alone until now).
        (nonfinite_ranks,) = sum_over_ranks((~stats.finite).to(torch.float32).reshape(1), self.world, self.group,
                                            name="non-finite flag")
        if nonfinite_ranks:
            # Non-finite in the updating pass: the buckets before it were applied, none after.
            return self._skip(result, overflow=True)
        self._end_step()
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow=False)
        self.consecutive_skips = 0
        self.global_step += 1
        return result

    def _skip(self, result: dict[str, Any], overflow: bool) -> dict[str, Any]:
        """End a step every rank skips; stop the run when skipping has become the rule."""
        self._end_step()
        if self.loss_scaler is not None and overflow:
            self.loss_scaler.update(overflow=True)
        self.skipped_steps += 1
        self.consecutive_skips += 1
        self.global_step += 1
        result["skipped"] = True
        if self.consecutive_skips >= self.config.max_consecutive_skips:
            scale = f", loss scale {self.loss_scaler.scale}" if self.loss_scaler is not None else ""
            raise RuntimeError(f"lomo.max_consecutive_skips: the last {self.consecutive_skips} steps were all skipped "
                               f"(non-finite loss or gradients, or no labelled tokens on any rank{scale}), "
                               f"{self.global_step} steps into the run; lower lomo.lr, check the data, or raise "
                               "the limit")
        return result

    def _end_step(self) -> None:
        # The last bucket's update (the embeddings and first layer: what the next forward gathers
        # first) was queued on the compute stream; DeepSpeed gathers on its own stream.
        ds_compat.gathers_wait_for_updates(self.offload)
        # Every parameter goes back to its shard, persistent ones included, so the next forward
        # gathers each from its updated shard (a gathered copy kept across an update is stale).
        ds_compat.release_all(self.offload)
        for p in self.params:
            p.grad = None

    # ----------------------------------------------------------------- evaluation and state
    @torch.no_grad()
    def eval_forward(self, batch: dict[str, Any]):
        self.module.eval()
        return self.forward(move_batch(batch, self.device))

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
            "consecutive_skips": self.consecutive_skips,
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None,
            "adalomo": self.updater.adalomo.state_dict() if self.updater.adalomo else None,
        }

    def load_shard_state_dict(self, state: dict[str, Any]) -> None:
        if state["world"] != self.world or state["rank"] != self.rank:
            raise ValueError(f"checkpoint shard was written by rank {state['rank']} of {state['world']}, "
                             f"this is rank {self.rank} of {self.world}")
        by_name = dict(self.module.named_parameters())
        for name in state["shards"]:
            if name not in by_name:
                raise ValueError(f"checkpoint has parameter {name!r}, the model does not")
        names = {id(p): n for n, p in by_name.items()}
        for p in self.params:
            name = names[id(p)]
            if name not in state["shards"]:
                raise ValueError(f"checkpoint has no shard of {name!r}, which this run trains")
            if ds_compat.param_id(p) in self.updater.masters and name not in state["masters"]:
                # Left at its pretrained value, the master would overwrite the trained shard at
                # the first update.
                raise ValueError(f"checkpoint has no fp32 master of {name!r}: it was written without "
                                 f"lomo.fp32_master_weights; resume with the setting it was written with")
        for name, tensor in state["shards"].items():
            ds_compat.shard(by_name[name]).copy_(tensor)
        for name in state["masters"]:
            master = self.updater.masters.get(ds_compat.param_id(by_name[name]))
            if master is not None:
                master.copy_(state["masters"][name])
        if self.updater.adalomo is not None:
            if not state.get("adalomo"):
                raise ValueError("checkpoint shard has no AdaLomo state (written with lomo.optimizer 'sgd'); "
                                 "resume with the optimizer it was written with")
            self.updater.adalomo.load_state_dict(state["adalomo"])
        self.global_step = state["global_step"]
        self.skipped_steps = state["skipped_steps"]
        self.consecutive_skips = state.get("consecutive_skips", 0)
        if self.loss_scaler is not None and state["loss_scaler"] is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        ds_compat.release_all(self.offload)
