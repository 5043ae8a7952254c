"""LOMO and AdaLomo inside Hugging Face's Trainer and TRL's SFTTrainer.

    class MyTrainer(LomoTrainerMixin, SFTTrainer): ...      # or (LomoTrainerMixin, Trainer)
    args = SFTConfig(..., optim="lomo", deepspeed="ds_zero3.json")   # may carry `lomo`, `memory`, ... sections
    MyTrainer(model=model, args=args, ...).train()

Under DeepSpeed the Trainer builds its optimizer through create_optimizer() and hands it to
accelerate, which would wrap it in a ZeRO-3 optimizer (fp32 partitions, gradient buffers) and
back-propagate through DeepSpeed's own backward: the fused path never runs. The mixin instead:

- builds a LomoEngine in create_optimizer (lomo_ds's own deepspeed.initialize, with no
  optimizer) and returns a stand-in optimizer that holds no state; the Trainer's scheduler runs
  on it, and each step's fused update takes the scheduler's learning rate. Accelerate is kept
  from building a second DeepSpeed engine: the model the Trainer "wraps" is the LomoEngine's.
- runs training_step through the engine: the engine calls the Trainer's compute_loss (so
  SFTTrainer's own loss path, its fused LM head included) for its forward, and does the backward
  and the update (two passes over the retained graph when the norm is clipped, never a second
  compute_loss). The Trainer's token-mean loss (num_items_in_batch over the window and every
  rank, times the rank count) is turned back into this micro-batch's token mean, which
  train.loss_normalization `tokens` weighs by its tokens and divides by the window's: the Trainer's
  normalisation, applied once.
- turns the step's tail into reports: _clip_grad_norm returns the engine's exact norm, the
  stand-in's step() checks that the window has ended, zero_grad has nothing to free.
- saves the model as a from_pretrained folder (parameters gathered one at a time) and each rank's
  shard state beside the Trainer's scheduler, RNG and state files; resumes from them exactly.

TrainingArguments are checked in the constructor before the Trainer builds anything
(training_args.py holds the table of what is supported, mapped or refused).
"""
from __future__ import annotations

import copy
import math
import os
from typing import Any

import torch

from lomo_ds.config.checks.int8_shards import refuse_int8_conflicts
from lomo_ds.config.engine_config import load_config
from lomo_ds.config.lomo_section import Precision
from lomo_ds.engine.lomo_engine import LomoEngine
from lomo_ds.integrations.preemption import PreemptionCallback
from lomo_ds.integrations.training_args import (
    TrainingArgumentsError,
    check_trainer_class,
    check_training_arguments,
    mapped_values,
    merge_mapped,
    sequence_parallel_size,
)
from lomo_ds.methods.lomo import load_engine_state
from lomo_ds.runtime import ds_compat
from lomo_ds.runtime.device import group_device
from lomo_ds.runtime.dist import io_barrier, label_tokens
from lomo_ds.runtime.layout import ParallelLayout
from lomo_ds.runtime.preemption import PREEMPTED_EXIT
from lomo_ds.storage.checkpoint import IO_TIMEOUT_S, write_atomic, write_hf_model
from lomo_ds.storage.engine_state import save_engine_state

# A Trainer script's process group is started by accelerate (TrainingArguments, `accelerate launch`),
# not by lomo_ds.init_distributed: DeepSpeed's CPU backend must start without its shared-memory
# all-reduce op there too (lomo_ds never calls it; on a CPU its first use is a C++ build of
# minutes). Here, at import, since a script imports the mixin before it builds its arguments;
# idempotent, and nothing but a module attribute until a process group starts.
ds_compat.skip_shm_allreduce_op()


def _without_auto(config):
    """The config without the `auto` values the Trainer fills only once training starts."""
    if isinstance(config, dict):
        return {k: _without_auto(v) for k, v in config.items() if v != "auto"}
    return config


def complete_distributed_state() -> None:
    """Make accelerate see every rank of a CPU launch. On a machine without an accelerator it finds
    no distributed backend for DeepSpeed and leaves its state at one process (DeepSpeed itself has
    started the process group): every rank would then train on the whole dataset. The state is
    completed from torch.distributed, so the Trainer's data sharding and token counts span the ranks."""
    from accelerate.state import PartialState

    if not torch.distributed.is_initialized():
        return
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    state = PartialState()
    if state.num_processes == world:
        return
    if state.device.type != "cpu":
        raise RuntimeError(f"accelerate sees {state.num_processes} process(es) on {state.device}, torch.distributed "
                           f"{world}; launch with deepspeed, torchrun or accelerate launch")
    PartialState._shared_state.update(backend=torch.distributed.get_backend(), num_processes=world,
                                      process_index=rank,
                                      local_process_index=int(os.environ.get("LOCAL_RANK", rank)))


def _drop_node_local_storage(ds: dict, args) -> None:
    """Remove from `ds` what transformers writes into it for save_on_each_node: the checkpoint
    section's use_node_local_storage, for DeepSpeed's own save_checkpoint, which LOMO's checkpoints
    do not go through (save_model and the shard state honour save_on_each_node themselves). A
    checkpoint section of the user's is left, to be refused as in lomo_ds's own configs."""
    section = ds.get("checkpoint")
    if not (args.save_on_each_node and isinstance(section, dict) and "use_node_local_storage" in section):
        return
    rest = {k: v for k, v in section.items() if k != "use_node_local_storage"}
    if rest:
        ds["checkpoint"] = rest
    else:
        del ds["checkpoint"]


class TrainerLomoEngine(LomoEngine):
    """A LomoEngine whose forward is the Trainer's compute_loss for the step being taken."""

    loss_fn = None

    def forward(self, batch: dict[str, Any]):
        return super().forward(batch) if self.loss_fn is None else self.loss_fn(batch)


def _check_sequence_parallel_loss(cls, args, compute_loss_func) -> None:
    """Under sequence parallelism each rank's loss is lomo_ds's causal-LM loss of its slice
    (engine/sequence_loss.py): a trainer with a loss of its own would be silently replaced."""
    from transformers import Trainer

    if sequence_parallel_size(args) == 1:
        return
    if compute_loss_func is not None or cls.compute_loss is not Trainer.compute_loss:
        raise TrainingArgumentsError(
            "parallelism_config.sp_size: under sequence parallelism the loss is lomo_ds's causal-LM loss of each "
            f"rank's slice of the rows; {cls.__name__} computes its own (compute_loss or compute_loss_func), "
            "which is not supported with it: use LomoTrainerMixin with transformers' Trainer")


class WithPositions:
    """A loader whose batches get whole-row position ids where they have none (what DeepSpeed's
    Ulysses data-loader adapter requires before it splits the rows)."""

    def __init__(self, loader):
        self.loader = loader

    def __len__(self):
        return len(self.loader)

    def __getattr__(self, name):  # set_epoch, sampler, ... of the loader
        return getattr(self.loader, name)

    def __iter__(self):
        for batch in self.loader:
            if "position_ids" not in batch:
                ids = batch["input_ids"]
                positions = torch.arange(ids.shape[-1], device=ids.device)
                batch = {**batch, "position_ids": positions.expand_as(ids).contiguous()}
            yield batch


class _TrainerSchedule:
    """The engine's schedule, read from the Trainer's scheduler: the lr of the step being taken."""

    def __init__(self, trainer):
        self.trainer = trainer

    def lr_at(self, step: int) -> float:
        return float(self.trainer.lr_scheduler.get_last_lr()[0])


class LomoStepOptimizer(torch.optim.Optimizer):
    """What the Trainer steps: no state, no gradients. The update was applied inside the window's
    last backward; step() checks that it was, so a Trainer calling it mid-window is an error."""

    def __init__(self, engine: LomoEngine, params, lr: float):
        super().__init__(params, {"lr": lr})
        self.engine = engine

    @torch.no_grad()
    def step(self, closure=None):
        if self.engine.micro_step != 0:
            raise RuntimeError(f"optimizer.step() after {self.engine.micro_step} micro-batch(es) of a window of "
                               f"{self.engine.window_length}: the Trainer's accumulation and the engine's disagree")
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None  # the engine frees every gradient as it is reduced


class LomoTrainerMixin:
    """Mix in first: `class T(LomoTrainerMixin, Trainer)` or `(LomoTrainerMixin, SFTTrainer)`."""

    def __init__(self, *args, **kwargs):
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        check_trainer_class(type(self))
        check_training_arguments(training_args)
        complete_distributed_state()
        # The DeepSpeed keys and the engine's sections are checked here too, before any rank builds
        # anything (the mapped values whose loss normalisation depends on the model are
        # re-checked when the engine is built).
        self._lomo_config(training_args, _without_auto(training_args.hf_deepspeed_config.config), tokens=True)
        self.lomo_engine: TrainerLomoEngine | None = None
        self._lomo_last: dict[str, Any] = {}
        # enable_jit_checkpoint is mapped: transformers' own callback would save mid-window.
        jit = bool(getattr(training_args, "enable_jit_checkpoint", False))
        if jit:
            training_args.enable_jit_checkpoint = False
        # parallelism_config's sp_size is the engine's train.sequence_parallel_size: the engine
        # owns Ulysses and its groups, so accelerate is built without it (it would wrap the
        # attention a second time and compute the loss its own way).
        _check_sequence_parallel_loss(type(self), training_args, kwargs.get("compute_loss_func"))
        parallelism = getattr(training_args, "parallelism_config", None)
        training_args.parallelism_config = None
        try:
            super().__init__(*args, **kwargs)
        finally:
            training_args.parallelism_config = parallelism
        self._preemption = PreemptionCallback() if jit else None
        if jit:
            training_args.enable_jit_checkpoint = True  # as the caller gave it (saved with the checkpoint)
            self.add_callback(self._preemption)

    def train(self, *args, **kwargs):
        """The Trainer's train(); stopped by a signal (enable_jit_checkpoint), the process exits with
        PREEMPTED_EXIT once every rank has saved the checkpoint of the agreed step."""
        out = super().train(*args, **kwargs)
        stopped = self._preemption.stopped_at if self._preemption is not None else None
        if stopped is not None:
            if self.args.process_index == 0:
                print(f"preempted after step {stopped}: checkpoint {self.args.output_dir}/checkpoint-{stopped}; "
                      f"run again with resume_from_checkpoint", flush=True)
            raise SystemExit(PREEMPTED_EXIT)
        return out

    # ------------------------------------------------------------------ configuration
    @staticmethod
    def _lomo_config(args, ds_config: dict, tokens: bool) -> tuple[dict, Any]:
        ds = copy.deepcopy(ds_config)
        _drop_node_local_storage(ds, args)
        ds = merge_mapped(ds, mapped_values(args, tokens))
        # The Trainer's arguments decide these (transformers checks a value the user's file gives
        # against them; accelerate fills a missing one with its own default, not the user's).
        ds.update(gradient_accumulation_steps=args.gradient_accumulation_steps,
                  train_micro_batch_size_per_gpu=args.per_device_train_batch_size,
                  gradient_clipping=args.max_grad_norm)
        precision = {"bf16": args.bf16, "fp16": args.fp16}
        for name, on in precision.items():
            section = ds.setdefault(name, {})
            if section.get("enabled") in (None, "auto"):
                section["enabled"] = bool(on)
            elif bool(section["enabled"]) != bool(on):
                raise TrainingArgumentsError(f"{name}: {on} but the DeepSpeed config's {name}.enabled is "
                                             f"{section['enabled']}; set only one of them")
        try:
            ds, config = load_config(ds)
        except ValueError as e:
            raise TrainingArgumentsError(f"deepspeed: {e}") from None
        if config.memory.int8_shards and args.fp16:  # named as the argument that sets it
            raise TrainingArgumentsError("fp16: expected False with the DeepSpeed config's memory.int8_shards "
                                         "(8-bit shards dequantize to bf16 or fp32: set bf16=True or neither)")
        try:  # what 8-bit shards cannot run with, before train() builds the engine (which refuses it too)
            refuse_int8_conflicts(config.memory, config.lomo, ds)
        except ValueError as e:
            raise TrainingArgumentsError(f"deepspeed: {e}") from None
        return ds, config

    @property
    def _loss_by_tokens(self) -> bool:
        """Whether the Trainer normalises the loss by num_items_in_batch (see Trainer._get_num_items_in_batch)."""
        return bool(self.model_accepts_loss_kwargs or self.compute_loss_func is not None)

    # ------------------------------------------------------------------ optimizer and scheduler
    def create_optimizer(self, model=None):
        """Build the LomoEngine (once) and the stand-in optimizer the Trainer's scheduler runs on.
        Called by the Trainer's deepspeed_init, after it has filled the config's `auto` values."""
        self._build_lomo_engine()
        if self.optimizer is None:
            self.optimizer = LomoStepOptimizer(self.lomo_engine, self.lomo_engine.params, self.args.learning_rate)
        return self.optimizer

    def _build_lomo_engine(self) -> TrainerLomoEngine:
        """The LomoEngine on the Trainer's model (once), from the DeepSpeed config with its `auto`
        values filled (deepspeed_init fills them before create_optimizer; a trainer that needs the
        engine earlier fills the model-dependent ones itself, as DPO's reference pass does)."""
        if self.lomo_engine is None:
            hf_ds = self.accelerator.state.deepspeed_plugin.hf_ds_config.config
            ds_config, config = self._lomo_config(self.args, hf_ds, tokens=self._loss_by_tokens)
            self.lomo_engine = TrainerLomoEngine(self.model, ds_config, config, precision=Precision.of(ds_config),
                                                 layout=self._lomo_layout())
            self.lomo_engine.schedule = _TrainerSchedule(self)
        return self.lomo_engine

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        optimizer = optimizer if optimizer is not None else self.optimizer
        if not isinstance(optimizer, LomoStepOptimizer):
            raise RuntimeError("create_scheduler: expected the LOMO stand-in optimizer from create_optimizer")
        return super().create_scheduler(num_training_steps=num_training_steps, optimizer=optimizer)

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        # The LomoEngine's DeepSpeedEngine is the wrapped model: with it the Trainer skips
        # accelerator.prepare(model), which would build a second DeepSpeed engine around the model.
        if self.lomo_engine is not None:
            return self.lomo_engine.ds_engine
        if not training:
            raise RuntimeError("LomoTrainerMixin: evaluation before train() would build a second DeepSpeed engine; "
                               "evaluate during or after training")
        return super()._wrap_model(model, training=training, dataloader=dataloader)

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        # The Trainer would resume through DeepSpeed's checkpoint loader; LOMO's state is its own.
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, None)
        if resume_from_checkpoint is not None:
            self._load_lomo_checkpoint(resume_from_checkpoint)
        return model, train_dataloader

    def get_train_dataloader(self):
        """The Trainer's loader; under sequence parallelism wrapped in DeepSpeed's
        UlyssesSPDataLoaderAdapter over the engine's SP group: each SP rank gets its slice of one
        rank's batch in turn (position ids whole-row, labels shifted before the split)."""
        loader = super().get_train_dataloader()
        if sequence_parallel_size(self.args) == 1:
            return loader
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

        sp = self._lomo_layout().sp
        return UlyssesSPDataLoaderAdapter(WithPositions(loader), sp_rank=sp.rank, sp_group=sp.group,
                                          sp_world_size=sp.size, device=group_device(sp.group))

    def _lomo_layout(self) -> ParallelLayout:
        """The process's parallel layout for parallelism_config's sp_size: the loader's SP slices and
        the engine's groups are the same (built on the first call, collectively)."""
        return ParallelLayout.build(sequence_parallel_size(self.args))

    # ------------------------------------------------------------------ the step
    def _label_count(self, inputs: dict[str, Any]) -> int:
        """This micro-batch's label tokens as the Trainer counts them for num_items_in_batch."""
        if "shift_labels" in inputs:
            return int(inputs["shift_labels"].ne(-100).sum())
        labels = inputs["labels"]
        return int((labels[..., 1:] if self._loss_shifts_labels else labels).ne(-100).sum())

    def training_step(self, model, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        """One micro-batch through the engine: the Trainer's loss, LOMO's backward and update."""
        engine = self.lomo_engine
        if engine.micro_step == 0:
            # The Trainer's last window of an epoch may be shorter than gradient_accumulation_steps.
            window = getattr(self, "current_gradient_accumulation_steps", engine.accumulation_steps)
            if window != engine.accumulation_steps:
                engine.start_window(window)
        model.train()
        inputs = self._prepare_inputs(inputs)
        by_tokens = engine.config.train.loss_normalization == "tokens"
        scale = None
        if engine.sp.size > 1:
            # A slice of a sequence: the engine's own loss weighs it (engine/sequence_loss.py).
            return self._lomo_step(engine, inputs, None)
        if by_tokens and num_items_in_batch is not None:
            mine = self._label_count(inputs)
            if mine != label_tokens(inputs):
                raise ValueError(f"labels: the Trainer counts {mine} label tokens in this micro-batch, lomo_ds "
                                 f"{label_tokens(inputs)} (a collator's shift_labels?); they must agree")
            # The Trainer's loss: this micro-batch's token sum / the window's tokens on every rank,
            # times the rank count when averaged over them. Back to this micro-batch's token mean:
            # the engine weighs it by its tokens and divides by the window's.
            averaged = self.args.average_tokens_across_devices
            ranks = self.accelerator.num_processes // self.get_tp_size() if averaged else 1
            scale = float(num_items_in_batch) / (ranks * mine) if mine else 1.0

        def loss_fn(batch):
            # The module itself, as the engine's own forward: DeepSpeedEngine.forward would arm
            # DeepSpeed's backward prologue, which expects its own optimizer.
            with self.compute_loss_context_manager():
                loss = self.compute_loss(engine.module, dict(batch), num_items_in_batch=num_items_in_batch)
            return loss if scale is None else loss * scale

        return self._lomo_step(engine, inputs, loss_fn)

    def _lomo_step(self, engine, inputs: dict[str, Any], loss_fn) -> torch.Tensor:
        engine.loss_fn = loss_fn
        try:
            out = engine.train_step(inputs)
        finally:
            engine.loss_fn = None
        self._lomo_last = out
        every = self.args.torch_empty_cache_steps
        if every is not None and self.state.global_step % every == 0:
            from accelerate.utils import clear_device_cache

            clear_device_cache()
        # The Trainer sums what this returns over the window and averages it over the ranks and
        # steps it logs: the engine's window loss (the same on every rank) once per window.
        loss = out["loss"] if out["stepped"] else 0.0
        return torch.tensor(loss, dtype=torch.float32, device=self.args.device)

    def _clip_grad_norm(self, model):
        """The clipping happened in the engine (exact global norm, before the update)."""
        return self._lomo_last.get("grad_norm")

    def _get_grad_norm(self, model, grad_norm=None):
        norm = grad_norm if grad_norm is not None else self._lomo_last.get("grad_norm")
        return None if norm is None or not math.isfinite(norm) else float(norm)

    # ------------------------------------------------------------------ saving and loading
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Collective: a folder from_pretrained loads (lomo_ds's streamed export: parameters gathered
        one at a time, each saving rank holding one safetensors file at most, the others waiting for
        its writes under IO_TIMEOUT_S), with the tokenizer / processor and the training arguments.
        The saving ranks are the Trainer's (should_save): rank 0, or with save_on_each_node the
        first rank of every node, each of which makes and writes the whole folder on its own disk
        (the rest of the checkpoint is written beside it there)."""
        from transformers.trainer import TRAINING_ARGS_NAME

        output_dir = output_dir if output_dir is not None else self.args.output_dir
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        saves = self.args.should_save
        write_hf_model(self.model, rank, output_dir, self.processing_class if saves else None, IO_TIMEOUT_S,
                       writes=saves)
        if saves:
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        io_barrier(IO_TIMEOUT_S)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Every rank's shard state (its shards, step and AdaLomo's statistics) and the scheduler."""
        from transformers.trainer import SCHEDULER_NAME

        engine = self.lomo_engine
        os.makedirs(output_dir, exist_ok=True)
        # The recipe's layout (storage/engine_state.py). With save_on_each_node every node's saving
        # rank writes the metadata beside its ranks' pieces, on a disk no other node shares.
        save_engine_state(output_dir, engine.shard_state_dict(), IO_TIMEOUT_S,
                          every_node=self.args.save_on_each_node and self.args.should_save)
        if self.args.should_save:
            write_atomic(os.path.join(output_dir, SCHEDULER_NAME),
                         lambda f: torch.save(self.lr_scheduler.state_dict(), f))
        io_barrier(IO_TIMEOUT_S)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            self._load_lomo_checkpoint(checkpoint)

    def _load_lomo_checkpoint(self, checkpoint: str) -> None:
        from transformers.trainer import SCHEDULER_NAME

        engine = self.lomo_engine
        try:
            state = load_engine_state(engine, checkpoint)  # written by any rank count
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{e}: no LOMO shard state (written with save_only_model?)") from None
        engine.load_shard_state_dict(state)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))
