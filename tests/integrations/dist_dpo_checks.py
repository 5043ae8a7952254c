"""What the multi-rank DPO checks build and measure; tests/integrations/test_dpo.py declares them (tests/ranks.py
runs them inside the per-world-size launches) and asserts on rank 0's figures.

LomoDPOTrainer (TRL's DPOTrainer with LomoTrainerMixin) trains a tiny LLaMA on hard preference
pairs of the built-in chat task (read back through lomo_ds.data.preference, the real `datasets`
loader), K = 2 micro-batches a step, a linear schedule with warm-up, norm clipping. Every
micro-batch each rank trained on is recorded (TRL's collated pair batches with the precomputed
reference log-probs); the single-process reference then steps once per window with TRL's own DPO
loss (DPOTrainer._compute_loss on an unpartitioned copy of the starting model) averaged over the
window's micro-batches of every rank, global-norm clipping, and torch.optim.SGD or the reference
AdaLomo with the Trainer's learning rates.
"""
from __future__ import annotations

import copy
import os

import torch

from tests.adalomo_reference import ReferenceAdaLomo
from tests.integrations.dist_hf_checks import diff, ds_config, full_params, trainer_lrs, trainer_session
from tests.ranks import ROOT

CHAT = os.path.join(ROOT, "lomo_ds", "data", "builtin", "chat", "train.jsonl")
BATCH = 2  # pairs per rank and micro-batch
K = 2
STEPS = 4
LR = {"lomo": 0.05, "adalomo": 0.01}
BETA = 0.5
MAX_LENGTH = 160  # the longest pair of the checks' conversations is 150 tokens with the test tokenizer
# The reference's pre-clip global norms on these pairs are 2.53, 2.46, 2.57, 2.14 on 1 rank and lower
# on 2 (the window's batch doubles); these clip some steps and not others (the test asserts that they do).
CLIP = {1: 2.5, 2: 1.95}


def reference_step(ref, opt, optim: str, loss, clip: float, lr: float) -> float:
    """One step of a single-process reference: `loss`'s gradient clipped to the global norm `clip`,
    then SGD (optim "lomo") or the reference AdaLomo at `lr`. Returns the norm before clipping."""
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip).item()
    if optim == "lomo":
        opt.param_groups[0]["lr"] = lr
    else:
        opt.lr = lr
    opt.step()
    return norm


def pairs_file(world: int) -> str:
    """Hard pairs of the chat task's first conversations, written by rank 0 into the launch's folder."""
    import json

    from lomo_ds.data.preference import hard_pairs, write_jsonl
    from tests.ranks import work_dir

    path = os.path.join(work_dir(), f"dpo_pairs_{world}.jsonl")
    if torch.distributed.get_rank() == 0:
        with open(CHAT, encoding="utf-8") as f:
            conv = [json.loads(line)["messages"] for line in f][: STEPS * K * world * BATCH]
        write_jsonl(path, hard_pairs(conv, seed=5))
    torch.distributed.barrier()
    return path


def tiny_policy(vocab: int, seed: int = 3):
    from transformers import LlamaForCausalLM

    from tests.tiny import tiny_llama_config

    torch.manual_seed(seed)
    cfg = tiny_llama_config(vocab=vocab)
    cfg.max_position_embeddings = MAX_LENGTH  # the chat task's conversations, byte-level tokens
    return LlamaForCausalLM(cfg)


def dpo_config(out_dir: str, optim: str, clip: float, **kw):
    from trl import DPOConfig

    base = dict(output_dir=out_dir, optim=optim, deepspeed=ds_config(), learning_rate=LR.get(optim, LR["lomo"]),
                per_device_train_batch_size=BATCH, gradient_accumulation_steps=K, max_steps=STEPS,
                lr_scheduler_type="linear", warmup_steps=2, max_grad_norm=clip, logging_steps=1, report_to=[],
                save_strategy="no", seed=0, max_length=MAX_LENGTH, disable_tqdm=True, dataset_num_proc=None, bf16=False,
                beta=BETA, precompute_ref_log_probs=True, activation_checkpointing=False,
                train_sampling_strategy="sequential")
    return DPOConfig(**{**base, **kw})


def pairs_in_memory(world: int):
    """The pairs of pairs_file as a dataset held in memory (Dataset.from_list: no cache files)."""
    import json

    from datasets import Dataset

    with open(pairs_file(world), encoding="utf-8") as f:
        return Dataset.from_list([json.loads(line) for line in f])


def built_on_every_rank(build):
    """Collective: build() on every rank, raising on all of them if it raised on any (so that the
    others do not go on into training's collectives while one has stopped)."""
    error = None
    try:
        built = build()
    except Exception as e:  # noqa: BLE001 (told to every rank, then raised)
        error, built = f"rank {torch.distributed.get_rank()}: {type(e).__name__}: {e}", None
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, error)
    if any(every):
        raise RuntimeError("; ".join(e for e in every if e))
    return built


def check_equivalence(optim: str = "lomo", in_memory: bool = False) -> dict:
    """`in_memory`: the pairs as a Dataset.from_list instead of a file read through `datasets`."""
    from trl.trainer.utils import add_fused_lm_head

    from lomo_ds.data.preference import load_preference
    from lomo_ds.integrations.dpo import LomoDPOTrainer
    from tests.helpers_data import chatml_tokenizer
    from tests.integrations.dist_hf_checks import _out

    world = torch.distributed.get_world_size()
    clip = CLIP[world]
    tok = chatml_tokenizer()
    data = pairs_in_memory(world) if in_memory else load_preference(pairs_file(world))
    start = tiny_policy(len(tok))
    seen = []

    class Recording(LomoDPOTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            seen.append({k: v.detach().cpu().clone() for k, v in inputs.items()})
            return super().training_step(model, inputs, num_items_in_batch)

    with trainer_session():
        args = dpo_config(_out(f"dpo_{optim}{'_in_memory' if in_memory else ''}"), optim, clip)
        trainer = built_on_every_rank(
            lambda: Recording(model=copy.deepcopy(start), args=args, train_dataset=data, processing_class=tok))
        trainer.train()
        trained = full_params(trainer)
        logs = [h for h in trainer.state.log_history if "loss" in h]
        wrapped = type(trainer.model_wrapped).__name__
        n_engines = _deepspeed_engines(trainer.model)
        everyone = [None] * world
        torch.distributed.all_gather_object(everyone, seen)

        # The reference, on every rank alike (TRL's loss gathers its metrics over the ranks), on a
        # plain module: TRL's fused head gathers the LM-head weight itself while a ZeRO-3 config is
        # registered with transformers.
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        ref = copy.deepcopy(start)
        add_fused_lm_head(ref, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
        ref.train()
        ref_logp_diff = 0.0
        with torch.no_grad():
            for mb in (mb for part in everyone for mb in part):
                c, r = trainer.compute_ref_log_probs(ref, mb)
                ref_logp_diff = max(ref_logp_diff, (c - mb["ref_chosen_logps"]).abs().max().item(),
                                    (r - mb["ref_rejected_logps"]).abs().max().item())
        lrs = trainer_lrs(LR[optim])
        opt = (torch.optim.SGD(ref.parameters(), lr=LR[optim]) if optim == "lomo"
               else ReferenceAdaLomo(ref.parameters(), lr=LR[optim]))
        ref_losses, ref_norms = [], []
        for step in range(STEPS):
            mbs = [everyone[r][step * K + m] for m in range(K) for r in range(world)]
            ref.zero_grad()
            loss = sum(trainer._compute_loss(ref, mb, False) for mb in mbs) / len(mbs)
            ref_norms.append(reference_step(ref, opt, optim, loss, clip, lrs[step]))
            ref_losses.append(loss.item())
    if trained is None:
        return None
    reference = {n: p.detach() for n, p in ref.named_parameters()}
    return {"max_abs_diff": diff(trained, reference), "ref_logp_diff": ref_logp_diff,
            "loss": [h["loss"] for h in logs], "ref_loss": ref_losses,
            "grad_norm": [h.get("grad_norm") for h in logs], "ref_grad_norm": ref_norms,
            "lr": [h["learning_rate"] for h in logs], "ref_lr": lrs, "wrapped": wrapped,
            "deepspeed_engines": n_engines, "pairs_per_step": [len(everyone[0][0]["ref_chosen_logps"]) * K * world],
            "reward_accuracy_logged": [h.get("rewards/accuracies") for h in logs],
            "input_cache_files": len(data.cache_files),
            "ref_logps": {c: list(trainer.train_dataset[c]) for c in ("ref_chosen_logps", "ref_rejected_logps")},
            "ref_logps_dtype": str(trainer.train_dataset.features["ref_chosen_logps"].dtype)}


def _deepspeed_engines(module) -> int:
    """How many DeepSpeedEngine objects wrap `module` (the LomoEngine's only: TRL's reference pass built none)."""
    import gc

    from deepspeed import DeepSpeedEngine

    return sum(isinstance(o, DeepSpeedEngine) and o.module is module for o in gc.get_objects())
