"""Fine-tune with TRL's SFTTrainer and LOMO (or AdaLomo) on DeepSpeed ZeRO-3 shards.

The built-in model (SmolLM2-135M) learns the built-in chat task's answer format (`item=count`)
on 2 CPU ranks in a few minutes:

    deepspeed --num_gpus 2 examples/sft_lomo.py                # CPU ranks here (no GPU found)
    torchrun --nproc_per_node 2 examples/sft_lomo.py --optim adalomo --lr 0.001

On GPUs the same script runs under deepspeed, torchrun or accelerate launch (docs/integrations.md).
Everything but the mixin is a plain SFTTrainer script: the TrainingArguments name the optimizer
(optim="lomo" | "adalomo") and the DeepSpeed config, whose lomo, comm and memory sections hold LOMO's options.
"""
from __future__ import annotations

import argparse
import os

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAT = os.path.join(ROOT, "lomo_ds", "data", "builtin", "chat")

DEEPSPEED = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    # One gather per decoder layer instead of one per nn.Linear (the shipped configs' setting).
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                          "leaf_module": {"classes": ["LlamaDecoderLayer"]}},
    "comm": {},  # how gradients travel (lomo_ds/config/engine_sections.py), e.g. {"bucket_size": 25000000}
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2-135m", help="a hub name, a folder, or lomo_ds's built-in")
    ap.add_argument("--optim", choices=["lomo", "adalomo"], default="lomo")
    ap.add_argument("--lr", type=float, help="default: 0.05 for LOMO, 0.001 for AdaLomo")
    ap.add_argument("--max-steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=4, help="per rank")
    ap.add_argument("--accumulation", type=int, default=1)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--output-dir", default="runs/sft_lomo")
    ap.add_argument("--report-to", default="none", help="e.g. tensorboard, wandb")
    ap.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # the deepspeed launcher's
    a = ap.parse_args()

    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    import lomo_ds
    from lomo_ds.integrations.models import pretrained_folders
    from lomo_ds.integrations.transformers import LomoTrainerMixin
    from lomo_ds.runtime.device import accelerator_device, set_cpu_threads

    class LomoSFTTrainer(LomoTrainerMixin, SFTTrainer):
        pass

    lomo_ds.init_distributed()
    rank = torch.distributed.get_rank()
    set_cpu_threads(accelerator_device())  # CPU ranks: the cores shared out, not one thread per core each
    # The built-in model is a GGUF file: converted once (rank 0) before ZeRO-3 is configured.
    model_dir, tokenizer_dir = pretrained_folders(a.model, rank, torch.distributed.barrier)

    args = SFTConfig(
        output_dir=a.output_dir, optim=a.optim, deepspeed=DEEPSPEED,
        learning_rate=a.lr or (0.05 if a.optim == "lomo" else 0.001),
        lr_scheduler_type="linear", warmup_steps=0.1, max_grad_norm=1.0,
        per_device_train_batch_size=a.batch, gradient_accumulation_steps=a.accumulation, max_steps=a.max_steps,
        bf16=a.bf16, gradient_checkpointing=False, max_length=128,
        logging_steps=1, report_to=a.report_to, save_strategy="no",
        eval_strategy="no", per_device_eval_batch_size=8, seed=42,
    )
    # After the SFTConfig: its DeepSpeed config is registered, so the model loads already
    # partitioned (no rank holds all of it).
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if a.bf16 else torch.float32)
    data = datasets.load_dataset("json", data_files={"train": os.path.join(CHAT, "train.jsonl"),
                                                     "validation": os.path.join(CHAT, "validation.jsonl")})
    trainer = LomoSFTTrainer(model=model, args=args, train_dataset=data["train"],
                             eval_dataset=data["validation"].select(range(32)), processing_class=tokenizer)
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model(os.path.join(a.output_dir, "final"))
    if rank == 0:
        print(f"eval loss {metrics['eval_loss']:.4f}, token accuracy {metrics.get('eval_mean_token_accuracy', 0):.3f}; "
              f"model in {os.path.join(a.output_dir, 'final')} (AutoModelForCausalLM.from_pretrained loads it)")


if __name__ == "__main__":
    main()
