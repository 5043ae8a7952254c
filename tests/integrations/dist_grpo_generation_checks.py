"""TRL's own generation under LomoGRPOTrainer: at every generation batch, the completions TRL
samples from the ZeRO-3 engine (the whole model gathered once per generation batch,
ds3_gather_for_generation) equal those an unpartitioned model with the engine's current weights
samples from the same inputs and the same random state.

The equivalence checks (dist_grpo_checks.py) fix the rollouts, so they never run TRL's generation.
Here nothing is fixed: TRL tokenizes, pads and samples as in a user's run. The plain model's
weights are the engine's own after the previous optimizer step (full_state_dict, taken at that
step's end), so a gather that left a parameter stale, partial or half-written, or generated with
the starting weights after an update, samples other tokens. The check also reports whether the
starting weights would have sampled differently at the second batch: where they would not, an
equal result proves little, and the test says so.
"""
from __future__ import annotations

import copy

import torch

from tests.integrations.dist_dpo_checks import built_on_every_rank, tiny_policy
from tests.integrations.dist_grpo_checks import grpo_config, prompts, reward_mod3
from tests.integrations.dist_hf_checks import _out, trainer_session

COMPLETION = 8  # tokens a completion
STEPS = 2  # one generation batch a step: the second is sampled from once-updated weights
LR = 0.5  # large, so that one update moves the sampled tokens (a stale gather then shows)


def _rng_states(device: torch.device) -> dict:
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def _set_rng_states(states: dict, device: torch.device) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)


def _on_every_rank(state: dict | None) -> dict:
    """Rank 0's full state dict (full_state_dict's), on every rank, as host tensors."""
    box = [{k: v.detach().cpu() for k, v in state.items()} if state is not None else None]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _sample(model, inputs: dict, config, rng: dict) -> torch.Tensor:
    device = next(model.parameters()).device
    _set_rng_states(rng, device)
    with torch.no_grad():
        return model.generate(**{k: v.to(device) for k, v in inputs.items()}, generation_config=config).cpu()


def check_generation() -> dict:
    """Collective: every rank compares its own generation batches."""
    from transformers import TrainerCallback

    from lomo_ds.integrations.grpo import LomoGRPOTrainer
    from tests.helpers_data import chatml_tokenizer

    tok = chatml_tokenizer()
    start = tiny_policy(len(tok))
    calls, weights = [], [{k: v.detach().clone() for k, v in start.state_dict().items()}]

    def recording_generate(module):
        real = module.generate

        def generate(*args, **kwargs):
            device = kwargs["input_ids"].device
            rng = _rng_states(device)
            out = real(*args, **kwargs)
            inputs = {k: v.detach().cpu().clone() for k, v in kwargs.items() if torch.is_tensor(v)}
            calls.append((inputs, kwargs.get("generation_config"), rng, out.detach().cpu().clone()))
            return out
        return generate

    class StepWeights(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):  # every rank: full_state_dict is collective
            weights.append(_on_every_rank(trainer.lomo_engine.full_state_dict()))

    with trainer_session():
        args = grpo_config(_out("grpo_generation"), "lomo", 1e6, gradient_accumulation_steps=1, max_steps=STEPS,
                           max_completion_length=COMPLETION, learning_rate=LR)
        trainer = built_on_every_rank(lambda: LomoGRPOTrainer(
            model=copy.deepcopy(start), reward_funcs=[reward_mod3], args=args, train_dataset=prompts(16),
            processing_class=tok, callbacks=[StepWeights()]))
        trainer.model.generate = recording_generate(trainer.model)
        trainer.train()
        device = trainer.accelerator.device
    plain = copy.deepcopy(start).to(device).eval()
    per_batch = []
    for i, (inputs, config, rng, engine_out) in enumerate(calls):
        plain.load_state_dict(weights[i])
        mine = _sample(plain, inputs, config, rng)
        row = {"same": engine_out.shape == mine.shape and bool(torch.equal(engine_out, mine)),
               "rows": int(engine_out.size(0)), "do_sample": bool(config.do_sample)}
        if i > 0:  # would the starting weights have sampled the same? (then a stale gather could not show)
            plain.load_state_dict(weights[0])
            stale = _sample(plain, inputs, config, rng)
            row["stale_differs"] = stale.shape != engine_out.shape or not bool(torch.equal(stale, engine_out))
        per_batch.append(row)
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, per_batch)
    moved = max((weights[-1][k] - weights[0][k]).abs().max().item() for k in weights[0])
    return {"per_rank": everyone, "steps": STEPS, "weights_moved": moved}
