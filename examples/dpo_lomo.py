"""Preference tuning (DPO) with TRL's DPOTrainer and LOMO (or AdaLomo) on DeepSpeed ZeRO-3 shards.

Starts from the built-in model (SmolLM2-135M-Instruct), not from the SFT example's export (make
demo-chat's runs/cpu_chat/hf_model; `--model` takes it): that one already ranks every held-out dev
pair right, and the replies it misses break the format, which no pair here shows. It trains on HARD
preference pairs built from the built-in chat task (lomo_ds/data/preference.py,
hard_pairs): both replies are in the `item=count` format the task asks for; the rejected one has
the count wrong (off by one to three, or its digits swapped), another item of the task, or the item
without its final s; the three kinds equally often. The loss is TRL's DPO sigmoid loss plus its
`sft` term on the chosen reply (loss_type ["sigmoid", "sft"], RPO): the DPO term separates right
from wrong copies, the sft term teaches the format and keeps the chosen reply's likelihood rising,
which DPO alone does not promise. beta is 1, not TRL's 0.1: every step's gradient is clipped to norm
1, so the two terms share a step in proportion to their gradients, and the DPO term's is beta / 2
times the log-ratio's at the start, small at 0.1 beside the sft term's on replies the starting model
finds unlikely (it answers in prose). The reference is
TRL's precomputed one (the starting model scores each pair once; no second model is held).

Before and after training it prints, on held-out pairs from the chat task's validation split (whose
names, items and numbers training never sees; every prompt once with each kind of wrong reply) the
preference accuracy, overall and by kind: the share of pairs in which the model gives the chosen
reply a higher log-probability than the rejected one; and on the same prompts the exact match of
greedy replies. The split's first 30 records (`--eval-split dev`) are for choosing a recipe; the
other 70 (`report`, the default) are the reported ones.

    deepspeed --num_gpus 2 examples/dpo_lomo.py                   # 2 CPU ranks here (no GPU found)
    torchrun --nproc_per_node 2 examples/dpo_lomo.py --optim adalomo --lr 0.001 --seed 43
    deepspeed --num_gpus 8 examples/dpo_lomo.py --bf16 --model HuggingFaceTB/SmolLM2-1.7B-Instruct
    deepspeed --num_gpus 1 examples/dpo_lomo.py --bf16 --checkpointing --batch 1 \
        --model meta-llama/Llama-3.1-8B-Instruct                  # a LLaMA: the config gathers LlamaDecoderLayer
"""
from __future__ import annotations

import argparse
import json
import os

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAT = os.path.join(ROOT, "lomo_ds", "data", "builtin", "chat")
DEV_ROWS = 30  # validation records kept for choosing the recipe; the rest are the reported ones

DEEPSPEED = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                          "leaf_module": {"classes": ["LlamaDecoderLayer"]}},
    "lomo": {},
}


def conversations(path: str) -> list[list[dict]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["messages"] for line in f if line.strip()]


def scored_by_shards(trainer, dataset, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The trained policy's (chosen, rejected) log-probs of every pair, each rank scoring an equal
    share (the last pair repeated to fill it: under ZeRO-3 every rank must run as many forwards)."""
    n = len(dataset)
    share = -(-n // world)
    rows = list(range(n)) + [n - 1] * (share * world - n)
    mine = trainer.pair_log_probs(dataset.select(rows[rank * share:(rank + 1) * share]), batch_size=8)
    gathered: list = [None] * world
    torch.distributed.all_gather_object(gathered, mine)
    return tuple(torch.cat([g[i] for g in gathered])[:n] for i in (0, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2-135m", help="a hub name, a folder, or lomo_ds's built-in")
    ap.add_argument("--optim", choices=["lomo", "adalomo"], default="lomo")
    ap.add_argument("--lr", type=float, help="default: 0.05 for LOMO, 0.001 for AdaLomo")
    ap.add_argument("--beta", type=float, default=1.0, help="DPO's beta")
    ap.add_argument("--sft-weight", type=float, default=1.0, help="weight of the sft term (0: DPO alone)")
    ap.add_argument("--max-steps", type=int, default=48)
    ap.add_argument("--batch", type=int, default=2, help="pairs per rank and micro-batch")
    ap.add_argument("--accumulation", type=int, default=1)
    ap.add_argument("--seed", type=int, default=42, help="training seed and the train pairs' draw")
    ap.add_argument("--eval-split", choices=["report", "dev"], default="report",
                    help=f"the validation split's first {DEV_ROWS} records (dev: for choosing a recipe) or the "
                         f"rest (report)")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing (7-8B on one GPU)")
    ap.add_argument("--max-length", type=int, default=128, help="prompt + reply tokens (TRL's max_length)")
    ap.add_argument("--output-dir", default="runs/dpo_lomo")
    ap.add_argument("--report-to", default="none")
    ap.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig

    import lomo_ds
    from lomo_ds.data.chat import chat_format
    from lomo_ds.data.preference import HARD_KINDS, hard_pair_kind, hard_pairs, load_preference, write_jsonl
    from lomo_ds.evaluation.generation import evaluate_generation
    from lomo_ds.integrations.dpo import LomoDPOTrainer
    from lomo_ds.integrations.models import pretrained_folders
    from lomo_ds.runtime.device import accelerator_device, set_cpu_threads

    lomo_ds.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    set_cpu_threads(accelerator_device())
    model_dir, tokenizer_dir = pretrained_folders(a.model, rank, torch.distributed.barrier)

    # The pairs: train pairs drawn with the seed (as many as the run takes), held-out pairs fixed.
    n_train = a.max_steps * a.batch * a.accumulation * world
    train_conv = conversations(os.path.join(CHAT, "train.jsonl"))
    valid_conv = conversations(os.path.join(CHAT, "validation.jsonl"))
    valid_conv = valid_conv[:DEV_ROWS] if a.eval_split == "dev" else valid_conv[DEV_ROWS:]
    pairs_dir = os.path.join(a.output_dir, "pairs")
    if rank == 0:
        import random

        order = list(range(len(train_conv)))
        random.Random(a.seed).shuffle(order)
        chosen_rows = [train_conv[i] for i in (order * (n_train // len(order) + 1))[:n_train]]
        write_jsonl(os.path.join(pairs_dir, f"train_seed{a.seed}.jsonl"), hard_pairs(chosen_rows, a.seed))
        # Every held-out prompt with each kind of wrong reply: the kinds differ in how far the starting
        # model already separates them, so the mix is fixed, not drawn.
        write_jsonl(os.path.join(pairs_dir, f"heldout_{a.eval_split}.jsonl"),
                    hard_pairs(valid_conv, 0, per_conversation=len(HARD_KINDS)))
    torch.distributed.barrier()
    train_pairs = load_preference(os.path.join(pairs_dir, f"train_seed{a.seed}.jsonl"))
    heldout = load_preference(os.path.join(pairs_dir, f"heldout_{a.eval_split}.jsonl"))
    kinds = [hard_pair_kind(p) for p in heldout]

    args = DPOConfig(
        output_dir=a.output_dir, optim=a.optim, deepspeed=DEEPSPEED,
        learning_rate=a.lr or (0.05 if a.optim == "lomo" else 0.001),
        lr_scheduler_type="linear", warmup_steps=0.1, max_grad_norm=1.0,
        per_device_train_batch_size=a.batch, gradient_accumulation_steps=a.accumulation, max_steps=a.max_steps,
        bf16=a.bf16, activation_checkpointing=a.checkpointing, max_length=a.max_length, beta=a.beta,
        loss_type=["sigmoid", "sft"] if a.sft_weight else ["sigmoid"],
        loss_weights=[1.0, a.sft_weight] if a.sft_weight else None,
        precompute_ref_log_probs=True, precompute_ref_batch_size=8, per_device_eval_batch_size=8,
        logging_steps=1, report_to=a.report_to, save_strategy="no", eval_strategy="no", seed=a.seed,
        dataset_num_proc=None, disable_tqdm=rank != 0,
    )
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if a.bf16 else torch.float32)
    trainer = LomoDPOTrainer(model=model, args=args, train_dataset=train_pairs, eval_dataset=heldout,
                             processing_class=tokenizer)

    # The starting model's scores: its log-probs are the precomputed reference.
    ref = trainer.eval_dataset
    before_right = torch.tensor(ref["ref_chosen_logps"]) > torch.tensor(ref["ref_rejected_logps"])
    chat = chat_format(tokenizer)
    engine = trainer.lomo_engine
    prompts = [{"prompt_ids": chat.ids(m[:-1], generation_prompt=True), "messages": m[:-1],
                "reference": m[-1]["content"]} for m in valid_conv]

    def exact_match() -> tuple[float, list]:
        metrics, rows = evaluate_generation(engine.module, prompts, tokenizer, stop_ids=chat.stop_ids,
                                            pad_id=tokenizer.pad_token_id, max_new_tokens=16, batch_size=8,
                                            rank=rank, world=world, device=engine.device)
        return metrics["exact_match"], rows

    before_em, _ = exact_match()
    trainer.train()
    chosen, rejected = scored_by_shards(trainer, trainer.eval_dataset, rank, world)
    after_right = chosen > rejected

    def accuracy(right: torch.Tensor) -> dict:
        by_kind = {k: round(float(right[[i for i, x in enumerate(kinds) if x == k]].float().mean()), 4)
                   for k in HARD_KINDS if k in kinds}
        return {"all": round(float(right.float().mean()), 4), **by_kind}

    before_acc, after_acc = accuracy(before_right), accuracy(after_right)
    after_em, rows = exact_match()
    trainer.save_model(os.path.join(a.output_dir, "final"))
    if rank == 0:
        result = {"seed": a.seed, "optim": a.optim, "lr": args.learning_rate, "beta": a.beta,
                  "sft_weight": a.sft_weight, "steps": a.max_steps, "pairs": n_train, "eval_split": a.eval_split,
                  "heldout_pairs": len(heldout), "prompts": len(prompts),
                  "preference_accuracy": [before_acc["all"], after_acc["all"]],
                  "preference_accuracy_by_kind": {k: [before_acc[k], after_acc[k]] for k in before_acc if k != "all"},
                  "exact_match": [round(before_em, 4), round(after_em, 4)]}
        with open(os.path.join(a.output_dir, "result.json"), "w") as f:
            json.dump({**result, "replies": rows[:10]}, f, indent=1)
        print(f"held-out preference accuracy {before_acc['all']:.3f} -> {after_acc['all']:.3f} "
              f"({len(heldout)} pairs; by kind {result['preference_accuracy_by_kind']}); "
              f"exact match {before_em:.3f} -> {after_em:.3f} ({len(prompts)} validation prompts)")
        for r in rows[:3]:
            print(f"  {r['messages'][-1]['content']!r} -> {r['reply']!r} (reference {r['reference']!r})")
        print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
