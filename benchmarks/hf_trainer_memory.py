"""Peak memory of LOMO inside Hugging Face's Trainer against lomo_ds's own engine, on CPU ranks.

Both runs train the same model from the same initial weights on the same micro-batches: K
micro-batches a step, global-norm clipping, loss_normalization "tokens" (the Trainer's token mean),
LOMO_DS_KEEP_FREED_MEMORY=0. Each rank measures its resident high-water mark (VmHWM) above its
resident memory once set up (the engine built; for the Trainer, at on_train_begin), the kernel's
high-water mark reset there (/proc/self/clear_refs). The integration adds no optimizer state, no
full gradient and no second copy of the model, so the two should agree within a few percent.

    python -m benchmarks.hf_trainer_memory                 # 2 ranks, defaults below
    python -m benchmarks.hf_trainer_memory --ranks 2 --hidden 512 --layers 8 --steps 6
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from benchmarks.common import status_kib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2, help="micro-batch per rank")
    ap.add_argument("--accumulation", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--rank-run", choices=["engine", "trainer"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# ----------------------------------------------------------------------------- on each rank


class _Mark:
    """Resident memory once set up, then the high-water mark above it."""

    def start(self):
        import gc

        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident size
        self.base = status_kib("VmRSS")

    def peak_above(self) -> float:
        return (status_kib("VmHWM") - self.base) / 1024


def _model(a):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=int(2.75 * a.hidden),
                      num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=a.seq, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


class _Rows:
    """Fixed-length rows with label masks of different lengths."""

    def __init__(self, a, n):
        self.a, self.n = a, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import torch

        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, self.a.vocab, (self.a.seq,), generator=g)
        labels = ids.clone()
        labels[: (37 * i) % (self.a.seq // 2)] = -100
        return {"input_ids": ids, "labels": labels}


def _ds(a, **extra):
    return {"train_micro_batch_size_per_gpu": a.batch,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, **extra}


def rank_engine(a) -> float:
    import torch

    import lomo_ds

    lomo_ds.init_distributed()
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    engine = lomo_ds.initialize(_model(a), {**_ds(a), "lomo": {"lr": 1e-3},
                                            "train": {"clip_grad_norm": a.clip, "accumulation_steps": a.accumulation,
                                                      "loss_normalization": "tokens"}})
    rows = _Rows(a, a.steps * a.accumulation * world * a.batch)
    mark = _Mark()
    mark.start()
    for step in range(a.steps):
        for m in range(a.accumulation):
            start = ((step * a.accumulation + m) * world + rank) * a.batch
            items = [rows[i] for i in range(start, start + a.batch)]
            engine.train_step({k: torch.stack([it[k] for it in items]) for k in items[0]})
    return mark.peak_above()


def rank_trainer(a) -> float:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import lomo_ds
    from lomo_ds.integrations.transformers import LomoTrainerMixin

    lomo_ds.init_distributed()
    world = torch.distributed.get_world_size()
    mark = _Mark()

    class AtStart(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            mark.start()

    class LomoTrainer(LomoTrainerMixin, Trainer):
        pass

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, optim="lomo", deepspeed=_ds(a), learning_rate=1e-3,
                                 per_device_train_batch_size=a.batch, gradient_accumulation_steps=a.accumulation,
                                 max_steps=a.steps, max_grad_norm=a.clip, report_to=[], save_strategy="no",
                                 logging_steps=1, disable_tqdm=True, train_sampling_strategy="sequential")
        rows = _Rows(a, a.steps * a.accumulation * world * a.batch)
        LomoTrainer(model=_model(a), args=args, train_dataset=rows, callbacks=[AtStart()]).train()
    return mark.peak_above()


def rank_main(a) -> None:
    import torch

    peak = rank_engine(a) if a.rank_run == "engine" else rank_trainer(a)
    peaks = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(peaks, peak)
    if torch.distributed.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump(peaks, f)


# ----------------------------------------------------------------------------- the launcher
def main(argv=None) -> None:
    a = parse_args(argv)
    if a.rank_run:
        return rank_main(a)
    from devkit.launch_local import run_local

    flags = [f"--{k}={v}" for k, v in vars(a).items() if k not in ("rank_run", "out") and v is not None]
    env = {"LOMO_DS_KEEP_FREED_MEMORY": "0", "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    peaks = {}
    with tempfile.TemporaryDirectory() as tmp:
        for run in ("engine", "trainer"):
            out = os.path.join(tmp, f"{run}.json")
            proc = run_local(["-m", "benchmarks.hf_trainer_memory", *flags, f"--rank-run={run}", f"--out={out}"],
                             a.ranks, timeout=3600, env=env, cwd=ROOT)
            if proc.returncode != 0:
                sys.exit(f"{run} run failed:\n{proc.stderr[-4000:]}")
            with open(out) as f:
                peaks[run] = json.load(f)
    print(f"model: hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}; {a.ranks} CPU ranks, micro-batch "
          f"{a.batch} x {a.seq} tokens, K={a.accumulation}, clip {a.clip}, {a.steps} steps")
    print("peak resident memory above the post-setup resident memory, per rank (MiB):")
    for run, values in peaks.items():
        print(f"  {run:8s} " + "  ".join(f"{v:8.1f}" for v in values))
    ratios = [t / e for t, e in zip(peaks["trainer"], peaks["engine"], strict=True)]
    print("  trainer / engine: " + "  ".join(f"{r:.3f}" for r in ratios)
          + f"   (max {max(ratios):.3f}; the bound is 1.05)")


if __name__ == "__main__":
    main()
