"""LomoEngine: DeepSpeed ZeRO-3 for parameters, lomo_ds for gradients and updates.

DeepSpeed, given no optimizer, partitions the model and gathers/releases each layer's
parameters around its forward and backward. lomo_ds hooks every parameter: when its gradient
is ready it goes into a reduce-scatter bucket, and each rank updates its own slice of the shard
in place (lomo_ds/engine/update/: the rule lomo.optimizer names, which owns its state). One step
= one forward and one or two backward passes:

  one pass   plain SGD / value clipping / bf16 / fp32: update as gradients arrive.
  two passes clip by global norm, or fp16 loss scaling: the first pass only measures (this rank's
             sum of squares of its reduced shards, all-reduced into the exact global norm, and
             whether anything overflowed); the second applies the update scaled by
             min(1, max_norm / norm), or the whole step is skipped on every rank on overflow.
             The second pass reuses the first pass's graph (retain_graph) instead of paying a
             second forward, unless two_pass_mode is "recompute".

The step is handed its parts: the loss's weighing, agreed over the ranks before any backward
(loss_weights.py: a non-finite loss on any rank skips the step on every rank, no weight
touched); where each reduced slice goes, the host-update worker included (host_staging.py); and
the window's end, its step applied from the accumulated sum or skipped (window_close.py). With
train.accumulation_steps K > 1, train_step takes one micro-batch (DeepSpeed's convention).
"""
from __future__ import annotations

import math
import os
from typing import Any

import torch

from lomo_ds.comm import abandon_param_gather, configure_param_gather, install_int8_shards, open_step_sums
from lomo_ds.config import leaf_module
from lomo_ds.config.checks.int8_shards import refuse_int8_conflicts
from lomo_ds.config.engine_config import EngineConfig, Precision, load_config
from lomo_ds.engine import sequence_memory
from lomo_ds.engine.accumulation import accumulator_for, check_window
from lomo_ds.engine.batch_loss import BatchLoss
from lomo_ds.engine.buckets import GradientBuckets, NoSpans
from lomo_ds.engine.chunked_loss import head_of
from lomo_ds.engine.host_staging import HostStaging, SliceRoute
from lomo_ds.engine.host_updates import HostUpdates, use_thread
from lomo_ds.engine.loss_weights import LossWeights
from lomo_ds.engine.precision import DynamicLossScaler
from lomo_ds.engine.release import empty_held
from lomo_ds.engine.schedule import schedule_of
from lomo_ds.engine.trainable import matching, trainable
from lomo_ds.engine.update import PassSettings, PassStats, build_updater
from lomo_ds.engine.window import BucketMode, Window
from lomo_ds.engine.window_close import StepCounters, WindowCloser, clipped
from lomo_ds.runtime import ds_compat
from lomo_ds.runtime.device import accelerator_device, capture_rng, move_batch, restore_rng
from lomo_ds.runtime.dist import gather_full_state_dict, init_distributed
from lomo_ds.runtime.layout import ParallelLayout
from lomo_ds.runtime.memory import MemoryTracker

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def initialize(model: torch.nn.Module, config: dict | str | os.PathLike,
               total_steps: int | None = None) -> "LomoEngine":
    """Wrap `model` (already partitioned by zero.Init, or a plain module) in a LomoEngine.
    `total_steps`, when given, wins over train.scheduler.total_steps."""
    ds_config, engine_config = load_config(config)
    return LomoEngine(model, ds_config, engine_config, total_steps=total_steps, precision=Precision.of(ds_config))


def _counter(name: str) -> property:
    return property(lambda engine: getattr(engine.steps, name), doc=f"StepCounters.{name}")


class LomoEngine:
    """The engine's public interface: what code outside lomo_ds/engine may use (the rest is its own).

    step       train_step(batch), forward(batch), is_gradient_accumulation_boundary(),
               start_window(k), micro_step and window_length (the window now running),
               accumulation_steps, two_passes, fused_accumulation, schedule (replaceable: lr_at(step)),
               timers (replaceable spans)
    counters   global_step, skipped_steps, consecutive_skips (read only)
    model      module, ds_engine (DeepSpeed's wrapper of it), params (the parameters it updates),
               device, config, layout (the parallel layout: group, world, rank, sp), loss_head
    shards     geometry(param) (this rank's slice of it: .start, .local), write_shard(param, full),
               shards_written() (after writing shards outside a step), release_gathered()
    evaluation eval_forward(batch), eval_token_loss(batch)
    state      shard_state_dict(), load_shard_state_dict(state), check_state(state),
               full_state_dict(), state_bytes(), accumulator_bytes(device), enable_memory_tracking()
    release()  frees what it holds; the engine is unusable afterwards
    """

    def __init__(self, model: torch.nn.Module, ds_config: dict, config: EngineConfig, total_steps: int | None = None,
                 precision: Precision | None = None, layout: ParallelLayout | None = None):
        """`ds_config` goes to deepspeed.initialize as it is; the engine reads its settings from the
        typed `config` (lomo, comm, memory, train) and `precision` (default: read from `ds_config`'s
        fp16/bf16); its ranks, groups and what they require of the model from `layout` (default: the
        process's layout for train.sequence_parallel_size, lomo_ds/runtime/layout.py)."""
        import deepspeed

        init_distributed(timeout_s=config.train.collective_timeout)
        # Before DeepSpeed partitions the model: every ZeRO-3 gather from here on takes this route.
        self.param_gather = configure_param_gather(config.comm.param_gather, config.train.collective_timeout)
        # Sequence parallelism: checked before DeepSpeed partitions anything.
        self.layout = layout or ParallelLayout.build(config.train.sequence_parallel_size)
        self.layout.check_model(getattr(model, "config", None))
        self.sp = self.layout.sp
        self.config = config
        self.ds_config = ds_config
        refuse_int8_conflicts(config.memory, config.lomo, ds_config)  # before DeepSpeed partitions anything
        self.dtype = (precision or Precision.of(ds_config)).torch_dtype
        self.schedule = schedule_of(config, total_steps)
        # This rank's device: batches are moved here and every tensor the engine makes lives here.
        self.device = accelerator_device()
        # zero_optimization.leaf_module "auto" becomes the model's own decoder-layer class.
        self.ds_engine, *_ = deepspeed.initialize(model=model, config=leaf_module.resolve(ds_config, model),
                                                  model_parameters=None, optimizer=None)
        self.module = self.ds_engine.module
        # The head the chunked loss reads (chunked_loss.py); None: the model's own loss.
        self.loss_head = head_of(self.module, config.memory.chunked_loss)
        sequence_memory.install(self.module, config.memory, self.layout.group, self.device)
        self.layout.route_attention(self.module)
        self.offload = ds_compat.offload_of(self.ds_engine)
        self.params = trainable(self.module, config.lomo.exclude_params)  # tied tensors once (trainable.py)
        # memory.int8_shards: the loaded weights' shards become 8-bit, and their gathers lomo_ds's.
        self.int8_params = (install_int8_shards(self.module, self.params, config.memory.int8_block, self.dtype)
                            if config.memory.int8_shards else [])
        # The loss and the norm are reduced over every rank, and every parameter is sharded over all
        # of them (the buckets refuse a group that does not: no tensor or pipeline parallelism).
        self.group, self.world, self.rank = self.layout.group, self.layout.world, self.layout.rank
        self.memory: MemoryTracker | None = None
        self._build_update(config)
        self._build_buckets(config)
        self._build_step_state(config)

    def _build_update(self, config: EngineConfig) -> None:
        """The host-update worker (where it runs), the updater with its rule, the accumulator, and
        where each reduced slice goes."""
        # Shards in host memory (offload_param: cpu) are updated on a worker thread while the
        # backward goes on (memory.host_update, host_updates.py: use_thread).
        names = {id(p): n for n, p in self.module.named_parameters()}
        self.host_updates = (HostUpdates(self.device, lambda p: names.get(id(p), f"ds_id={ds_compat.param_id(p)}"))
                             if use_thread(config.memory.host_update, self.device, config.memory.int8_shards)
                             else None)
        # Shards live on the accelerator, or in host memory with offload_param: the update runs
        # where each one lives; the pass statistics stay on this rank's device.
        self.updater = build_updater(config, self.module, self.params, self.group, self.dtype, self.host_updates,
                                     self.device)
        # Gradient accumulation (accumulation.py): one step every accumulation_steps micro-batches.
        self.accumulation_steps = config.train.accumulation_steps
        self.accumulator = accumulator_for(config.memory, self.accumulation_steps, self.params,
                                           lambda p: self.updater.geometry(p).local)
        self.staging = HostStaging(self.host_updates, self.updater, self.accumulator)
        self.slice_route = SliceRoute(self.staging, self.updater, self.accumulator)  # the buckets' on_bucket

    def _build_buckets(self, config: EngineConfig) -> None:
        """The gradient buckets, the hooks that fill them, and the route of the step's agreements."""
        reduce_dtype = _DTYPES[config.comm.reduce_dtype] if config.comm.reduce_dtype else None
        # One object for every parameter: it splits them by their own ds_process_group (one bucket
        # set per group) and refuses a group that does not span every rank.
        self.buckets = GradientBuckets(self.params, self.group, self.world, self.rank, config.comm.bucket_size,
                                       reduce_dtype, self.slice_route, device=self.device,
                                       transport=config.comm.grad_reduction, max_in_flight=config.comm.max_in_flight,
                                       timeout_s=config.train.collective_timeout,
                                       sparse=matching(self.module, config.comm.sparse_params))
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]
        # The step's agreements (loss, norm, verdict) go where the buckets' bytes go: a process
        # group's all-reduce per agreement would cost a step as much as a small bucket's.
        self.step_sums = open_step_sums(self.buckets.route, self.group, self.world, self.rank,
                                        config.train.collective_timeout)

    def _build_step_state(self, config: EngineConfig) -> None:
        """The loss scaler, the step counters, the window, and what the step is handed."""
        scaling = config.lomo.loss_scale
        scale_on = scaling.enabled if scaling.enabled is not None else self.dtype == torch.float16
        self.loss_scaler = DynamicLossScaler(scale=2.0**scaling.initial_scale_power, window=scaling.window,
                                             min_scale=scaling.min_scale) if scale_on else None
        self.steps = StepCounters()
        self.micro_step = 0  # micro-batches of the current window already taken
        self.window_length = self.accumulation_steps  # micro-batches of the current window
        self.window = Window()
        # What the step is handed beside the slices' route: the batch's loss, its weighing, the window's end.
        self.batch_loss = BatchLoss(self.module, self.loss_head, config.memory.loss_chunk_logits, self.sp,
                                    config.train.loss_normalization)
        self.loss_weights = LossWeights(config.train.loss_normalization, self.sp.dp_size, self.sp.size, self.world,
                                        self.step_sums)
        self.closer = WindowCloser(config, self.params, self.updater, self.accumulator, self.buckets, self.staging,
                                   self.step_sums, self.loss_scaler, self.loss_weights, self.offload, self.steps)

    @property
    def timers(self):
        """Spans of the step's parts: free no-ops unless a profiler attached its own
        (lomo_ds.profiling.attach_timers)."""
        return self.buckets.timers

    @timers.setter
    def timers(self, timers) -> None:
        self.buckets.timers = timers if timers is not None else NoSpans()

    # Read only: the window's end advances them (window_close.py).
    global_step = _counter("global_step")  # optimizer steps taken, skipped ones included
    skipped_steps = _counter("skipped_steps")
    consecutive_skips = _counter("consecutive_skips")

    # ----------------------------------------------------------------- configuration
    @property
    def two_passes(self) -> bool:
        """A K = 1 step needs the global norm or the overflow verdict before updating: two backwards."""
        return self.config.train.clip_grad_norm is not None or self.loss_scaler is not None

    @property
    def fused_accumulation(self) -> bool:
        """Whether the K-th backward of a window applies the update as it goes (else one pass over
        the accumulated shards after it). An fp16 accumulator may overflow in the sum of finite
        micro-batch gradients, which only the pass's norm would see."""
        return not self.two_passes and self.config.memory.accumulate_dtype != "fp16"

    # ----------------------------------------------------------------- accumulation windows (DeepSpeed's API)
    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next train_step call ends a window and applies the update (DeepSpeed's name)."""
        return self.micro_step + 1 >= self.window_length

    def start_window(self, micro_batches: int) -> None:
        """Make the window now starting `micro_batches` long (1..accumulation_steps) instead of
        accumulation_steps: the end of an epoch whose micro-batch count K does not divide. Its step
        is the mean over its own micro-batches (1/k, not 1/K). Only between windows."""
        check_window(micro_batches, self.accumulation_steps, self.micro_step)
        self.window_length = micro_batches

    def enable_memory_tracking(self) -> MemoryTracker:
        self.memory = MemoryTracker(self.params, master_bytes=self.updater.shard.master_bytes(),
                                    state_bytes=self.updater.rule.state_bytes())
        self.buckets.track_memory(self.memory)
        return self.memory

    # ----------------------------------------------------------------- the step
    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        if not ds_compat.grad_is_ready(param):
            return  # a tiled MLP's weight between its tiles: its .grad sums them (sequence_memory.py)
        with self.timers.span("hook"):
            if self.memory is not None:
                self.memory.sample()
            grad = param.grad
            param.grad = None  # the bucket holds the only reference now; freed once packed
            self.buckets.add(param, grad)
            del grad

    def _backward(self, loss: torch.Tensor, settings: PassSettings, measure: bool = False, retain_graph: bool = False,
                  mode: BucketMode = BucketMode.UPDATE) -> PassStats:
        """One backward pass (measuring, or updating by `settings`, or accumulating by `mode`); its
        statistics stay on the device (the buckets fold every bucket's verdict into them, and from
        the first non-finite bucket on apply nothing more)."""
        stats = self.updater.begin_pass(settings, measure=measure, step=self.global_step)
        self.buckets.reset(stats)
        self.slice_route.mode = mode
        # on an error, peers waiting on this rank's next bucket or parameter gather fail too
        abandon = (self.buckets.abandon, abandon_param_gather, self.step_sums.abandon)
        try:
            with self.staging.joined(on_error=abandon):
                loss.backward(retain_graph=retain_graph)
                with self.timers.span("flush"):
                    self.buckets.flush()
        finally:
            self.slice_route.mode = BucketMode.UPDATE
        return stats

    def forward(self, batch: dict[str, Any]):
        """The training forward: its outputs' "loss" is what the step reads (no logits with the
        chunked loss)."""
        return self.batch_loss.forward(batch)

    def train_step(self, batch: dict[str, Any]) -> dict[str, Any]:
        """One micro-batch of this rank: a forward and a backward. With accumulation_steps K > 1,
        every K-th call (see is_gradient_accumulation_boundary) also applies the update from the
        window's accumulated gradient; the result's "stepped" says whether this call did.

        One skeleton for windows of one and of K: the forward, the loss agreed before any backward,
        then the backward. A window of one applies the update in its backward (after a measuring
        backward where the norm or the overflow verdict is needed first); micro-batches 1..K-1 add
        into the accumulator, and the K-th applies the step fused into its backward or after it."""
        self.module.train()
        batch = move_batch(batch, self.device)
        window, one = self.window, self.micro_step == 0 and self.window_length == 1
        last = self.is_gradient_accumulation_boundary()
        loss_scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0  # fixed over a window
        lr = self.schedule.lr_at(self.global_step)
        result = {"lr": lr, "loss_scale": loss_scale, "grad_norm": None, "skipped": False, "stepped": last,
                  "micro_batches": self.micro_step + 1}
        measure = one and self.two_passes
        rng = capture_rng(self.device) if measure and self.config.memory.two_pass_mode == "recompute" else None

        raw_loss, labelled, tokens = self.batch_loss(batch, self.forward)
        agreed = self.loss_weights.agree(raw_loss, labelled, tokens)
        window.note(agreed)
        if window.per_token is None and agreed.tokens > 0:
            # One weight for the whole window (its micro-batches' gradients are summed), chosen
            # from the first micro-batch with labels.
            window.per_token = self.loss_weights.token_weight(agreed.tokens)
        # Whether this backward applies the update (else it only accumulates).
        applies = one or (last and self.fused_accumulation)
        if window.nonfinite or agreed.unlabelled:
            # Known on every rank before the backward (a non-finite loss here, or something
            # non-finite earlier in the window, or no labels anywhere): no rank starts one.
            del raw_loss
            self.release_gathered()
        else:
            per_token = window.per_token or 1.0
            loss = self.loss_weights.backward_loss(raw_loss, labelled, tokens, 1.0, per_token)
            del raw_loss
            # What the summed gradient is divided by: the seed's per-token weight included; unscaled.
            normalizer = self.loss_weights.normalizer(self.micro_step + 1, window.tokens)
            grad_scale = 1.0 / (normalizer * per_token * loss_scale) if applies else 1.0
            if measure:
                loss, grad_scale = self._measuring_pass(batch, loss, grad_scale, rng, result,
                                                        (labelled, tokens, per_token, loss_scale))
            if loss is None:  # overflow in the measuring pass, on some rank
                window.nonfinite = True
            else:
                settings = self.closer.settings(lr, grad_scale) if applies else PassSettings()
                mode = BucketMode.UPDATE if one else BucketMode.FOLD if applies else BucketMode.ADD
                stats = self._backward(loss * loss_scale, settings, mode=mode)
                del loss
                # The pass's one read, agreed over the ranks (a slice that overflowed only in the last
                # bucket's reduction is known to its own rank alone until now).
                (nonfinite_ranks,) = self._sum_over_ranks((~stats.finite).to(torch.float32).reshape(1),
                                                           "non-finite flag")
                window.nonfinite |= nonfinite_ranks > 0
                window.backwards += 1
        result["loss"] = window.report(self.config.train.loss_normalization)
        self.micro_step += 1
        if not last:
            return result
        # The window is over, whatever its step's outcome: the next one starts afresh.
        length = self.window_length
        self.micro_step, self.window_length, self.window = 0, self.accumulation_steps, Window()
        result = self.closer.close(window, length, result, applies)
        if self.updater.shard.int8 is not None:
            # 8-bit blocks whose scale this rank recomputed in the step (a cut block is counted by
            # the rank holding its first element: the sum over the ranks is the model's).
            result["int8_rescaled_blocks"] = self.updater.shard.take_rescaled()
        return result

    def _measuring_pass(self, batch, loss: torch.Tensor, grad_scale: float, rng, result: dict[str, Any],
                        seed: tuple) -> tuple[torch.Tensor | None, float]:
        """A window of one that needs the global norm or the overflow verdict before updating: a
        first backward that only measures. Returns the loss to back-propagate again (the same
        graph, retained, or recomputed with the same random draws where `rng` was captured) and the
        clipped grad_scale; None for the loss when something overflowed on some rank."""
        labelled, tokens, per_token, loss_scale = seed
        retain = rng is None
        counters = ds_compat.snapshot_backward_counters(self.module) if retain else None
        stats = self._backward(loss * loss_scale, PassSettings(lr=result["lr"], grad_scale=grad_scale), measure=True,
                               retain_graph=retain)
        # fp64, and a non-finite sum stays non-finite through the sum: 8 bytes carry both, and
        # reading the reduced sum is the pass's one host sync.
        (total,) = self._sum_over_ranks(stats.norm_sq_or_inf().reshape(1), "squared norm")
        result["grad_norm"], clip = clipped(total, self.config.train.clip_grad_norm)
        if not math.isfinite(result["grad_norm"]):
            return None, grad_scale  # every rank skips, no parameter is touched
        grad_scale *= clip
        if retain:
            ds_compat.restore_backward_counters(counters)
            return loss, grad_scale
        del loss
        # The same random draws (dropout) as the measured forward: the same graph.
        restore_rng(rng, self.device)
        again = self.batch_loss(batch, self.forward)[0]
        return self.loss_weights.backward_loss(again, labelled, tokens, 1.0, per_token), grad_scale

    def _sum_over_ranks(self, values, name: str) -> list[float]:
        """One of the step's agreements: element-wise sums over the ranks, read on the host."""
        return self.step_sums.sum(values, name)

    # ----------------------------------------------------------------- evaluation and state
    @torch.no_grad()
    def eval_forward(self, batch: dict[str, Any]):
        """The model's own outputs (logits included), no gradients."""
        self.module.eval()
        return self.module(**move_batch(batch, self.device))

    @torch.no_grad()
    def eval_token_loss(self, batch: dict[str, Any]) -> torch.Tensor | None:
        """The summed cross-entropy of the batch's label tokens (shifted by one, -100 ignored),
        through the chunked loss; None where the model keeps its own loss (the caller then takes it
        from eval_forward's logits)."""
        if self.loss_head is None:
            return None
        self.module.eval()
        return self.batch_loss.token_sum(move_batch(batch, self.device))

    # ----------------------------------------------------------------- shards and state, for the methods
    def geometry(self, param: torch.nn.Parameter):
        """This rank's slice of `param` (`.start`, `.local` real elements), as the update cuts it."""
        return self.updater.geometry(param)

    def write_shard(self, param: torch.nn.Parameter, full: torch.Tensor) -> None:
        """This rank's slice of `full` (the parameter's whole flat value) into its shard, 8-bit ones too."""
        self.updater.shard.write_full(param, full)

    def shards_written(self) -> None:
        """Shards were written outside a step (LoRA's adapters, GRPO's reference weights): ZeRO-3's
        gathers, on a stream of their own, wait for the writes, and no gathered copy survives them."""
        ds_compat.gathers_wait_for_updates(self.offload)
        self.release_gathered()

    def release_gathered(self) -> None:
        """Every gathered parameter back to its shard: the next forward gathers each anew."""
        ds_compat.release_all(self.offload)

    def state_bytes(self) -> int:
        """This rank's fp32 masters and update-rule state, in bytes."""
        return self.updater.state_bytes()

    def accumulator_bytes(self, device: torch.device) -> int:
        """The shard accumulator's bytes on `device` (0 without one: a window of one)."""
        return self.accumulator.nbytes(device) if self.accumulator is not None else 0

    def check_state(self, state: dict[str, Any]) -> None:
        """Refuse, before anything is read into a shard, a resumable state this engine cannot take."""
        self.updater.check_state(state, self.module, self.params)

    def release(self) -> dict[str, int]:
        """Free every tensor the engine holds, in place (engine/release.py); returns the bytes freed
        by device type. The engine is unusable afterwards."""
        for hook in self._hooks:
            hook.remove()
        return empty_held(self)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective: the full parameters by name on rank 0 (None elsewhere), one at a time."""
        return gather_full_state_dict(self.module, self.rank)

    def shard_state_dict(self) -> dict[str, Any]:
        """This rank's part of a resumable checkpoint: the updater's (its shards, fp32 masters and
        the rule's state) and the step counters. Only at a step boundary: the accumulator is then
        empty, so it is not part of the state. The tensors are the live shards: write them out
        before the next step."""
        if self.micro_step:
            raise RuntimeError(f"shard_state_dict: {self.micro_step} micro-batch(es) of a window of "
                               f"{self.window_length} are accumulated; checkpoint at a step boundary")
        return {"world": self.world, "rank": self.rank, **self.updater.state_dict(self.module, self.params),
                **self.steps.state_dict(), "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None}

    def load_shard_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what shard_state_dict wrote, on the rank that wrote it; every refusal of the
        shards comes before any shard is written."""
        if state["world"] != self.world or state["rank"] != self.rank:
            raise ValueError(f"checkpoint shard was written by rank {state['rank']} of {state['world']}, "
                             f"this is rank {self.rank} of {self.world}")
        self.updater.load_state_dict(state, self.module, self.params)
        self.steps.load_state_dict(state)
        if self.loss_scaler is not None and state["loss_scaler"] is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        self.release_gathered()
