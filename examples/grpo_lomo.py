"""GRPO with TRL's GRPOTrainer and LOMO (or AdaLomo) on DeepSpeed ZeRO-3 shards.

The built-in model (SmolLM2-135M-Instruct) learns the built-in chat task's answer format from a
verifiable reward, no reference replies trained on: each prompt asks for an item and its count as
`item=count` ("Oscar has 35 brushes." -> `brushes=35`). The reward of a reply (item_count_reward):
0.5 when it is exactly one `word=number`, 0.5 more when it is the right one, and 0.25 (instead of
that 0.5) when it names the right count somewhere but is not the right answer. TRL samples
num_generations replies per prompt, the group's rewards give the advantages, and the fused update
trains on them (beta 0: no reference).

Before and after training it prints the mean reward and the exact match of GREEDY replies on
held-out prompts (the chat task's validation split, whose names, items and numbers training never
sees).

    deepspeed --num_gpus 2 examples/grpo_lomo.py                  # 2 CPU ranks here (no GPU found)
    torchrun --nproc_per_node 2 examples/grpo_lomo.py --optim adalomo --lr 0.001 --seed 43
    deepspeed --num_gpus 8 examples/grpo_lomo.py --bf16 --model HuggingFaceTB/SmolLM2-1.7B-Instruct
"""
from __future__ import annotations

import argparse
import json
import os
import re

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
ANSWER = re.compile(r"[A-Za-z]+=\d+")


def reply_reward(reply: str, answer: str) -> float:
    """The verifiable reward of one reply (module docstring)."""
    text = reply.strip()
    if text == answer:
        return 1.0
    shaped = 0.5 if ANSWER.fullmatch(text) else 0.0
    count = answer.split("=")[1]
    return shaped + (0.25 if re.search(rf"(?<!\d){count}(?!\d)", text) else 0.0)


def item_count_reward(completions, answer, **kw) -> list[float]:
    """TRL's reward function: conversational completions, the dataset's `answer` column."""
    return [reply_reward(c[-1]["content"] if isinstance(c, list) else c, a) for c, a in zip(completions, answer,
                                                                                             strict=True)]


def records(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line)["messages"] for line in f if line.strip()]
    return [{"prompt": m[:-1], "answer": m[-1]["content"]} for m in rows]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2-135m", help="a hub name, a folder, or lomo_ds's built-in")
    ap.add_argument("--optim", choices=["lomo", "adalomo", "adamw"], default="lomo",
                    help="adamw: TRL's own GRPOTrainer with DeepSpeed ZeRO-3 AdamW (the baseline of the study)")
    ap.add_argument("--lr", type=float, help="default: 0.05 LOMO, 0.001 AdaLomo, 1e-5 AdamW")
    ap.add_argument("--max-steps", type=int, default=20)
    ap.add_argument("--generations", type=int, default=4, help="num_generations: replies per prompt")
    ap.add_argument("--batch", type=int, default=4, help="completions per rank and micro-batch")
    ap.add_argument("--accumulation", type=int, default=1)
    ap.add_argument("--max-completion", type=int, default=12)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--beta", type=float, default=0.0, help="KL to the starting weights (host reference)")
    ap.add_argument("--loss-type", default="dapo")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--eval-split", choices=["report", "dev"], default="report")
    ap.add_argument("--eval-prompts", type=int, default=40, help="held-out prompts scored (at most the split's)")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--output-dir", default="runs/grpo_lomo")
    ap.add_argument("--report-to", default="none")
    ap.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> dict | None:
    a = parse_args(argv)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    import lomo_ds
    from lomo_ds.data.chat import chat_format
    from lomo_ds.evaluation.generation import evaluate_generation
    from lomo_ds.integrations.grpo import LomoGRPOTrainer
    from lomo_ds.integrations.models import pretrained_folders
    from lomo_ds.integrations.transformers import complete_distributed_state
    from lomo_ds.runtime.device import accelerator_device, set_cpu_threads

    lomo_ds.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    set_cpu_threads(accelerator_device())
    complete_distributed_state()  # so that GRPOConfig sizes the generation batch for every rank
    model_dir, tokenizer_dir = pretrained_folders(a.model, rank, torch.distributed.barrier)

    train = records(os.path.join(CHAT, "train.jsonl"))
    valid = records(os.path.join(CHAT, "validation.jsonl"))
    valid = (valid[:DEV_ROWS] if a.eval_split == "dev" else valid[DEV_ROWS:])[: a.eval_prompts]
    lr = a.lr or {"lomo": 0.05, "adalomo": 0.001, "adamw": 1e-5}[a.optim]
    ds = DEEPSPEED if a.optim != "adamw" else {k: v for k, v in DEEPSPEED.items() if k != "lomo"}
    args = GRPOConfig(
        output_dir=a.output_dir, optim=a.optim if a.optim != "adamw" else "adamw_torch", deepspeed=ds,
        learning_rate=lr, lr_scheduler_type="constant", max_grad_norm=1.0, per_device_train_batch_size=a.batch,
        gradient_accumulation_steps=a.accumulation, max_steps=a.max_steps, num_generations=a.generations,
        max_completion_length=a.max_completion, temperature=a.temperature, beta=a.beta, loss_type=a.loss_type,
        bf16=a.bf16, logging_steps=5, report_to=a.report_to, save_strategy="no", seed=a.seed,
        disable_tqdm=rank != 0, use_cpu=accelerator_device().type == "cpu" and a.bf16,
    )
    complete_distributed_state()  # again: building the arguments set accelerate's state up anew
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if a.bf16 else torch.float32)
    cls = LomoGRPOTrainer if a.optim != "adamw" else GRPOTrainer
    trainer = cls(model=model, reward_funcs=[item_count_reward], args=args,
                  train_dataset=Dataset.from_list(train).shuffle(seed=a.seed), processing_class=tokenizer)

    chat = chat_format(tokenizer)
    prompts = [{"prompt_ids": chat.ids(r["prompt"], generation_prompt=True), "messages": r["prompt"],
                "reference": r["answer"]} for r in valid]

    def held_out(module, whole: bool = False) -> tuple[float, float, list]:
        """Greedy replies' mean reward and exact match. `whole`: a model loaded partitioned (zero.Init)
        that no DeepSpeed engine has hooked yet, gathered whole for the evaluation."""
        import contextlib

        import deepspeed

        params = list(module.parameters())
        with deepspeed.zero.GatheredParameters(params) if whole else contextlib.nullcontext():
            metrics, rows = evaluate_generation(module, prompts, tokenizer, stop_ids=chat.stop_ids,
                                                pad_id=tokenizer.pad_token_id, max_new_tokens=a.max_completion,
                                                batch_size=8, rank=rank, world=world, device=accelerator_device())
        reward = [reply_reward(r["reply"], r["reference"]) for r in rows] if rows else [0.0]
        return sum(reward) / len(reward), metrics["exact_match"], rows

    lomo = isinstance(trainer, LomoGRPOTrainer)
    # LOMO: the engine's ZeRO-3 module (built before the first step); TRL's trainer: the model as
    # from_pretrained partitioned it, gathered whole, and after training DeepSpeed's hooked module.
    before = held_out(trainer.engine_before_training().module if lomo else trainer.model, whole=not lomo)
    trainer.train()
    after = held_out(trainer.lomo_engine.module if lomo else trainer.model)
    if rank != 0:
        return None
    logged = [h for h in trainer.state.log_history if "reward" in h]
    result = {"seed": a.seed, "optim": a.optim, "lr": lr, "steps": a.max_steps, "world": world,
              "generations": a.generations, "loss_type": a.loss_type, "eval_split": a.eval_split,
              "prompts": len(prompts), "heldout_reward": [round(before[0], 4), round(after[0], 4)],
              "exact_match": [round(before[1], 4), round(after[1], 4)],
              "train_reward": [round(h["reward"], 4) for h in logged]}
    os.makedirs(a.output_dir, exist_ok=True)
    with open(os.path.join(a.output_dir, "result.json"), "w") as f:
        json.dump({**result, "replies": after[2][:10]}, f, indent=1)
    print(f"held-out reward {before[0]:.3f} -> {after[0]:.3f}, exact match {before[1]:.3f} -> {after[1]:.3f} "
          f"({len(prompts)} validation prompts); training reward by logged step {result['train_reward']}")
    for r in after[2][:3]:
        print(f"  {r['messages'][-1]['content']!r} -> {r['reply']!r} (reference {r['reference']!r})")
    print("RESULT " + json.dumps(result))
    return result


if __name__ == "__main__":
    main()
