"""Where each method's updates go: LOMO's clipped SGD against AdamW, step by step, on one process.

    python -m experiments.studies.update_norms --task spelling --steps 30

The quality benchmark (experiments/quality.py) reports how far LOMO stays from AdamW; this says why.
Both rules start from the built-in model and see the same global batches of 8 (the sweep's: the task's
train split in the order of train.seed 42, epoch 0), each with its own sweep setting: LOMO is SGD on
the gradient clipped to global norm `--lomo-clip` (then to `--lomo-clip-value` per element, as the
engine does) at `--lomo-lr`; AdamW is torch's (betas 0.9/0.999,
no weight decay) with the same norm clipping at `--adamw-lr`; both with the sweep's linear schedule
over 100 steps, AdamW's with 10% warm-up, LOMO's with `--lomo-warmup`. The engine's LOMO step
equals this SGD step (tests/engine/dist_engine_checks) and DeepSpeed's AdamW is this AdamW, so one process
is enough to see the geometry.

Printed per group of tensors (embedding, attention, MLP, norms): its share of the squared gradient
norm (summed over LOMO's steps, before clipping), the mean L2 norm of one step's update, and the
displacement after all the steps relative to the weights, |theta_N - theta_0| / |theta_0|; and,
for the first step, what value clips of 1e-2 to 1e-5 leave of the norm-clipped gradient.
Measured figures and what they say: docs/results.md (the quality benchmark's section).
"""
from __future__ import annotations

import argparse
import collections

import torch
from transformers import AutoModelForCausalLM

from lomo_ds.config.run import load_run_config, resolve_model_source
from lomo_ds.data.collate import collate, pad_id_of
from lomo_ds.data.loading import build_datasets
from lomo_ds.data.order import epoch_order
from lomo_ds.engine.schedule import Schedule
from lomo_ds.runtime.dist import keep_labelled_logits
from lomo_ds.storage.models import load_tokenizer

GROUPS = (("embedding", ("embed_tokens", "lm_head")), ("attention", ("self_attn",)), ("MLP", ("mlp",)),
          ("norms", ("norm",)))
TOTAL_STEPS, ADAMW_WARMUP = 100, 0.1  # the sweep's schedule and AdamW's warm-up (experiments/quality.yaml)
VALUE_CLIPS = (1e-2, 1e-3, 1e-4, 1e-5)


def sq_norm(t: torch.Tensor) -> float:
    """Squared L2 norm, summed in fp64: an fp32 norm of the model's 134M gradient elements on a CPU
    comes out 0.8% low (109.15 against 109.99)."""
    return float(t.double().pow(2).sum())


def group_of(name: str) -> str:
    return next(g for g, keys in GROUPS if any(k in name for k in keys))


def load(cfg):
    source, gguf = resolve_model_source(cfg.model.path, cfg.model.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf, dtype=torch.float32)
    model.train()
    return model


def clipped_grads(model, batch, clip: float, grad_sq: collections.Counter) -> float:
    """Backward, then the norm clip; each group's squared gradient norm (before the clip) is added
    to `grad_sq`."""
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    for n, p in model.named_parameters():
        grad_sq[group_of(n)] += sq_norm(p.grad)
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))


def print_value_clips(model) -> None:
    """What a value clip c does to the first step's norm-clipped gradient: the share of elements it
    touches and the L2 norm left (the step is lr x that norm)."""
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).abs().double()
    print(f"step 1, the gradient after the norm clip: norm {float(flat.norm()):.3f}, "
          f"mean |element| {float(flat.mean()):.2e}")
    print("| value clip | elements above it | L2 norm left |\n|---|---|---|")
    for c in VALUE_CLIPS:
        print(f"| {c:g} | {float((flat > c).float().mean()):.2e} | {float(flat.clamp(max=c).norm()):.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="spelling")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lomo-lr", type=float, default=0.1)
    ap.add_argument("--lomo-clip", type=float, default=1.0)
    ap.add_argument("--lomo-clip-value", type=float, default=None)
    ap.add_argument("--lomo-warmup", type=float, default=0.1, help="LOMO's warm-up ratio (AdamW's: 0.1)")
    ap.add_argument("--adamw-lr", type=float, default=3e-5)
    a = ap.parse_args()
    torch.manual_seed(42)
    cfg = load_run_config("ds_configs/cpu_default.json", {"data.task": a.task, "data.train_samples": 2000,
                                                          "tokenizer.max_length": 96})
    tok = load_tokenizer(cfg)
    data = build_datasets(cfg, tok)
    order = epoch_order(len(data.train), cfg.train.seed, 0)
    models = {"LOMO": load(cfg), "AdamW": load(cfg)}
    start = {n: p.detach().clone() for n, p in models["LOMO"].named_parameters()}
    adamw = torch.optim.AdamW(models["AdamW"].parameters(), lr=a.adamw_lr, betas=(0.9, 0.999), eps=1e-8,
                              weight_decay=0.0)
    schedules = {"LOMO": Schedule("linear", a.lomo_lr, TOTAL_STEPS, round(a.lomo_warmup * TOTAL_STEPS)),
                 "AdamW": Schedule("linear", a.adamw_lr, TOTAL_STEPS, round(ADAMW_WARMUP * TOTAL_STEPS))}
    step_norms = {m: collections.defaultdict(list) for m in models}  # method -> group -> per-step norms
    grad_sq = {m: collections.Counter() for m in models}  # method -> group -> summed squared gradient norms
    for step in range(a.steps):
        batch = keep_labelled_logits(collate([data.train[i] for i in order[8 * step:8 * step + 8]],
                                             pad_id_of(tok)))
        for method, model in models.items():
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            clip = a.lomo_clip if method == "LOMO" else 1.0
            norm = clipped_grads(model, batch, clip, grad_sq[method])
            if step == 0 and method == "LOMO":
                print_value_clips(model)
            lr = schedules[method].lr_at(step)
            with torch.no_grad():
                if method == "LOMO":
                    for p in model.parameters():
                        g = p.grad if a.lomo_clip_value is None else p.grad.clamp(-a.lomo_clip_value,
                                                                                  a.lomo_clip_value)
                        p.add_(g, alpha=-lr)
                else:
                    for g in adamw.param_groups:
                        g["lr"] = lr
                    adamw.step()
            sq = collections.Counter()
            for n, p in model.named_parameters():
                sq[group_of(n)] += sq_norm(p.detach() - before[n])
            for g, v in sq.items():
                step_norms[method][g].append(v ** 0.5)
            if step % 10 == 0 or step == a.steps - 1:
                print(f"step {step + 1}: {method} gradient norm {norm:.2f}, update norm "
                      f"{sum(sq.values()) ** 0.5:.3e}", flush=True)

    print(f"\n{a.steps} steps of {a.task}, LOMO lr {a.lomo_lr} (norm clip {a.lomo_clip}, value clip "
          f"{a.lomo_clip_value}, warm-up {a.lomo_warmup}), AdamW lr {a.adamw_lr}")
    print("| group | parameters | share of the squared gradient norm (LOMO's run) | LOMO step update | "
          "AdamW step update | LOMO displacement | AdamW displacement |")
    print("|---|---|---|---|---|---|---|")
    total_sq = sum(grad_sq["LOMO"].values())
    for g, _ in GROUPS:
        names = [n for n in start if group_of(n) == g]
        if not names:
            continue
        w0 = sum(sq_norm(start[n]) for n in names) ** 0.5
        cells = []
        for method in models:
            params = dict(models[method].named_parameters())
            cells.append(sum(sq_norm(params[n].detach() - start[n]) for n in names) ** 0.5 / w0)
        mean = {m: sum(step_norms[m][g]) / len(step_norms[m][g]) for m in models}
        print(f"| {g} | {sum(start[n].numel() for n in names) / 1e6:.2f}M | {grad_sq['LOMO'][g] / total_sq:.2f} | "
              f"{mean['LOMO']:.2e} | "
              f"{mean['AdamW']:.2e} | {cells[0]:.2e} | {cells[1]:.2e} |")


if __name__ == "__main__":
    main()
