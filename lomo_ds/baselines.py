"""The paper's baselines behind LomoEngine's interface, and the memory / throughput accounting
the tables use for every method alike.

    engine = build_engine(model, ds_config, method, lomo_cfg=None, **opts)
    engine.enable_memory_tracking()
    out = engine.train_step(batch)   # dict(loss, lr, grad_norm, skipped, loss_scale)
    engine.memory_breakdown()        # per-rank bytes: params, grads, optimizer_states, activations, total

Methods
-------
  "adamw", "sgd"  DeepSpeed ZeRO-3 with its own optimizer path: a torch.optim.AdamW / SGD handed to
                  `deepspeed.initialize`, which wraps it in DeepSpeedZeroOptimizer_Stage3 (fp32
                  master shards, a gradient shard buffer, reduce-scatter buckets). `engine.backward`
                  + `engine.step`; clipping by DeepSpeed's `gradient_clipping` key; a linear LR
                  schedule (warm-up then linear decay) handed to DeepSpeed as its lr_scheduler.
                  SGD has no momentum by default (the paper's Table 1: optimizer states = fp32 master
                  only); `momentum=` adds it.
  "lora"          peft LoRA (rank 2 on q_proj and v_proj, alpha 16), base frozen, the adapters
                  trained by AdamW (LR 5e-4) through DeepSpeed ZeRO-3 as above.
  "lora_lomo"     LoRA adapters trained by AdamW while LOMO updates the base weights, from one
                  backward: a LomoEngine is built over the peft model with the adapters excluded
                  from it (lomo.exclude_params ["*lora_*"], see LoraLomoEngine);
                  after the engine's step the adapters' gradients are averaged over ranks and a torch
                  AdamW steps fp32 copies of them, which are written back to their ZeRO-3 shards.
  "lomo"          lomo_ds.initialize.
  "zero_shot"     no training: ZeRO-3 partitioned forward only (train_step reports the loss).

Memory accounting (per rank, bytes; the same rules for every method)
--------------------------------------------------------------------
On CUDA the caching allocator's `max_memory_allocated` is reported beside the accounting
(`cuda_peak`). On a CPU there is no allocator to ask, so the categories are counted from the
tensors each method holds:

  params            this rank's parameter shards (ZeRO-3 `ds_tensor`) + the peak of gathered full
                    parameters (ZeRO-3 working set, persistent small parameters included), sampled at
                    every gradient hook of the backward pass by lomo_ds.memory.MemoryTracker.
  grads             gradient memory held: for DeepSpeed's optimizer, its gradient shard buffer
                    (`grad_partitions_flat_buffer`, P/world elements) + its reduce buckets (`ipg_buckets`)
                    + the fp32 copy of the largest sub-group's gradient made at step time (when the
                    master dtype differs) + the peak of `.grad` tensors alive at a hook; for LOMO the
                    engine's MemoryTracker (`.grad` alive + the reduce-scatter bucket in flight);
                    for LoRA+LOMO also the adapters' gradients.
  optimizer_states  fp32 master copies that are not the parameter shard itself (DeepSpeed's
                    `fp32_partitioned_groups_flat`; LOMO's optional fp32 masters) + every tensor in
                    the torch optimizer's `state` (AdamW exp_avg/exp_avg_sq, SGD momentum).
                    As in the paper's Table 1 the fp32 masters are optimizer state.
  activations       bytes of the unique storages autograd saves during the forward pass (a
                    `saved_tensors_hooks` around the model's forward), parameters excluded. With
                    activation checkpointing (reentrant) that is the layer-boundary inputs; the
                    recompute of one layer during backward is not counted (as the paper's "memory
                    added during the forward pass").
  total             the sum of the four.
  peak_rss          the process's peak resident set (ru_maxrss) beside it: it includes the Python
                    interpreter, torch, DeepSpeed's buffers and the allocator's slack, so it is an
                    upper bound, not a category sum.

Throughput: `measure_tgs` runs warm-up steps (excluded), then times several steps and reports the
median step time and tokens per rank per second (the paper's TGS, "tokens per GPU per second").
"""
from __future__ import annotations

import contextlib
import copy
import math
import statistics
import time
from typing import Any, Callable, Iterable

import torch

from . import ds_compat
from .engine import gather_full_state_dict, loss_of, mean_over_ranks
from .memory import MemoryTracker, process_peak_rss_bytes

METHODS = ("adamw", "sgd", "lora", "lora_lomo", "lomo", "zero_shot")

LORA_DEFAULTS = {"r": 2, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}
LORA_LR = 5e-4


# ----------------------------------------------------------------------------- helpers
def linear_schedule_fn(total_steps: int, warmup_steps: int = 0) -> Callable[[int], float]:
    """The paper's linear schedule as a LambdaLR factor (same shape as lomo_ds.schedule)."""
    from .schedule import Schedule

    kind = "linear" if total_steps > 0 else "constant"
    sched = Schedule(kind, 1.0, total_steps, warmup_steps)
    return sched.lr_at


class ActivationCounter:
    """Counts the bytes of unique storages autograd saves while the model's forward runs.

    Installed as forward pre/post hooks on the top module, so it sees every forward the engine
    runs (LOMO's second forward in recompute mode included) and keeps the largest.
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.peak = 0
        self._ctx = None
        self._seen: dict[int, int] = {}
        self._param_ptrs: set[int] = set()
        self._handles = [module.register_forward_pre_hook(self._enter),
                         module.register_forward_hook(self._exit)]

    def _pack(self, t: torch.Tensor):
        try:
            if isinstance(t, torch.nn.Parameter) or hasattr(t, "ds_id"):
                return t
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr == 0 or ptr in self._seen or t.device.type == "meta":
                return t
            if ptr in self._param_ptrs:
                return t
            self._seen[ptr] = st.nbytes()
        except Exception:  # a tensor subclass without storage
            pass
        return t

    def _enter(self, module, args):
        if not torch.is_grad_enabled() or self._ctx is not None:
            return
        self._seen = {}
        self._param_ptrs = set()
        for p in module.parameters():
            self._param_ptrs.add(p.data.untyped_storage().data_ptr())
            if hasattr(p, "ds_tensor"):
                self._param_ptrs.add(p.ds_tensor.untyped_storage().data_ptr())
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()

    def _exit(self, module, args, output):
        if self._ctx is None:
            return
        self._ctx.__exit__(None, None, None)
        self._ctx = None
        self.peak = max(self.peak, sum(self._seen.values()))
        self._seen = {}

    def reset(self) -> None:
        self.peak = 0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _tensor_bytes(t) -> int:
    return t.numel() * t.element_size() if torch.is_tensor(t) else 0


def _optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    total = 0
    for state in optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v) and v.numel() > 1:  # skip the scalar `step`
                total += _tensor_bytes(v)
    return total


def _ds_config_for(ds_config: dict, *, clip: float | None) -> dict:
    cfg = copy.deepcopy(ds_config)
    cfg.pop("lomo", None)
    cfg.pop("optimizer", None)
    cfg.pop("scheduler", None)
    zero = cfg.setdefault("zero_optimization", {})
    zero["stage"] = 3
    cfg.setdefault("train_micro_batch_size_per_gpu", 1)
    cfg.setdefault("gradient_accumulation_steps", 1)
    cfg.pop("train_batch_size", None)
    if clip:
        cfg["gradient_clipping"] = float(clip)
    else:
        cfg.pop("gradient_clipping", None)
    return cfg


# ----------------------------------------------------------------------------- engines
class _Base:
    """What every method shares: rank/world, activation counting, the breakdown's layout."""

    method = "base"
    module: torch.nn.Module
    params: list
    group = None

    def _init_tracking(self):
        self.tracker: MemoryTracker | None = None
        self.activations: ActivationCounter | None = None

    def enable_memory_tracking(self):
        self.activations = ActivationCounter(self.module)
        return self._enable_tracker()

    def _enable_tracker(self):
        self.tracker = MemoryTracker(self.params)
        return self.tracker

    def reset_memory(self) -> None:
        if self.tracker is not None:
            self.tracker.reset()
        if self.activations is not None:
            self.activations.reset()

    def _param_bytes(self) -> int:
        peak = self.tracker.peak if self.tracker is not None and self.tracker.samples else None
        if peak is not None:
            return self.tracker.peak_param_bytes - getattr(self.tracker, "master_bytes", 0)
        return sum(_tensor_bytes(ds_compat.shard(p)) if hasattr(p, "ds_tensor") else _tensor_bytes(p.data)
                   for p in self._all_params())

    def _all_params(self):
        seen, out = set(), []
        for p in self.module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    def _grad_bytes(self) -> int:
        return 0

    def _optimizer_bytes(self) -> int:
        return 0

    def memory_breakdown(self) -> dict[str, int]:
        """Per-rank peak bytes by category (see the module docstring for the rules)."""
        from .memory import cuda_peak_bytes

        b = {
            "params": int(self._param_bytes()),
            "grads": int(self._grad_bytes()),
            "optimizer_states": int(self._optimizer_bytes()),
            "activations": int(self.activations.peak if self.activations is not None else 0),
        }
        b["total"] = sum(b.values())
        b["peak_rss"] = process_peak_rss_bytes()
        cuda = cuda_peak_bytes()
        if cuda is not None:
            b["cuda_peak"] = cuda
        return b

    def eval_forward(self, batch: dict[str, Any]):
        self.module.eval()
        with torch.no_grad():
            return self.module(**batch)

    def full_state_dict(self):
        return gather_full_state_dict(self.module, self.rank)


class DeepSpeedOptimizerEngine(_Base):
    """DeepSpeed ZeRO-3 with DeepSpeed's own optimizer path (AdamW, SGD, or LoRA's AdamW)."""

    def __init__(self, model: torch.nn.Module, ds_config: dict, method: str, *, lr: float,
                 clip: float | None = 1.0, total_steps: int = 0, warmup_steps: int = 0,
                 weight_decay: float = 0.0, momentum: float = 0.0, betas=(0.9, 0.999)):
        import deepspeed

        from .engine import init_distributed

        init_distributed()
        self.method = method
        self.ds_config = _ds_config_for(ds_config, clip=clip)
        trainable = [p for p in model.parameters() if p.requires_grad]
        if method == "sgd":
            # DeepSpeed's ZeRO wrapper runs any torch optimizer on its fp32 partitions; it only
            # asks to be told explicitly for ones outside its tested list.
            self.ds_config["zero_allow_untested_optimizer"] = True
            optimizer = torch.optim.SGD(trainable, lr=lr, momentum=momentum, weight_decay=weight_decay)
        else:
            optimizer = torch.optim.AdamW(trainable, lr=lr, betas=betas, weight_decay=weight_decay)
        fn = linear_schedule_fn(total_steps, warmup_steps)
        self.ds_engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, config=self.ds_config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, fn))
        self.module = self.ds_engine.module
        self.torch_optimizer = optimizer
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        first = next(self.module.parameters())
        self.group = ds_compat.process_group(first)
        self.world = torch.distributed.get_world_size(self.group)
        self.rank = torch.distributed.get_rank(self.group)
        self.global_step = 0
        self._init_tracking()
        self._hooks = []
        self._peak_fp32_grad = 0

    def _enable_tracker(self):
        # The tracker counts every parameter (frozen base weights too: they are gathered all the same);
        # samples are taken at each trainable parameter's gradient hook, as the LOMO engine does.
        self.tracker = MemoryTracker(self._all_params())
        self._hooks = [p.register_post_accumulate_grad_hook(self._sample_hook) for p in self.params]
        return self.tracker

    def _sample_hook(self, _param) -> None:
        self.tracker.sample()

    def train_step(self, batch: dict[str, Any]) -> dict[str, Any]:
        self.module.train()
        lr = self.torch_optimizer.param_groups[0]["lr"]
        loss = loss_of(self.ds_engine(**batch))
        self.ds_engine.backward(loss)
        if self.tracker is not None:
            self._note_step_grads()
        self.ds_engine.step()
        self.global_step += 1
        applied = getattr(self.ds_engine, "was_step_applied", lambda: True)()
        norm = self.ds_engine.get_global_grad_norm()
        opt = self.ds_engine.optimizer
        scale = float(getattr(opt, "loss_scale", 1.0) or 1.0)
        return {"loss": mean_over_ranks(loss.detach().float().item(), self.world, self.group), "lr": lr,
                "grad_norm": float(norm) if norm is not None else None, "skipped": not applied,
                "loss_scale": scale}

    def _note_step_grads(self) -> None:
        # At step time DeepSpeed flattens each sub-group's gradient partition into the master dtype.
        opt = self.ds_engine.optimizer
        for flat in getattr(opt, "fp32_partitioned_groups_flat", []):
            self._peak_fp32_grad = max(self._peak_fp32_grad, flat.numel() * flat.element_size())

    def _grad_bytes(self) -> int:
        opt = self.ds_engine.optimizer
        total = _tensor_bytes(getattr(opt, "grad_partitions_flat_buffer", None))
        for bucket in getattr(opt, "ipg_buckets", {}).values():
            total += _tensor_bytes(getattr(bucket, "buffer", None))
        total += self._peak_fp32_grad
        if self.tracker is not None and self.tracker.samples:
            total += self.tracker.peak.grad_bytes
        return total

    def _optimizer_bytes(self) -> int:
        opt = self.ds_engine.optimizer
        shard_ptrs = {ds_compat.shard(p).untyped_storage().data_ptr() for p in self.params if hasattr(p, "ds_tensor")}
        for flat in getattr(opt, "fp16_partitioned_groups_flat", []):
            if flat is not None:
                shard_ptrs.add(flat.untyped_storage().data_ptr())
        masters = sum(_tensor_bytes(f) for f in getattr(opt, "fp32_partitioned_groups_flat", [])
                      if f.untyped_storage().data_ptr() not in shard_ptrs)
        return masters + _optimizer_state_bytes(self.torch_optimizer)


class LomoMethodEngine(_Base):
    """lomo_ds.initialize behind the same breakdown."""

    method = "lomo"

    def __init__(self, model: torch.nn.Module, ds_config: dict, lomo_cfg: dict | None = None):
        from .engine import initialize

        cfg = copy.deepcopy(ds_config)
        # ds_config is shared with the DeepSpeed-optimizer baselines: drop the keys that configure
        # DeepSpeed's optimizer side (LOMO's counterparts come in lomo_cfg).
        cfg.pop("gradient_clipping", None)
        cfg.get("zero_optimization", {}).pop("reduce_bucket_size", None)
        cfg["lomo"] = copy.deepcopy(lomo_cfg if lomo_cfg is not None else cfg.get("lomo", {}))
        self.engine = initialize(model, cfg)
        self.module = self.engine.module
        self.params = self.engine.params
        self.group = self.engine.group
        self.world, self.rank = self.engine.world, self.engine.rank
        self._init_tracking()

    @property
    def global_step(self) -> int:
        return self.engine.global_step

    def _enable_tracker(self):
        self.tracker = self.engine.enable_memory_tracking()
        return self.tracker

    def train_step(self, batch):
        return self.engine.train_step(batch)

    def eval_forward(self, batch):
        return self.engine.eval_forward(batch)

    def full_state_dict(self):
        return self.engine.full_state_dict()

    def _grad_bytes(self) -> int:
        if self.tracker is None or not self.tracker.samples:
            return 0
        return self.tracker.peak.grad_bytes + self.tracker.peak.bucket_bytes

    def _optimizer_bytes(self) -> int:
        return sum(_tensor_bytes(m) for m in self.engine.updater.masters.values())


class LoraLomoEngine(LomoMethodEngine):
    """LOMO on the base weights, AdamW on the LoRA adapters, from one backward pass.

    The engine is told to leave the adapters alone (`lomo.exclude_params`, ADAPTER_PATTERNS added
    to whatever the caller excludes), so LOMO never hooks them and their gradients stay in
    `.grad` (full, tiny, unreduced) after the engine's step. They are then averaged over ranks and
    a torch AdamW steps fp32 copies of the adapters; each rank writes its slice back into the
    adapters' ZeRO-3 shards and persistent (always-gathered) adapters are re-gathered.
    """

    method = "lora_lomo"
    ADAPTER_PATTERNS = ("*lora_*",)

    def __init__(self, model, ds_config, lomo_cfg=None, *, lora_lr: float = LORA_LR, total_steps: int = 0,
                 warmup_steps: int = 0, clip: float | None = 1.0):
        import fnmatch

        adapters = [(n, p) for n, p in model.named_parameters()
                    if any(fnmatch.fnmatch(n, pat) for pat in self.ADAPTER_PATTERNS)]
        if not adapters:
            raise ValueError("lora_lomo needs a peft LoRA model (no lora_ parameters found)")
        for _, p in adapters:
            p.requires_grad_(True)
        lomo_cfg = copy.deepcopy(lomo_cfg if lomo_cfg is not None else ds_config.get("lomo", {}))
        excluded = list(lomo_cfg.get("exclude_params") or [])
        lomo_cfg["exclude_params"] = excluded + [p for p in self.ADAPTER_PATTERNS if p not in excluded]
        super().__init__(model, ds_config, lomo_cfg)
        by_name = dict(self.module.named_parameters())
        self.adapters = [by_name[n] for n, _ in adapters]
        import deepspeed

        with deepspeed.zero.GatheredParameters(self.adapters, modifier_rank=None):
            self.masters = [p.data.detach().float().clone().requires_grad_(True) for p in self.adapters]
        self.lora_optimizer = torch.optim.AdamW(self.masters, lr=lora_lr, weight_decay=0.0)
        fn = linear_schedule_fn(total_steps, warmup_steps)
        self.lora_scheduler = torch.optim.lr_scheduler.LambdaLR(self.lora_optimizer, fn)
        self.lora_clip = clip
        self._adapter_grad_bytes = 0

    def train_step(self, batch):
        out = self.engine.train_step(batch)
        grads = [p.grad if p.grad is not None else torch.zeros(ds_compat.full_shape(p)) for p in self.adapters]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        self._adapter_grad_bytes = max(self._adapter_grad_bytes, sum(_tensor_bytes(g) for g in grads) + _tensor_bytes(flat))
        if self.world > 1:
            ds_compat.all_reduce(flat, group=self.group)
            flat.div_(self.world)
        if out["skipped"]:
            flat.zero_()
        off = 0
        for m in self.masters:
            m.grad = flat[off:off + m.numel()].view_as(m).clone()
            off += m.numel()
        if self.lora_clip:
            torch.nn.utils.clip_grad_norm_(self.masters, self.lora_clip)
        out["lora_lr"] = self.lora_optimizer.param_groups[0]["lr"]
        if not out["skipped"]:
            self.lora_optimizer.step()
        self.lora_scheduler.step()
        for p, m in zip(self.adapters, self.masters):
            p.grad = None
            m.grad = None
            n, part = ds_compat.full_numel(p), ds_compat.shard(p).numel()
            start = self.rank * part
            local = max(0, min(part, n - start))
            if local:
                ds_compat.shard(p)[:local].copy_(m.detach().reshape(-1)[start:start + local])
        ds_compat.release_all(self.engine.offload)
        ds_compat.regather_persistent(self.engine.offload)
        return out

    def _grad_bytes(self) -> int:
        return super()._grad_bytes() + self._adapter_grad_bytes

    def _optimizer_bytes(self) -> int:
        return super()._optimizer_bytes() + sum(_tensor_bytes(m) for m in self.masters) + \
            _optimizer_state_bytes(self.lora_optimizer)


class ZeroShotEngine(_Base):
    """No training: DeepSpeed ZeRO-3 partitions the model (no optimizer); train_step reports the loss."""

    method = "zero_shot"

    def __init__(self, model, ds_config):
        import deepspeed

        from .engine import init_distributed

        init_distributed()
        cfg = _ds_config_for(ds_config, clip=None)
        for p in model.parameters():
            p.requires_grad_(False)
        self.ds_engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=None, optimizer=None)
        self.module = self.ds_engine.module
        self.params = self._all_params()
        first = self.params[0]
        self.group = ds_compat.process_group(first)
        self.world = torch.distributed.get_world_size(self.group)
        self.rank = torch.distributed.get_rank(self.group)
        self.global_step = 0
        self._init_tracking()

    def train_step(self, batch):
        with torch.no_grad():
            loss = loss_of(self.module(**batch))
        if self.tracker is not None:
            self.tracker.sample()
        ds_compat.release_all(ds_compat.offload_of(self.ds_engine))
        self.global_step += 1
        return {"loss": mean_over_ranks(loss.float().item(), self.world, self.group), "lr": 0.0,
                "grad_norm": None, "skipped": True, "loss_scale": 1.0}


# ----------------------------------------------------------------------------- factory
def apply_lora(model: torch.nn.Module, **lora_kwargs) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    # The run config's names (train.lora: rank, alpha, targets) are accepted beside peft's own.
    aliases = {"rank": "r", "alpha": "lora_alpha", "targets": "target_modules"}
    kw = dict(LORA_DEFAULTS)
    kw.update({aliases.get(k, k): v for k, v in lora_kwargs.items()})
    return get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **kw))


def build_engine(model: torch.nn.Module, ds_config: dict, method: str, lomo_cfg: dict | None = None, **opts):
    """An engine with LomoEngine's interface for `method` (one of METHODS).

    opts: lr (adamw/sgd: 1e-5 / 1e-3 by default; lora: 5e-4), clip (DeepSpeed gradient_clipping,
    default 1.0), total_steps, warmup_steps (linear schedule), weight_decay, momentum (sgd),
    lora (dict of LoraConfig overrides), lora_lr (lora_lomo), activation_checkpointing (bool).
    """
    if method not in METHODS:
        raise ValueError(f"method: expected one of {list(METHODS)}, got {method!r}")
    if opts.pop("activation_checkpointing", False):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
        model.config.use_cache = False
    lora_kw = opts.pop("lora", {}) or {}
    sched = {k: opts.pop(k) for k in ("total_steps", "warmup_steps") if k in opts}
    if method == "lomo":
        _reject(opts, method)
        return LomoMethodEngine(model, ds_config, lomo_cfg)
    if method == "zero_shot":
        _reject(opts, method)
        return ZeroShotEngine(model, ds_config)
    if method == "lora_lomo":
        model = apply_lora(model, **lora_kw)
        for n, p in model.named_parameters():
            p.requires_grad_(True)
        lora_lr = opts.pop("lora_lr", LORA_LR)
        clip = opts.pop("clip", 1.0)
        _reject(opts, method)
        return LoraLomoEngine(model, ds_config, lomo_cfg, lora_lr=lora_lr, clip=clip, **sched)
    if method == "lora":
        model = apply_lora(model, **lora_kw)
        opts.setdefault("lr", LORA_LR)
    default_lr = {"adamw": 1e-5, "sgd": 1e-3}.get(method, LORA_LR)
    lr = opts.pop("lr", default_lr)
    allowed = {"clip", "weight_decay", "momentum", "betas"}
    _reject({k: v for k, v in opts.items() if k not in allowed}, method)
    return DeepSpeedOptimizerEngine(model, ds_config, "adamw" if method == "lora" else method, lr=lr,
                                    **sched, **opts)


def _reject(opts: dict, method: str) -> None:
    if opts:
        raise TypeError(f"build_engine(method={method!r}): unexpected option(s) {sorted(opts)}")


# ----------------------------------------------------------------------------- throughput
def measure_tgs(engine, batches: Iterable[dict], warmup: int = 2, steps: int = 5,
                tokens_per_step: int | None = None) -> dict[str, float]:
    """Tokens per rank (GPU) per second: `warmup` steps excluded, median of `steps` timed steps.

    `batches` yields this rank's micro-batches (cycled when short). Each step ends with a barrier
    so the time is the slowest rank's.
    """
    batches = list(batches)
    if not batches:
        raise ValueError("measure_tgs: no batches")
    times = []
    for i in range(warmup + steps):
        batch = batches[i % len(batches)]
        _sync()
        t0 = time.perf_counter()
        engine.train_step(batch)
        _sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    tokens = tokens_per_step if tokens_per_step is not None else int(batches[0]["input_ids"].numel())
    med = statistics.median(times)
    return {"step_time_s": med, "tgs": tokens / med, "tokens_per_step": tokens, "steps": steps,
            "warmup": warmup, "all_times_s": times}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def gib(nbytes: float) -> float:
    return nbytes / 2**30


def mib(nbytes: float) -> float:
    return nbytes / 2**20
