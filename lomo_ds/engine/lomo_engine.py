"""LomoEngine: DeepSpeed ZeRO-3 for parameters, lomo_ds for gradients and updates.

DeepSpeed, given no optimizer, partitions the model and gathers/releases each layer's
parameters around its forward and backward. lomo_ds hooks every parameter: when its gradient
is ready it goes into a reduce-scatter bucket, and each rank updates its own slice of the shard
in place (lomo_ds/engine/update/). One step = one forward and one or two backward passes:

  one pass   plain SGD / value clipping / bf16 / fp32: update as gradients arrive.
  two passes clip by global norm, or fp16 loss scaling: the first pass only measures (this rank's
             sum of squares of its reduced shards, all-reduced into the exact global norm, and
             whether anything overflowed); the second applies the update scaled by
             min(1, max_norm / norm), or the whole step is skipped on every rank on overflow.
             The second pass reuses the first pass's graph (retain_graph) instead of paying a
             second forward, unless two_pass_mode is "recompute".

Before any backward, one all-reduce of three numbers agrees on the loss: a non-finite loss on
any rank skips the step on every rank with no weight touched. (The step's agreements go where
the buckets' bytes go: lomo_ds/comm/step_sums.py.) A
gradient that turns non-finite only in a backward is flagged by the buckets on every rank at
once; the step is then skipped from that bucket on. After lomo.max_consecutive_skips skipped
steps in a row the run stops.

With train.accumulation_steps K > 1, train_step takes one micro-batch (DeepSpeed's convention):
micro-batches 1..K-1 add their reduced slices into a per-rank shard accumulator, and the K-th
applies the update from the sum, fused into its backward or as one pass after it when the norm
or the overflow verdict is needed first (accumulation.py); a non-finite value anywhere in the
window skips the whole step.

lomo.optimizer names the update rule, SGD or AdaLomo (lomo_ds/engine/update/), applied to the same
reduced shards in the same passes; the rule owns its state, which goes into the shard checkpoint
and the memory tracker.

With offload_param: cpu the shards live in host memory: on an accelerator their updates run on a
worker thread, overlapped with the backward, from slices copied without blocking into pinned
buffers, and every pass joins it before its statistics are read (host_updates.py). AdaLomo's
statistics and collectives stay in the hook, on the device; the worker applies the rest.
"""
from __future__ import annotations

import contextlib
import fnmatch
import math
import os
from typing import Any

import torch

from lomo_ds.comm import abandon_param_gather, configure_param_gather, open_step_sums
from lomo_ds.config import leaf_module
from lomo_ds.config.lomo import EngineConfig, Precision, load_config
from lomo_ds.engine import sequence_memory
from lomo_ds.engine.accumulation import ACCUMULATE_DTYPES, ShardAccumulator, check_window
from lomo_ds.engine.buckets import GradientBuckets, NoSpans
from lomo_ds.engine.chunked_loss import causal_lm_loss, head_of
from lomo_ds.engine.host_updates import HostUpdates, use_thread
from lomo_ds.engine.precision import DynamicLossScaler
from lomo_ds.engine.schedule import schedule_of
from lomo_ds.engine.sequence_loss import sp_loss
from lomo_ds.engine.update import PassSettings, PassStats, build_updater
from lomo_ds.engine.window import Agreed, BucketMode, Window
from lomo_ds.runtime import ds_compat
from lomo_ds.runtime.device import accelerator_device, capture_rng, move_batch, restore_rng
from lomo_ds.runtime.dist import gather_full_state_dict, has_labelled_tokens, init_distributed, label_tokens, loss_of
from lomo_ds.runtime.layout import ParallelLayout
from lomo_ds.runtime.memory import MemoryTracker

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def initialize(model: torch.nn.Module, config: dict | str | os.PathLike,
               total_steps: int | None = None) -> "LomoEngine":
    """Wrap `model` (already partitioned by zero.Init, or a plain module) in a LomoEngine.
    `total_steps`, when given, wins over train.scheduler.total_steps."""
    ds_config, engine_config = load_config(config)
    return LomoEngine(model, ds_config, engine_config, total_steps=total_steps, precision=Precision.of(ds_config))


class LomoEngine:
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
        self.dtype = (precision or Precision.of(ds_config)).torch_dtype
        self.schedule = schedule_of(config, total_steps)
        # This rank's device: batches are moved here and every tensor the engine makes lives here.
        self.device = accelerator_device()
        # zero_optimization.leaf_module "auto" becomes the model's own decoder-layer class.
        self.ds_engine, *_ = deepspeed.initialize(model=model, config=leaf_module.resolve(ds_config, model),
                                                  model_parameters=None, optimizer=None)
        self.module = self.ds_engine.module
        # The training loss through the chunked linear + cross-entropy (chunked_loss.py), where the
        # model's head is one it knows; None: the model's own loss.
        self.loss_head = head_of(self.module, config.memory.chunked_loss)
        sequence_memory.install(self.module, config.memory, self.layout.group, self.device)
        self.layout.route_attention(self.module)
        self.offload = ds_compat.offload_of(self.ds_engine)
        # module.parameters() lists a tied tensor once: it gets one hook and one update with the
        # gradient autograd has already summed over its uses. Parameters matching
        # lomo.exclude_params (e.g. LoRA adapters stepped by another optimizer) keep plain .grad.
        self.params = [p for n, p in self.module.named_parameters()
                       if p.requires_grad and not any(fnmatch.fnmatch(n, pat) for pat in config.lomo.exclude_params)]
        if not self.params:
            raise ValueError("model has no trainable parameters")
        missing = ds_compat.check_param_attrs(self.params[0])
        if missing:
            raise RuntimeError(f"DeepSpeed ZeRO-3 parameter attributes missing: {missing}")
        # Every rank is a data-parallel rank (no tensor or pipeline parallelism): the loss and the
        # norm are reduced over all of them, and every parameter must be sharded over all of them
        # (the buckets refuse a group that does not span them). Shard indices come from each
        # parameter's own group (update/shard.py).
        self.group, self.world, self.rank = self.layout.group, self.layout.world, self.layout.rank
        self.memory: MemoryTracker | None = None
        self._build_update(config)
        self._build_buckets(config)
        self._build_step_state(config)

    def _build_update(self, config: EngineConfig) -> None:
        """The host-update worker (where it runs) and the updater with its rule."""
        # Shards in host memory (offload_param: cpu) are updated on a worker thread while the
        # backward goes on (memory.host_update; by default on accelerators only: on a CPU rank the
        # update would compete with the backward for the same cores). A rule that makes
        # collectives (AdaLomo) keeps them in the hook, on this rank's device, and hands the
        # worker only the elementwise update of the shard (update/adalomo.py).
        names = {id(p): n for n, p in self.module.named_parameters()}
        self.host_updates = (HostUpdates(self.device, lambda p: names.get(id(p), f"ds_id={ds_compat.param_id(p)}"))
                             if use_thread(config.memory.host_update, self.device) else None)
        # Shards live on the accelerator, or in host memory with offload_param: the update runs
        # where each one lives; the pass statistics stay on this rank's device.
        self.updater = build_updater(config, self.module, self.params, self.group, self.dtype, self.host_updates,
                                     self.device)

    def _build_buckets(self, config: EngineConfig) -> None:
        """The gradient buckets, the hooks that fill them, and the route of the step's agreements."""
        # Each parameter is reduced over its own ds_process_group: one bucket set per group.
        reduce_dtype = _DTYPES[config.comm.reduce_dtype] if config.comm.reduce_dtype else None
        # One object for every parameter: it splits them by their own ds_process_group and refuses
        # a group that does not span every rank.
        self.buckets = GradientBuckets(self.params, self.group, self.world, self.rank, config.comm.bucket_size,
                                       reduce_dtype, self._on_bucket, device=self.device,
                                       transport=config.comm.grad_reduction, max_in_flight=config.comm.max_in_flight,
                                       timeout_s=config.train.collective_timeout,
                                       sparse=[p for n, p in self.module.named_parameters() if p.requires_grad
                                               and any(fnmatch.fnmatch(n, pat) for pat in config.comm.sparse_params)])
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]
        # The step's agreements (loss, norm, verdict) go where the buckets' bytes go: a process
        # group's all-reduce per agreement would cost a step as much as a small bucket's.
        self.step_sums = open_step_sums(self.buckets.route, self.group, self.world, self.rank,
                                        config.train.collective_timeout)

    def _build_step_state(self, config: EngineConfig) -> None:
        """The loss scaler, the step counters and the accumulation window."""
        scaling = config.lomo.loss_scale
        scale_on = scaling.enabled if scaling.enabled is not None else self.dtype == torch.float16
        self.loss_scaler = DynamicLossScaler(scale=2.0**scaling.initial_scale_power, window=scaling.window,
                                             min_scale=scaling.min_scale) if scale_on else None
        self.global_step = 0  # optimizer steps taken (skipped ones included: the schedule moves on)
        self.skipped_steps = 0
        self.consecutive_skips = 0

        # Gradient accumulation (accumulation.py): one step every accumulation_steps micro-batches.
        self.accumulation_steps = config.train.accumulation_steps
        self.accumulator = (ShardAccumulator(self.params, lambda p: self.updater.geometry(p).local,
                                             ACCUMULATE_DTYPES[config.memory.accumulate_dtype],
                                             config.memory.accumulate_on == "cpu")
                            if self.accumulation_steps > 1 else None)
        self.micro_step = 0  # micro-batches of the current window already taken
        self.window_length = self.accumulation_steps  # micro-batches of the current window
        self.window = Window()
        self.bucket_mode = BucketMode.UPDATE  # what the buckets' reduced slices are for in this backward

    @property
    def timers(self):
        """Spans of the step's parts: free no-ops unless a profiler attached its own
        (lomo_ds.profiling.attach_timers)."""
        return self.buckets.timers

    @timers.setter
    def timers(self, timers) -> None:
        self.buckets.timers = timers if timers is not None else NoSpans()

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
    def _on_bucket(self, items: list[tuple[torch.nn.Parameter, torch.Tensor]], stats: PassStats) -> None:
        """A reduced bucket: this rank's summed slice of each of its parameters."""
        items = self._stage_host_shards(items, stats)
        if self.bucket_mode is BucketMode.ADD:
            for param, grad_shard in items:
                self.accumulator.add(param, grad_shard)
        elif items:
            self.updater.apply_bucket([(p, self._update_grad(p, g)) for p, g in items], stats)

    def _update_grad(self, param: torch.nn.Parameter, grad_shard: torch.Tensor):
        """What the update steps by: the reduced slice, or in a FOLD pass the window's sum with it."""
        if self.bucket_mode is BucketMode.FOLD:
            return self.accumulator.lazy_total(param, self.updater.slice_device(param), grad_shard)
        return grad_shard

    def _stage_host_shards(self, items, stats: PassStats):
        """Hand the slices of shards in host memory to the host-update worker (which applies them
        as this pass's mode says); returns the rest. The updating passes of a rule that takes
        each bucket whole keep it whole (the rule hands the host part over itself, after its
        collectives); the measuring pass touches no shard and sums its squares on the device, here."""
        host = self.host_updates
        whole = self.updater.rule.takes_whole_bucket and self.bucket_mode is not BucketMode.ADD
        if host is None or self.updater.measuring or whole or not any(host.holds(p) for p, _ in items):
            return items
        staged = [(p, g[:self.updater.geometry(p).local]) for p, g in items if host.holds(p)]
        staged = [(p, g) for p, g in staged if g.numel()]  # a rank may hold no real element of one
        if staged:
            host.submit(staged, stats.finite, self._host_apply(self.bucket_mode))
        return [(p, g) for p, g in items if not host.holds(p)]

    def _host_apply(self, mode: BucketMode):
        """What the host-update worker does with one staged slice (a parameter's real elements in
        host memory) and the pass's finite flag as of its bucket, in the bucket mode of its pass."""
        if mode is BucketMode.ADD:
            return lambda p, g, finite: self.accumulator.add(p, g)
        if mode is BucketMode.FOLD:
            return lambda p, g, finite: self.updater.apply(p, self.accumulator.lazy_total(p, g.device, g), finite)
        return lambda p, g, finite: self.updater.apply(p, g, finite)

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
        self.bucket_mode = mode
        # on an error, peers waiting on this rank's next bucket or parameter gather fail too
        abandon = (self.buckets.abandon, abandon_param_gather, self.step_sums.abandon)
        try:
            with self._host_updates_joined(on_error=abandon):
                loss.backward(retain_graph=retain_graph)
                with self.timers.span("flush"):
                    self.buckets.flush()
        finally:
            self.bucket_mode = BucketMode.UPDATE
        return stats

    @contextlib.contextmanager
    def _host_updates_joined(self, on_error=()):
        """Around work that hands updates of host-memory shards to the worker: on leaving, every
        one is applied, before the pass's statistics are read and the next forward gathers the
        shards. Every collective of the work is done by then, so a worker's error raised here
        leaves no peer waiting mid-pass. On an error, `on_error` runs first, then the worker is
        joined without raising its own error: no update is left running, and the first error wins."""
        try:
            yield
        except BaseException:
            for abandon in on_error:
                abandon()
            if self.host_updates is not None:
                self.host_updates.join(raise_failure=False)
            raise
        if self.host_updates is not None:
            self.host_updates.join()

    def forward(self, batch: dict[str, Any]):
        """The training forward: its outputs' "loss" is what the step reads (no logits with the
        chunked loss)."""
        if self.loss_head is not None and batch.get("labels") is not None:
            return causal_lm_loss(self.module, self.loss_head, batch, self.config.memory.loss_chunk_logits)
        return self.module(**batch)

    def _loss_of(self, batch: dict[str, Any]) -> tuple[torch.Tensor, bool, int]:
        """The forward's loss, whether the batch has a label, and its label tokens (1 unless
        loss_normalization is "tokens"). Sequence-parallel: this rank's slice of the whole batch,
        weighed so that the SP group's losses add up to the batch's (engine/sequence_loss.py)."""
        normalization = self.config.train.loss_normalization
        if self.sp.size > 1:
            return sp_loss(self.module, self.loss_head, self.config.memory.loss_chunk_logits, batch, self.sp,
                           normalization)
        tokens = label_tokens(batch) if normalization == "tokens" else 1
        return loss_of(self.forward(batch)), has_labelled_tokens(batch), tokens

    def _agree_on_loss(self, loss: torch.Tensor, labelled: bool, tokens: int) -> "Agreed":
        """Before any backward, ONE all-reduce of three fp32 numbers: the summed loss of the ranks
        with labelled tokens, how many such ranks, and how many of them have a non-finite loss;
        with loss_normalization "tokens", two more: the token-weighted loss and the label tokens."""
        value = float(loss.detach()) if labelled else 0.0  # an unlabelled batch's loss is 0/0
        finite = math.isfinite(value)
        # An SP group's ranks share one batch: together they count as one labelled batch.
        values = [value if finite else 0.0, float(labelled) / self.sp.size, float(not finite)]
        by_tokens = self.config.train.loss_normalization == "tokens"
        if by_tokens:
            tokens = tokens if labelled and finite else 0
            values += [value * tokens, float(tokens)]
        total, n_labelled, n_nonfinite, *weighted = self._sum_over_ranks(values, "loss")
        if n_nonfinite or not n_labelled:
            return Agreed(math.nan, 0.0, 0.0, n_nonfinite > 0, n_labelled == 0)
        token_loss, all_tokens = weighted if by_tokens else (0.0, 0.0)
        return Agreed(total / n_labelled, token_loss, all_tokens, False, False)

    def _backward_loss(self, loss: torch.Tensor, labelled: bool, tokens: int, loss_scale: float,
                       per_token: float = 1.0) -> torch.Tensor:
        """What this rank back-propagates: its token-mean loss ("mean"), or its token sum ("tokens")
        times `per_token` (_token_weight); unscaled and averaged afterwards, by the update's grad_scale."""
        if not labelled:
            # Nothing to learn on this rank, but its backward still runs (ZeRO-3's gathers and
            # the reduce-scatter are collectives) and contributes a zero gradient. transformers'
            # 0/0 loss already back-propagates zeros; a model's own loss may not.
            return loss * 0.0
        weight = tokens * per_token if self.config.train.loss_normalization == "tokens" else 1
        return loss * (weight * loss_scale)

    def _token_weight(self, all_tokens: float) -> float:
        """With loss_normalization "tokens", what each rank's token sum is multiplied by before the
        backward: about one over the mean label tokens per rank, a power of two (so the gradient is
        the token sum's exactly, rescaled). A seed of tokens x loss_scale would overflow fp16 for
        log2(tokens) halvings of the scale, at the start and after every regrowth; this one is as
        large as "mean"'s. 1 for "mean", or before any rank has a label."""
        if self.config.train.loss_normalization != "tokens" or all_tokens <= 0:
            return 1.0
        return 2.0 ** -math.floor(math.log2(max(all_tokens / self.world, 1.0)))

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

        raw_loss, labelled, tokens = self._loss_of(batch)
        agreed = self._agree_on_loss(raw_loss, labelled, tokens)
        window.note(agreed)
        if window.per_token is None and agreed.tokens > 0:
            # One weight for the whole window (its micro-batches' gradients are summed), chosen
            # from the first micro-batch with labels.
            window.per_token = self._token_weight(agreed.tokens)
        # Whether this backward applies the update (else it only accumulates).
        applies = one or (last and self.fused_accumulation)
        if window.nonfinite or agreed.unlabelled:
            # Known on every rank before the backward (a non-finite loss here, or something
            # non-finite earlier in the window, or no labels anywhere): no rank starts one.
            del raw_loss
            ds_compat.release_all(self.offload)
        else:
            per_token = window.per_token or 1.0
            loss = self._backward_loss(raw_loss, labelled, tokens, 1.0, per_token)
            del raw_loss
            # What the summed gradient is divided by: the seed's per-token weight included; unscaled.
            grad_scale = (1.0 / (self._normalizer(self.micro_step + 1, window.tokens) * per_token * loss_scale)
                          if applies else 1.0)
            if measure:
                loss, grad_scale = self._measuring_pass(batch, loss, grad_scale, rng, result,
                                                        (labelled, tokens, per_token, loss_scale))
            if loss is None:  # overflow in the measuring pass, on some rank
                window.nonfinite = True
            else:
                settings = (PassSettings(lr=lr, grad_scale=grad_scale, clip_value=self.config.train.clip_grad_value,
                                         weight_decay=self.config.lomo.weight_decay) if applies else PassSettings())
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
        return self._end_window(result, applies)

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
        norm = math.sqrt(total) if math.isfinite(total) else math.inf
        result["grad_norm"] = norm
        if not math.isfinite(norm):
            return None, grad_scale  # every rank skips, no parameter is touched
        if self.config.train.clip_grad_norm is not None:
            grad_scale *= min(1.0, self.config.train.clip_grad_norm / (norm + 1e-6))  # as torch's clip_grad_norm_
        if retain:
            ds_compat.restore_backward_counters(counters)
            return loss, grad_scale
        del loss
        # The same random draws (dropout) as the measured forward: the same graph.
        restore_rng(rng, self.device)
        return self._backward_loss(self._loss_of(batch)[0], labelled, tokens, 1.0, per_token), grad_scale

    def _sum_over_ranks(self, values, name: str) -> list[float]:
        """Element-wise sums over the ranks of a few numbers (fp32) or a short 1-D tensor (its
        dtype), read on the host: one of the step's agreements."""
        return self.step_sums.sum(values, name)

    def _normalizer(self, micro_batches: int, tokens: float) -> float:
        """What the summed gradient of a step is divided by: its micro-batches x ranks ("mean"),
        or its label tokens over every rank and micro-batch ("tokens"). Under sequence
        parallelism the replicas are the data-parallel ones: an SP group's ranks share batches."""
        return tokens if self.config.train.loss_normalization == "tokens" else micro_batches * self.sp.dp_size

    def _end_window(self, result: dict[str, Any], applied: bool) -> dict[str, Any]:
        """The window's last micro-batch is in: apply the step from the accumulated gradient (or,
        `applied` in its backward, it is applied already), or skip it on every rank; then start
        the next window."""
        window, length = self.window, self.window_length
        self.micro_step, self.window_length, self.window = 0, self.accumulation_steps, Window()
        if window.nonfinite or not window.backwards:
            # A non-finite loss or gradient in any micro-batch (or no labels in the whole window):
            # the whole step is skipped on every rank, once.
            self._zero_accumulator()
            return self._skip(result, overflow=window.nonfinite)
        result["normalizer"] = self._normalizer(length, window.tokens) * (window.per_token or 1.0)
        if not applied:
            grad_scale = 1.0 / (result["normalizer"] * result["loss_scale"])
            # Exact global norm of the accumulated gradient: per-rank sums of squares, one all-reduce.
            norm_sq = (self.accumulator.sum_of_squares(self.params) * grad_scale**2).reshape(1)
            (total,) = self._sum_over_ranks(norm_sq, "squared norm")
            norm = math.sqrt(total) if math.isfinite(total) else math.inf
            result["grad_norm"] = norm
            if not math.isfinite(norm):
                self.accumulator.zero()  # overflow in some micro-batch on some rank: no parameter touched
                return self._skip(result, overflow=True)
            if self.config.train.clip_grad_norm is not None:
                grad_scale *= min(1.0, self.config.train.clip_grad_norm / (norm + 1e-6))  # as torch's clip_grad_norm_
            self._apply_accumulated(PassSettings(lr=result["lr"], grad_scale=grad_scale,
                                               clip_value=self.config.train.clip_grad_value,
                                               weight_decay=self.config.lomo.weight_decay))
        self._zero_accumulator()
        return self._stepped(result)

    def _zero_accumulator(self) -> None:
        if self.accumulator is not None:  # a window of one accumulates nothing
            self.accumulator.zero()

    def _apply_accumulated(self, settings: PassSettings) -> None:
        """The update as one pass over this rank's accumulated shards, bucket by bucket in the
        layout every rank shares (so per-bucket collectives, AdaLomo's, come in one order)."""
        stats = self.updater.begin_pass(settings, measure=False, step=self.global_step)
        groups = getattr(self.buckets, "layout", None) or [[p] for p in self.params]
        # AdaLomo hands the host part of its host-memory shards to the worker: done before the
        # step ends and the next forward gathers them.
        with self._host_updates_joined():
            for group in groups:
                with self.timers.span("update"):
                    self.updater.apply_bucket([(p, self.accumulator.lazy_total(p, self.updater.slice_device(p)))
                                               for p in group], stats)

    def _stepped(self, result: dict[str, Any]) -> dict[str, Any]:
        """End a step that was applied."""
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
        if self.consecutive_skips >= self.config.lomo.max_consecutive_skips:
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
        return causal_lm_loss(self.module, self.loss_head, move_batch(batch, self.device),
                              self.config.memory.loss_chunk_logits, reduction="sum").loss

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
                "global_step": self.global_step, "skipped_steps": self.skipped_steps,
                "consecutive_skips": self.consecutive_skips,
                "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None}

    def load_shard_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what shard_state_dict wrote, on the rank that wrote it; every refusal of the
        shards comes before any shard is written."""
        if state["world"] != self.world or state["rank"] != self.rank:
            raise ValueError(f"checkpoint shard was written by rank {state['rank']} of {state['world']}, "
                             f"this is rank {self.rank} of {self.world}")
        self.updater.load_state_dict(state, self.module, self.params)
        self.global_step = state["global_step"]
        self.skipped_steps = state["skipped_steps"]
        self.consecutive_skips = state.get("consecutive_skips", 0)
        if self.loss_scaler is not None and state["loss_scaler"] is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        ds_compat.release_all(self.offload)
