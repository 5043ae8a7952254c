"""What the multi-rank GRPO checks build and measure; tests/integrations/test_grpo.py declares them
(tests/ranks.py runs them inside the per-world-size launches) and asserts on rank 0's figures.

LomoGRPOTrainer (TRL's GRPOTrainer with LomoTrainerMixin) trains a tiny LLaMA on prompts of the
built-in chat task with FIXED completions: TRL's rollout_func hook returns token ids drawn from a
seed of the prompt and the row (no sampling), so rewards and advantages are deterministic. Every
micro-batch each rank trained on is recorded as TRL prepared it (advantages, masks, the old and
reference log-probs). The single-process reference then steps once per window with TRL's own loss
(GRPOTrainer._compute_loss) on an unpartitioned copy of the starting model, summed over the
window's micro-batches and averaged over the ranks (as DeepSpeed's data parallelism weighs TRL's
loss), global-norm clipping, and torch.optim.SGD or the reference AdaLomo with the Trainer's
learning rates. The reference recomputes what the policy computed: the reference log-probs (with
the starting model) and the old log-probs (with its own parameters at the generation step).
"""
from __future__ import annotations

import copy
import json
import os
import zlib

import torch

from tests.adalomo_reference import ReferenceAdaLomo
from tests.integrations.dist_dpo_checks import built_on_every_rank, reference_step, tiny_policy
from tests.integrations.dist_hf_checks import diff, ds_config, full_params, trainer_session
from tests.ranks import ROOT

CHAT = os.path.join(ROOT, "lomo_ds", "data", "builtin", "chat", "train.jsonl")
BATCH = 2  # completions per rank and micro-batch
K = 2  # gradient_accumulation_steps
STEPS = 4
G = 2  # num_generations
LR = {"lomo": 0.05, "adalomo": 0.01}
PROMPT_TOKENS = 12


def prompts(n: int):
    from datasets import Dataset

    with open(CHAT, encoding="utf-8") as f:
        rows = [json.loads(line)["messages"][0]["content"] for line in f][:n]
    return Dataset.from_list([{"prompt": r} for r in rows])


def fixed_rollouts(tok):
    """TRL's rollout_func: each row's completion from a seed of its prompt, its place among the
    call's rows with that prompt, the rank and the call (crc32: the same in every process)."""
    calls = [0]

    def rollout(prompt_list, trainer):
        rank = torch.distributed.get_rank()
        seen: dict[str, int] = {}
        prompt_ids, completion_ids = [], []
        for p in prompt_list:
            j = seen[p] = seen.get(p, -1) + 1
            seed = zlib.crc32(f"{p}|{j}|{rank}|{calls[0]}".encode())
            g = torch.Generator(device="cpu").manual_seed(seed)
            n = 2 + seed % 6
            prompt_ids.append(tok(p)["input_ids"][:PROMPT_TOKENS])
            completion_ids.append(torch.randint(3, len(tok) - 2, (n,), generator=g, device="cpu").tolist())
        calls[0] += 1
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    return rollout


def reward_mod3(completions, completion_ids, **kw):
    """The share of a completion's tokens divisible by 3 (deterministic, varies within a group)."""
    return [sum(t % 3 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def grpo_config(out_dir: str, optim: str, clip: float, **kw):
    from trl import GRPOConfig

    base = dict(output_dir=out_dir, optim=optim, deepspeed=ds_config(), learning_rate=LR.get(optim, LR["lomo"]),
                per_device_train_batch_size=BATCH, gradient_accumulation_steps=K, max_steps=STEPS,
                lr_scheduler_type="linear", warmup_steps=0, max_grad_norm=clip, logging_steps=1, report_to=[],
                save_strategy="no", seed=0, disable_tqdm=True, bf16=False, num_generations=G,
                max_completion_length=8, beta=0.0, loss_type="grpo", shuffle_dataset=False)
    return GRPOConfig(**{**base, **kw})


def trainer_lrs(lr: float) -> list[float]:
    """The Trainer's learning rate of each step (linear decay, no warm-up: the first step moves)."""
    return [lr * (STEPS - s) / STEPS for s in range(STEPS)]


def _cloned(batch: dict) -> dict:
    return {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in batch.items()}


def _logps(trainer, model, mb) -> torch.Tensor:
    ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], dim=1)
    mask = torch.cat([mb["prompt_mask"], mb["completion_mask"]], dim=1)
    logps, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, mb["completion_ids"].size(1))
    return logps


def check_equivalence(optim: str = "lomo", clip: dict | None = None, **kw) -> dict:
    """`kw`: GRPOConfig values (loss_type, beta, num_iterations, steps_per_generation)."""
    from trl.trainer.utils import add_fused_lm_head

    from lomo_ds.integrations.grpo import LomoGRPOTrainer
    from tests.helpers_data import chatml_tokenizer
    from tests.integrations.dist_hf_checks import _out

    world = torch.distributed.get_world_size()
    max_norm = (clip or {}).get(world, 1e6)
    tok = chatml_tokenizer()
    start = tiny_policy(len(tok))
    seen = []

    class Recording(LomoGRPOTrainer):
        def _prepare_inputs(self, generation_batch):
            out = super()._prepare_inputs(generation_batch)
            if self.model.training:
                seen.append(_cloned(out))
            return out

    name = "_".join([optim, *(f"{k}{v}" for k, v in sorted(kw.items()))])
    with trainer_session():
        args = grpo_config(_out(f"grpo_{name}"), optim, max_norm, **kw)
        trainer = built_on_every_rank(lambda: Recording(
            model=copy.deepcopy(start), reward_funcs=[reward_mod3], args=args, train_dataset=prompts(64),
            processing_class=tok, rollout_func=fixed_rollouts(tok)))
        trainer.train()
        trained = full_params(trainer)
        logs = [h for h in trainer.state.log_history if "loss" in h]
        wrapped = type(trainer.model_wrapped).__name__
        everyone = [None] * world
        torch.distributed.all_gather_object(everyone, seen)

        # The reference, on every rank alike (TRL's loss reduces its metrics over the ranks), on a
        # plain module (no DeepSpeed config registered: TRL's fused head would gather the weight).
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()

        def plain(model):
            model = copy.deepcopy(model)
            add_fused_lm_head(model, temperature=trainer.temperature, outputs=("log_probs", "entropy"))
            return model

        ref, starting = plain(start), plain(start).eval()
        trainer.model.train()
        generate_every = trainer.args.steps_per_generation * trainer.num_iterations
        lrs = trainer_lrs(LR[optim])
        opt = (torch.optim.SGD(ref.parameters(), lr=LR[optim]) if optim == "lomo"
               else ReferenceAdaLomo(ref.parameters(), lr=LR[optim]))
        ref_losses, ref_norms, logp_diff, old_diff, old_recomputed = [], [], 0.0, 0.0, 0
        snapshot = None
        for step in range(STEPS):
            if (step * K) % generate_every == 0:
                snapshot = copy.deepcopy(ref).eval()  # the policy as it generated this batch
            mbs = []
            for k in range(K):
                for r in range(world):
                    mb = dict(everyone[r][step * K + k])
                    with torch.no_grad():
                        if mb.get("ref_per_token_logps") is not None:
                            mine = _logps(trainer, starting, mb)
                            logp_diff = max(logp_diff, (mine - mb["ref_per_token_logps"]).abs().max().item())
                            mb["ref_per_token_logps"] = mine
                        if mb.get("old_per_token_logps") is not None:
                            mine = _logps(trainer, snapshot, mb)
                            old_diff = max(old_diff, (mine - mb["old_per_token_logps"]).abs().max().item())
                            mb["old_per_token_logps"] = mine
                            old_recomputed += 1
                    mbs.append(mb)
            ref.zero_grad()
            loss = sum(trainer._compute_loss(ref, mb) for mb in mbs) / world
            ref_norms.append(reference_step(ref, opt, optim, loss, max_norm, lrs[step]))
            ref_losses.append(loss.item())
    if trained is None:
        return None
    reference = {n: p.detach() for n, p in ref.named_parameters()}
    return {"max_abs_diff": diff(trained, reference), "ref_logp_diff": logp_diff, "old_logp_diff": old_diff,
            "old_recomputed": old_recomputed, "loss": [h["loss"] for h in logs], "ref_loss": ref_losses,
            "grad_norm": [h.get("grad_norm") for h in logs], "ref_grad_norm": ref_norms,
            "lr": [h["learning_rate"] for h in logs], "ref_lr": lrs, "wrapped": wrapped, "clip": max_norm,
            "generations": sum(1 for h in logs if "reward" in h), "rewards": [h.get("reward") for h in logs],
            "kl_logged": [h.get("kl") for h in logs], "micro_batches": len(seen),
            "rows_per_micro_batch": int(seen[0]["completion_ids"].size(0)) if seen else 0}


def check_reward_raises() -> dict:
    """A reward function that raises on one rank's long completions only: every rank raises RewardFunctionError
    (none is left waiting in TRL's gather of the rewards)."""
    from lomo_ds.integrations.grpo import LomoGRPOTrainer
    from tests.helpers_data import chatml_tokenizer
    from tests.integrations.dist_hf_checks import _out

    rank = torch.distributed.get_rank()

    def picky_reward(completions, completion_ids, **kw):
        if rank == 1 and any(len(ids) >= 5 for ids in completion_ids):
            raise ValueError("no 7 please")
        return [0.0] * len(completion_ids)

    tok = chatml_tokenizer()
    raised, message = None, ""
    with trainer_session():
        args = grpo_config(_out("grpo_reward_raises"), "lomo", 1.0)
        trainer = LomoGRPOTrainer(model=tiny_policy(len(tok)), reward_funcs=[picky_reward], args=args,
                                  train_dataset=prompts(64), processing_class=tok, rollout_func=fixed_rollouts(tok))
        try:
            trainer.train()
        except Exception as e:  # noqa: BLE001 (the figure)
            raised, message = type(e).__name__, str(e)
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, raised)
    return {"raised": every, "message": message}


class HostAllocations:
    """A dispatch mode recording every new host tensor an op makes inside it (not views, not
    in-place results); `held()`: the bytes of those still alive."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        record = self._record

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                          if isinstance(t, torch.Tensor) and t.device.type == "cpu"}
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.device.type == "cpu" \
                            and t.untyped_storage().data_ptr() not in inputs:
                        record(t)
                return out

        self.mode = Mode()
        self._made: list = []

    def _record(self, t: torch.Tensor) -> None:
        import weakref

        self._made.append(weakref.ref(t))

    def held(self) -> int:
        storages = {}
        for ref in self._made:
            t = ref()
            if t is not None:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())


def check_host_reference_swap() -> dict:
    """The host reference's swap (StartingWeights.swapped_in) on a real ZeRO-3 engine whose live
    shards have moved one step from the starting ones: the host bytes the swap itself allocates and
    still holds when the reference's forward starts (beside the starting shards it keeps for the
    whole run), and the order of its shard writes against ZeRO-3's gather stream
    (ds_compat.gathers_wait_for_updates, recorded with what the shards hold when it is called)."""
    import lomo_ds
    from lomo_ds.integrations.grpo import StartingWeights
    from lomo_ds.runtime import ds_compat
    from tests.engine.dist_engine_checks import ds_cfg
    from tests.tiny import global_batch, tiny_llama

    engine = lomo_ds.initialize(tiny_llama(0), ds_cfg())
    weights = StartingWeights(engine)
    engine.train_step(global_batch(0, engine.world)[engine.rank])
    trained = [ds_compat.shard(p).clone() for p in engine.params]

    def holds(values) -> bool:
        return all(torch.equal(ds_compat.shard(p), v) for p, v in zip(engine.params, values, strict=True))

    orders, inner = [], ds_compat.gathers_wait_for_updates

    def recorded(offload):
        orders.append("start" if holds(weights.shards) else "trained" if holds(trained) else "neither")
        inner(offload)

    allocations = HostAllocations()
    ds_compat.gathers_wait_for_updates = recorded
    try:
        swap = weights.swapped_in()
        with allocations.mode:
            swap.__enter__()
        swap_bytes, in_block = allocations.held(), list(orders)
        ids = global_batch(1, engine.world)[engine.rank]["input_ids"]
        with torch.no_grad():
            engine.module(input_ids=ids)
        swap.__exit__(None, None, None)
    finally:
        ds_compat.gathers_wait_for_updates = inner
    return {"swap_host_bytes": swap_bytes, "starting_host_bytes": weights.nbytes(),
            "shard_bytes": sum(t.numel() * t.element_size() for t in trained),
            "dtype": str(trained[0].dtype), "world": engine.world,
            "orders_in_block": in_block, "orders_after": orders[len(in_block):],
            "moved": not holds(weights.shards), "restored": holds(trained)}
