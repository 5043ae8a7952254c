"""Fine-tune a causal language model with LOMO on DeepSpeed ZeRO-3.

    deepspeed --num_gpus 8 launch/train.py --config ds_configs/llama65b.json
    deepspeed --num_gpus 2 launch/train.py --config ds_configs/cpu_default.json   # make demo
    python launch/train.py --config ds_configs/llama7b.json --dry-run              # config + memory plan

One JSON file describes the run (DeepSpeed's keys, the "lomo" section, model, tokenizer, data,
train, eval, output); common fields have flags, any field has --set key=value.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lomo_ds.config import ConfigError  # noqa: E402
from lomo_ds.run_config import load_run_config, parse_override_args  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="run config JSON (see ds_configs/)")
    ap.add_argument("--lr", type=float, help="lomo.lr")
    ap.add_argument("--task", help="data.task")
    ap.add_argument("--model", help="model.path")
    ap.add_argument("--method", help="train.method (lomo, adamw, sgd, lora, lora_lomo, zero_shot)")
    ap.add_argument("--output-dir", help="output.dir")
    ap.add_argument("--epochs", type=int, help="train.epochs")
    ap.add_argument("--max-steps", type=int, help="train.max_steps")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override any field, e.g. --set lomo.clip_grad_norm=1.0 (value parsed as JSON)")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in output.dir")
    ap.add_argument("--dry-run", action="store_true", help="print the resolved config and predicted memory, then exit")
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    return ap.parse_args(argv)


def overrides_from(args) -> dict:
    flags = {"lomo.lr": args.lr, "data.task": args.task, "model.path": args.model, "train.method": args.method,
             "output.dir": args.output_dir, "train.epochs": args.epochs, "train.max_steps": args.max_steps}
    out = {k: v for k, v in flags.items() if v is not None}
    out.update(parse_override_args(args.set))
    return out


def dry_run(cfg) -> None:
    """The resolved config, then the memory planner's per-GPU prediction for it."""
    from lomo_ds import planner

    print(json.dumps(cfg.to_dict(), indent=2))
    world = int(os.environ.get("WORLD_SIZE", "0")) or None  # the launcher's rank count, if launched
    try:
        p = planner.plan_for_run(cfg, world)
    except ValueError as e:
        print(f"memory plan: not available ({e})")
        return
    print(planner.format_plan(p))
    if world:
        print(f"this launch ({world} ranks): LOMO needs {p.estimates[('lomo', world)].total / planner.GIB:.2f} GiB per GPU")


def check_runtime(cfg) -> None:
    """Errors only the machine can tell, still before any model is allocated."""
    from deepspeed.accelerator import get_accelerator

    if cfg.ds.get("fp16", {}).get("enabled") and get_accelerator().device_name() == "cpu":
        raise ConfigError(f"{cfg.source_path}: fp16.enabled: DeepSpeed refuses fp16 on a CPU; use bf16 or fp32 here")


class Metrics:
    """Per-step JSONL (and optionally TensorBoard), written by rank 0 only."""

    def __init__(self, cfg, rank: int, resume: bool):
        self.rank = rank
        self.file = self.tb = None
        if rank != 0:
            return
        os.makedirs(cfg.output.dir, exist_ok=True)
        self.file = open(os.path.join(cfg.output.dir, cfg.output.metrics_file), "a" if resume else "w")
        if cfg.output.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(cfg.output.dir, "tensorboard"))

    def log(self, record: dict) -> None:
        if self.file is None:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step" and v is not None:
                    self.tb.add_scalar(k, v, record.get("step", 0))


def build_engine(cfg, model, total_steps: int):
    method = cfg.train.method
    if method == "lomo":
        from lomo_ds.engine import LomoEngine

        # The validated config is frozen: the engine gets a copy with the run's step count.
        scheduler = cfg.lomo.scheduler.model_copy(update={"total_steps": total_steps})
        return LomoEngine(model, cfg.ds, cfg.lomo.model_copy(update={"scheduler": scheduler}))
    from lomo_ds import baselines

    opts = {}
    if method in ("adamw", "sgd"):
        opts = {"lr": cfg.train.baseline_lr, "weight_decay": cfg.train.baseline_weight_decay,
                "clip": cfg.lomo.clip_grad_norm}
    lora = {"rank": cfg.train.lora.rank, "alpha": cfg.train.lora.alpha, "targets": list(cfg.train.lora.targets)}
    if method == "lora":
        opts = {"lr": cfg.train.lora.lr, "lora": lora}
    if method == "lora_lomo":
        opts = {"lora": lora, "lora_lr": cfg.train.lora.lr}
    if method in ("adamw", "sgd", "lora", "lora_lomo"):
        opts["total_steps"] = total_steps
        warm = cfg.train.lora.warmup_ratio if "lora" in method else cfg.lomo.scheduler.warmup_ratio
        opts["warmup_steps"] = int(round(warm * total_steps))
    lomo_cfg = cfg.lomo.model_dump()
    lomo_cfg["scheduler"]["total_steps"] = total_steps
    return baselines.build_engine(model, cfg.ds, method, lomo_cfg=lomo_cfg, **opts)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_run_config(args.config, overrides_from(args))
        if args.dry_run:
            dry_run(cfg)
            return 0
        check_runtime(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2

    # Heavy imports only once the config is known to be good.
    import torch
    from tqdm import tqdm

    import lomo_ds
    from lomo_ds import checkpoint
    from lomo_ds.data import (DataError, batches_for_step, build_datasets, collate, epoch_order, pad_id_of,
                              position_of_step, steps_per_epoch)
    from lomo_ds.evaluation import evaluate, evaluate_loss
    from lomo_ds.models import load_model, load_tokenizer

    torch.manual_seed(cfg.train.seed)
    lomo_ds.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    barrier = torch.distributed.barrier
    micro = cfg.micro_batch

    # ---- data (before the model: a malformed file fails fast and cheap)
    tokenizer = load_tokenizer(cfg, rank, barrier)
    try:
        data = build_datasets(cfg, tokenizer)
    except DataError as e:
        print(f"data error: {e}", file=sys.stderr)
        return 2
    pad_id = pad_id_of(tokenizer)
    n_steps_epoch = steps_per_epoch(max(1, len(data.train)), world, micro)
    total_steps = cfg.train.epochs * n_steps_epoch
    if cfg.train.max_steps is not None:
        total_steps = min(total_steps, cfg.train.max_steps)
    if cfg.train.method == "zero_shot":
        total_steps = 0
    if rank == 0:
        print(f"data: {json.dumps(data.stats)}; {n_steps_epoch} steps/epoch, {total_steps} steps in all", flush=True)

    # ---- model and engine
    model = load_model(cfg, cfg.ds)
    engine = build_engine(cfg, model, total_steps)
    metrics = Metrics(cfg, rank, args.resume)

    # Sharded resumable checkpoints are LOMO's; the baselines (DeepSpeed optimizers, LoRA) are
    # comparison runs and only export at the end.
    resumable = hasattr(engine, "shard_state_dict")
    if not resumable and (args.resume or cfg.output.checkpoint_every):
        print(f"train.method={cfg.train.method}: resumable checkpoints are written for LOMO runs only", file=sys.stderr)
    start_step = 0
    if args.resume and resumable:
        ckpt = checkpoint.latest_checkpoint(cfg.output.dir)
        if ckpt is None:
            print(f"resume: no checkpoint in {cfg.output.dir}; starting from scratch", file=sys.stderr)
        else:
            meta = checkpoint.load_checkpoint(ckpt, engine)
            start_step = meta["step"]
            if rank == 0:
                print(f"resumed from {ckpt} at step {start_step}", flush=True)

    def forward_logits(batch):
        return engine.eval_forward(batch).logits

    def run_eval(tag: str, step: int) -> dict:
        t0 = time.perf_counter()
        if data.eval:
            res = evaluate(forward_logits, data.eval, pad_id, cfg.eval.batch_size, rank, world)
        elif data.eval_lm:
            res = evaluate_loss(forward_logits, data.eval_lm, pad_id, cfg.eval.batch_size, rank, world)
        else:
            return {}
        res = {f"eval/{k}": v for k, v in res.items()}
        metrics.log({"step": step, "phase": tag, **res, "eval_seconds": time.perf_counter() - t0})
        if rank == 0:
            shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items() if "accuracy" in k or "loss" in k}
            print(f"[{tag}] step {step}: {shown}", flush=True)
        return res

    results = {}
    if cfg.train.zero_shot_eval and start_step == 0:
        results["zero_shot"] = run_eval("zero_shot", 0)

    # ---- the training loop
    kill_at = int(os.environ.get("LOMO_DS_KILL_RANK_AT_STEP", "-1"))  # fault injection for the resume test
    progress = tqdm(total=total_steps, initial=start_step, disable=rank != 0, dynamic_ncols=True, desc="train")
    peak_mem = 0
    for step in range(start_step, total_steps):
        epoch, step_in_epoch = position_of_step(step, n_steps_epoch)
        order = epoch_order(len(data.train), cfg.train.seed, epoch)
        batch = collate([data.train[i] for i in batches_for_step(order, step_in_epoch, world, micro, rank)], pad_id)
        t0 = time.perf_counter()
        out = engine.train_step(batch)
        elapsed = time.perf_counter() - t0
        tokens = int(batch["attention_mask"].sum())
        if torch.cuda.is_available():
            peak_mem = torch.cuda.max_memory_allocated()
        else:
            from lomo_ds.memory import process_peak_rss_bytes

            peak_mem = process_peak_rss_bytes()
        record = {"step": step + 1, "epoch": epoch, "loss": out["loss"], "lr": out["lr"], "grad_norm": out["grad_norm"],
                  "skipped": out["skipped"], "loss_scale": out["loss_scale"], "tokens": tokens,
                  "tgs": tokens / elapsed, "step_seconds": elapsed, "peak_mem_gb": peak_mem / 2**30}
        metrics.log(record)
        progress.update(1)
        progress.set_postfix(loss=f"{out['loss']:.4f}", lr=f"{out['lr']:.2e}", tgs=f"{record['tgs']:.0f}",
                             mem=f"{record['peak_mem_gb']:.2f}G")
        done = step + 1
        if rank == 1 and done == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if resumable and cfg.output.checkpoint_every and done % cfg.output.checkpoint_every == 0 and done < total_steps:
            checkpoint.save_checkpoint(cfg.output.dir, engine, {"config": cfg.to_dict()}, cfg.output.keep_last, barrier)
        if cfg.eval.every_steps and done % cfg.eval.every_steps == 0 and done < total_steps:
            run_eval("eval", done)
    progress.close()

    # ---- the end: evaluate, checkpoint, export
    if cfg.eval.at_end and total_steps > 0:
        results["final"] = run_eval("final", total_steps)
    if total_steps > 0 and start_step < total_steps and resumable and (
            cfg.output.checkpoint_every or cfg.output.export_hf):
        checkpoint.save_checkpoint(cfg.output.dir, engine, {"config": cfg.to_dict()}, cfg.output.keep_last, barrier)
    if cfg.output.export_hf and total_steps > 0:
        path = checkpoint.export_hf(engine, tokenizer, os.path.join(cfg.output.dir, "hf_model"), barrier)
        if rank == 0:
            print(f"exported Hugging Face model to {path}", flush=True)
    if rank == 0:
        summary = {"steps": total_steps, **{f"{k}_accuracy": v.get("eval/accuracy") for k, v in results.items() if v}}
        with open(os.path.join(cfg.output.dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        if "zero_shot" in results and "final" in results and results["final"]:
            zs, ft = results["zero_shot"].get("eval/accuracy"), results["final"].get("eval/accuracy")
            if zs is not None and ft is not None and not math.isnan(zs):
                print(f"accuracy: zero-shot {zs:.3f} -> after LOMO fine-tuning {ft:.3f}", flush=True)
    barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
