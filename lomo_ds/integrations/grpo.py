"""GRPO with LOMO and AdaLomo: TRL's GRPOTrainer with LomoTrainerMixin.

    from lomo_ds.integrations.grpo import LomoGRPOTrainer
    args = GRPOConfig(..., optim="lomo", deepspeed="ds_zero3.json")
    LomoGRPOTrainer(model=model, reward_funcs=[my_reward], args=args, train_dataset=prompts).train()

TRL's sampling, rewards, advantages, loss types, logging and datasets run unchanged; the mixin puts
each micro-batch's backward and the update on lomo_ds's engine. TRL's generation batch, its
num_iterations passes over it and steps_per_generation slices are TRL's own (its _prepare_inputs):
the engine sees micro-batches, one window of gradient_accumulation_steps per optimizer step, with
exact global-norm clipping as for any other loss.

The loss. Every GRPO loss type TRL has already divides by the window (grpo, bnpo, dr_grpo, luspo
by current_gradient_accumulation_steps; dapo, cispo, vespo by the window's share of the generation
batch's tokens), and DeepSpeed's data parallelism would then average the ranks. The engine takes
each micro-batch's loss as a mean (train.loss_normalization `mean`: the window's gradient is the
mean of its micro-batches' losses over every rank), so what it is handed is TRL's loss times the
window length: the same gradient, the Trainer's normalisation applied once.

Generation. TRL gathers the whole ZeRO-3 model once per generation batch
(ds3_gather_for_generation, its default) and generates with plain transformers. Layer-streamed
generation (ds3_gather_for_generation false: every decoding token gathers every layer again) is
refused; where the gathered model does not fit, `lomo-ds plan --grpo` gives the figure.

The reference (beta > 0). TRL would load a second model from the policy's name and wrap it in a
DeepSpeed engine of its own. Here the starting weights are kept instead: each rank copies its own
1/N shard of every parameter to host memory before the first step (StartingWeights), and the
reference log-probs of each generation batch are computed by the policy's own ZeRO-3 module with
those shards swapped in (each copied into its live shard in place; the trained ones wait in host
memory meanwhile and are copied back after). Exact, one model: 1/N of the weights in host RAM per
rank, twice that while the reference's forward runs (the planner's reference="host").

Refused with one line naming the field (TrainingArgumentsError) before DeepSpeed starts: see
grpo_checks.py. A reward function that raises is re-raised on every rank (the others would wait
in TRL's gather of the rewards), naming the function and the row of the generation batch.
"""
from __future__ import annotations

import contextlib

import torch

from lomo_ds.engine.update.int8 import int8_shard
from lomo_ds.integrations.grpo_checks import RewardFunctionError, check_grpo_arguments, guard_reward_funcs
from lomo_ds.integrations.transformers import LomoTrainerMixin
from lomo_ds.runtime import ds_compat

try:
    from trl import GRPOTrainer
except ImportError as e:  # an older TRL
    raise ImportError(f"lomo_ds.integrations.grpo needs TRL's GRPOTrainer: {e}") from None


class StartingWeights:
    """Each rank's own shard of every parameter as it was when captured, in host memory; swapped
    into the module (and the live shards back out) for the reference's forward."""

    def __init__(self, engine):
        self.engine = engine
        self.shards = [ds_compat.shard(p).detach().to("cpu", copy=True) for p in engine.params]
        # An 8-bit shard's scales (memory.int8_shards), swapped with its integers; None elsewhere.
        self.scales = [_scales_copy(p) for p in engine.params]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.shards, *self.scales) if t is not None)

    @contextlib.contextmanager
    def swapped_in(self):
        """The module computes with the starting weights inside the block. Every gathered copy is
        released first and after (the next gather reads the shard in place then). The live shards
        wait in host memory meanwhile: a second host copy of this rank's shards for the block."""
        engine = self.engine
        engine.release_gathered()
        live = []
        try:
            for p, start, scales in zip(engine.params, self.shards, self.scales, strict=True):
                live.append((ds_compat.shard(p).to("cpu", copy=True), _scales_copy(p)))
                _write(p, start, scales)
            # The writes are queued on the compute stream; ZeRO-3 gathers on a stream of its own:
            # order it after them, or the reference's forward may gather shards half-written.
            engine.shards_written()
            yield
        finally:
            engine.release_gathered()
            for p, (kept, scales) in zip(engine.params, live, strict=False):
                _write(p, kept, scales)
            engine.shards_written()  # the next forward gathers the live shards whole


def _scales_copy(p) -> torch.Tensor | None:
    int8 = int8_shard(p)
    return int8[1].detach().to("cpu", copy=True) if int8 is not None else None


def _write(p, shard: torch.Tensor, scales: torch.Tensor | None) -> None:
    """A shard put back as it was captured: its integers and its scales where it is 8-bit."""
    s = ds_compat.shard(p)
    s.copy_(shard.to(s.device))
    if scales is not None:
        live = int8_shard(p)[1]
        live.copy_(scales.to(live.device))


class HostReference:
    """What TRL calls as `ref_model`: the policy's module with the starting shards swapped in."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.weights: StartingWeights | None = None

    def capture(self) -> None:
        if self.weights is None:
            self.weights = StartingWeights(self.trainer._build_lomo_engine())

    @torch.no_grad()
    def __call__(self, **kwargs):
        if self.weights is None:
            raise RuntimeError("the host reference: no starting weights captured (train() captures them)")
        with self.weights.swapped_in():
            return self.weights.engine.module(**kwargs)


class LomoGRPOTrainer(LomoTrainerMixin, GRPOTrainer):
    """TRL's GRPOTrainer on lomo_ds's engine (module docstring)."""

    def __init__(self, model, reward_funcs=None, args=None, *rest, **kwargs):
        if rest:
            raise TypeError("LomoGRPOTrainer: pass every argument after `args` by keyword")
        check_grpo_arguments(args, model, kwargs)
        beta = float(args.beta)
        # TRL would load a reference model from the policy's name (and a DeepSpeed engine around
        # it) when beta > 0: it builds none with beta 0, and the host reference takes its place.
        args.beta = 0.0
        try:
            super().__init__(model=model, reward_funcs=reward_funcs, args=args, **kwargs)
        finally:
            args.beta = beta
        self.beta = beta
        self.host_reference = HostReference(self) if beta != 0.0 else None
        self.ref_model = self.host_reference
        guard_reward_funcs(self)

    @property
    def _loss_by_tokens(self) -> bool:
        """TRL's GRPO losses are normalised within TRL (module docstring): `mean` here."""
        return False

    def engine_before_training(self):
        """Collective: the LomoEngine, built now if train() has not built it (to evaluate the
        starting model through its ZeRO-3 module); train() then uses this one."""
        if self.lomo_engine is None:
            # deepspeed_init fills the model-dependent `auto` values when train() builds the engine;
            # here they are filled first (the same values: its second fill is a no-op), as for DPO.
            hf_ds = self.accelerator.state.deepspeed_plugin.hf_ds_config
            hf_ds.trainer_config_finalize(self.args, self.model, max(1, self.args.max_steps))
        return self._build_lomo_engine()

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        out = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if self.host_reference is not None:
            if resume_from_checkpoint is not None:
                raise RuntimeError("resume_from_checkpoint with beta > 0: the starting weights of the host "
                                   "reference are not part of a checkpoint; resume with beta 0 or start again")
            self.host_reference.capture()
        return out

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        RewardFunctionError.raise_on_every_rank(self)
        return rewards

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The mixin's step, with GRPOTrainer's own bookkeeping around it (its micro-step counter
        decides when to generate and which slice of the generation batch comes next)."""
        import time

        t0 = time.perf_counter()
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._step += 1
        self._current_train_step_time += time.perf_counter() - t0
        if self._step % self.current_gradient_accumulation_steps == 0:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss times the window length (module docstring); in evaluation, TRL's own."""
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return loss * self.current_gradient_accumulation_steps if model.training else loss
