"""DeepSpeed ZeRO-3 with its own optimizer path: the paper's AdamW and SGD baselines (and LoRA's AdamW).

A torch.optim.AdamW / SGD is handed to `deepspeed.initialize`, which wraps it in
DeepSpeedZeroOptimizer_Stage3 (fp32 master shards, a gradient shard buffer, reduce-scatter
buckets); a step is `engine.backward` + `engine.step`. Clipping is DeepSpeed's
`gradient_clipping`; the schedule (linear warm-up then linear decay, lomo_ds.engine.schedule's shape)
is a LambdaLR handed to DeepSpeed. SGD has no momentum (the paper's Table 1: optimizer
states = the fp32 masters only). Resume is DeepSpeed's own checkpointing.
"""
from __future__ import annotations

# DeepSpeed, transformers, safetensors and peft are imported inside the functions that use them: the
# CLI and the config checks start without them, and recipe/train.py's show_what_matters sets the
# ranks' logging before their first import.
import copy
from typing import Any

import torch

from lomo_ds.comm import configure_param_gather
from lomo_ds.config import leaf_module
from lomo_ds.engine.accumulation import check_window
from lomo_ds.engine.schedule import Schedule
from lomo_ds.methods.base import MethodEngine
from lomo_ds.runtime import ds_compat
from lomo_ds.runtime.device import move_batch
from lomo_ds.runtime.dist import init_distributed, loss_of, mean_over_ranks
from lomo_ds.runtime.memory import MemoryTracker, optimizer_state_bytes, tensor_bytes

DS_CHECKPOINT_TAG = "deepspeed"


def baseline_ds_config(ds_config: dict, clip: float | None) -> dict:
    """The run's DeepSpeed keys with DeepSpeed's own clipping and no optimizer/scheduler sections
    (the optimizer and schedule are handed to deepspeed.initialize as objects)."""
    cfg = copy.deepcopy(ds_config)
    for key in ("optimizer", "scheduler", "gradient_clipping"):
        cfg.pop(key, None)
    if clip:
        cfg["gradient_clipping"] = float(clip)
    return cfg


def linear_lr_factor(total_steps: int, warmup_steps: int):
    """The LR factor of step n for a LambdaLR: linear warm-up then decay (constant with no total)."""
    sched = Schedule("linear" if total_steps > 0 else "constant", 1.0, total_steps, warmup_steps)
    return lambda step: sched.lr_at(step)


class DeepSpeedOptimizerEngine(MethodEngine):
    def __init__(self, model: torch.nn.Module, ds_config: dict, method: str, optimizer: str, *, lr: float,
                 clip: float | None, total_steps: int, warmup_steps: int, weight_decay: float = 0.0,
                 param_gather: str = "auto"):
        import deepspeed

        super().__init__()
        init_distributed()
        # The same parameter fetch as LOMO's (comm.param_gather): the comparison stays fair.
        self.param_gather = configure_param_gather(param_gather)
        self.method = method
        self.ds_config = baseline_ds_config(ds_config, clip)
        trainable = [p for p in model.parameters() if p.requires_grad]
        if optimizer == "sgd":
            # DeepSpeed's ZeRO wrapper runs any torch optimizer on its fp32 partitions; it only
            # asks to be told explicitly for ones outside its tested list.
            self.ds_config["zero_allow_untested_optimizer"] = True
            self.torch_optimizer = torch.optim.SGD(trainable, lr=lr, weight_decay=weight_decay)
        else:
            self.torch_optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay)
        factor = linear_lr_factor(total_steps, warmup_steps)
        self.ds_engine, _, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=self.torch_optimizer, config=leaf_module.resolve(self.ds_config, model),
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor))
        self.module = self.ds_engine.module
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.group = ds_compat.process_group(self.params[0])
        self.world = torch.distributed.get_world_size(self.group)
        self.rank = torch.distributed.get_rank(self.group)
        self.global_step = 0  # optimizer steps
        self.accumulation_steps = int(self.ds_config.get("gradient_accumulation_steps", 1))
        self.micro_step, self.window_length, self._window_losses = 0, self.accumulation_steps, []
        self._hooks = []
        self._peak_fp32_grad = 0

    # ----------------------------------------------------------------- accumulation: DeepSpeed's own
    def is_gradient_accumulation_boundary(self) -> bool:
        return self.micro_step + 1 >= self.window_length

    def start_window(self, micro_batches: int) -> None:
        """A window of `micro_batches` < gradient_accumulation_steps (the end of an epoch): each of
        its losses weighs 1/micro_batches instead of DeepSpeed's 1/gradient_accumulation_steps."""
        check_window(micro_batches, self.accumulation_steps, self.micro_step)
        self.window_length = micro_batches

    def train_step(self, batch: dict[str, Any]) -> dict[str, Any]:
        """One micro-batch: DeepSpeed accumulates its reduced gradient partitions and steps its
        optimizer at the window's last (the boundary is set here on every call, so a shortened
        window moves DeepSpeed's boundary with it)."""
        self.module.train()
        last = self.is_gradient_accumulation_boundary()
        lr = self.torch_optimizer.param_groups[0]["lr"]
        self.ds_engine.set_gradient_accumulation_boundary(last)
        loss = loss_of(self.ds_engine(**move_batch(batch, self.device)))
        # DeepSpeed divides each loss by gradient_accumulation_steps: a shortened window's step is
        # the mean over its own micro-batches.
        weight = self.accumulation_steps / self.window_length
        self.ds_engine.backward(loss * weight if weight != 1 else loss)
        if self.tracker is not None:
            self._note_step_grads()
        self.ds_engine.step()
        self._window_losses.append(mean_over_ranks(loss.detach().float().item(), self.world, self.group))
        self.micro_step += 1
        out = {"loss": sum(self._window_losses) / len(self._window_losses), "lr": lr, "grad_norm": None,
               "skipped": False, "stepped": last, "micro_batches": self.micro_step,
               "loss_scale": float(getattr(self.ds_engine.optimizer, "loss_scale", 1.0) or 1.0)}
        if not last:
            return out
        self.micro_step, self.window_length, self._window_losses = 0, self.accumulation_steps, []
        self.global_step += 1
        norm = self.ds_engine.get_global_grad_norm()
        out.update(grad_norm=float(norm) if norm is not None else None, skipped=not self.ds_engine.was_step_applied())
        return out

    # ----------------------------------------------------------------- resume: DeepSpeed's own checkpoint
    def save_state(self, directory: str) -> None:
        # Collective. Masters, optimizer moments, LR scheduler and loss scaler: DeepSpeed's files.
        if self.micro_step:
            raise RuntimeError(f"save_state: {self.micro_step} micro-batch(es) of a window are accumulated; "
                               "checkpoint at a step boundary")
        self.ds_engine.save_checkpoint(directory, tag=DS_CHECKPOINT_TAG, save_latest=False,
                                       client_state={"global_step": self.global_step})

    def load_state(self, directory: str) -> None:
        path, client = self.ds_engine.load_checkpoint(directory, tag=DS_CHECKPOINT_TAG)
        if path is None:
            raise FileNotFoundError(f"{directory}/{DS_CHECKPOINT_TAG}: no DeepSpeed checkpoint for "
                                    f"train.method={self.method!r}")
        self.global_step = client["global_step"]

    # ----------------------------------------------------------------- memory accounting
    def _make_tracker(self) -> MemoryTracker:
        # Every parameter is counted (frozen base weights are gathered all the same); samples are
        # taken at each trainable parameter's gradient hook, as in the LOMO engine.
        self.tracker = MemoryTracker(self.all_params())
        self._hooks = [p.register_post_accumulate_grad_hook(self._sample) for p in self.params]
        return self.tracker

    def _sample(self, _param) -> None:
        self.tracker.sample()

    def _note_step_grads(self) -> None:
        # At step time DeepSpeed flattens each sub-group's gradient partition into the master dtype.
        for flat in ds_compat.zero3_optimizer_tensors(self.ds_engine.optimizer)["masters"]:
            self._peak_fp32_grad = max(self._peak_fp32_grad, tensor_bytes(flat))

    def _grad_bytes(self) -> int:
        total = sum(tensor_bytes(t) for t in ds_compat.zero3_optimizer_tensors(self.ds_engine.optimizer)["grads"])
        total += self._peak_fp32_grad
        if self.tracker is not None and self.tracker.samples:
            total += self.tracker.peak.grad_bytes
        return total

    def _optimizer_bytes(self) -> int:
        held = ds_compat.zero3_optimizer_tensors(self.ds_engine.optimizer)
        # A master partition that is the parameter shard itself (an fp32 model) is not extra state.
        shards = {t.untyped_storage().data_ptr() for t in held["low_precision"]}
        shards |= {ds_compat.shard(p).untyped_storage().data_ptr() for p in self.params if ds_compat.is_zero_param(p)}
        masters = sum(tensor_bytes(f) for f in held["masters"] if f.untyped_storage().data_ptr() not in shards)
        return masters + optimizer_state_bytes(self.torch_optimizer)
