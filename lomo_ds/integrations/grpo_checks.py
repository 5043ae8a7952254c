"""What LomoGRPOTrainer refuses before DeepSpeed starts (one TrainingArgumentsError line naming the
field), and the guard that turns a reward function's exception into one error on every rank."""
from __future__ import annotations

import importlib.util

import torch

from lomo_ds.integrations.training_args import TrainingArgumentsError, optim_choices


def _world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def check_grpo_arguments(args, model, kwargs: dict) -> None:
    """Refuse a GRPOConfig value (or trainer argument) LomoGRPOTrainer cannot honour."""
    if args is None:
        raise TrainingArgumentsError(f"args: pass GRPOConfig(optim={optim_choices()}, deepspeed=...)")
    if isinstance(model, str):
        raise TrainingArgumentsError("model: pass the loaded model (from_pretrained), not its name: lomo_ds "
                                     "partitions the instance it is given")
    if kwargs.get("peft_config") is not None:
        raise TrainingArgumentsError("peft_config: LOMO trains every weight; adapters are lomo_ds's lora / lora_lomo "
                                     "methods, not this trainer")
    if any(kwargs.get("optimizers", (None, None))):
        raise TrainingArgumentsError("optimizers: the fused update is the optimizer; leave optimizers unset")
    if getattr(args, "use_vllm", False) and importlib.util.find_spec("vllm") is None:
        raise TrainingArgumentsError("use_vllm: vLLM is not installed (pip install vllm), or set use_vllm=False "
                                     "to generate with transformers")
    refused = {
        "ds3_gather_for_generation": (True, "false streams every layer's gather for every generated token; "
                                            "lomo_ds generates with the model gathered once per generation "
                                            "batch (`lomo-ds plan --grpo` gives its memory)"),
        "sync_ref_model": (False, "the reference is the starting weights (host reference); TR-DPO-style "
                                  "reference updates are not supported"),
        "use_transformers_paged": (False, "not tested with lomo_ds's engine"),
        "use_transformers_continuous_batching": (False, "it casts the gathered model's dtype in place; not "
                                                        "tested with lomo_ds's engine"),
        "use_liger_kernel": (False, "not tested with the fused gradient hooks"),
    }
    for name, (accepted, why) in refused.items():
        value = getattr(args, name, accepted)
        if value != accepted:
            raise TrainingArgumentsError(f"{name}: {why} (got {value!r})")
    _check_generation_batch(args)


def _check_generation_batch(args) -> None:
    """GRPOConfig derives the generation batch from the processes accelerate saw when the config was
    built; on CPU ranks that can be one process where the launch has N (complete_distributed_state
    corrects accelerate only later). The batch is derived again from the launch's own rank count,
    keeping steps_per_generation (the micro-batches each generation batch is split into, TRL's
    default gradient_accumulation_steps), and num_generations must divide it."""
    world = _world()
    generation = args.per_device_train_batch_size * world * args.steps_per_generation
    args.generation_batch_size = generation
    if generation % args.num_generations:
        raise TrainingArgumentsError(
            f"num_generations: {args.num_generations} does not divide the generation batch of {generation} "
            f"completions ({args.per_device_train_batch_size} per rank x {world} ranks x steps_per_generation "
            f"{args.steps_per_generation}); each prompt's group must lie in one generation batch")


class RewardFunctionError(RuntimeError):
    """A reward function raised; the message names it and the row of the generation batch."""

    @staticmethod
    def raise_on_every_rank(trainer) -> None:
        """Collective (once per generation batch): raise on every rank if a reward function raised
        on any, after TRL's gather of the rewards, which every rank has reached."""
        mine = getattr(trainer, "_reward_error", None)
        trainer._reward_error = None
        every = [mine]
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            every = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(every, mine)
        errors = [e for e in every if e]
        if errors:
            raise RewardFunctionError("; ".join(errors))


class _Guarded:
    """A synchronous reward function whose exception is recorded (its rows score None, which TRL
    turns into NaN) and re-raised by RewardFunctionError.raise_on_every_rank."""

    def __init__(self, fn, name: str, trainer):
        self.fn, self.__name__, self.trainer = fn, name, trainer

    def __call__(self, prompts, completions, **kwargs):
        try:
            return self.fn(prompts=prompts, completions=completions, **kwargs)
        except Exception as e:  # noqa: BLE001 (recorded, raised on every rank after the gather)
            row = self._first_failing_row(prompts, completions, kwargs)
            where = f"row {row} of rank {torch.distributed.get_rank() if torch.distributed.is_initialized() else 0}'s"
            prompt = str(prompts[row] if row is not None else "?")[:80]
            self.trainer._reward_error = (f"reward function {self.__name__!r} raised {type(e).__name__}: {e} "
                                          f"(prompt index: {where} generation batch, prompt {prompt!r})")
            return [None] * len(prompts)

    def _first_failing_row(self, prompts, completions, kwargs) -> int | None:
        """The first row the function raises on alone (None if each row alone passes)."""
        for i in range(len(prompts)):
            one = {k: (v[i : i + 1] if isinstance(v, list) and len(v) == len(prompts) else v)
                   for k, v in kwargs.items()}
            try:
                self.fn(prompts=prompts[i : i + 1], completions=completions[i : i + 1], **one)
            except Exception:  # noqa: BLE001
                return i
        return None


def guard_reward_funcs(trainer) -> None:
    """Wrap each synchronous reward function of the trainer (reward models and async functions are
    left as TRL runs them)."""
    import inspect

    trainer._reward_error = None
    for i, fn in enumerate(trainer.reward_funcs):
        if isinstance(fn, torch.nn.Module) or inspect.iscoroutinefunction(fn):
            continue
        trainer.reward_funcs[i] = _Guarded(fn, trainer.reward_func_names[i], trainer)
