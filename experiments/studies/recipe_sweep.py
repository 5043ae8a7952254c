"""The recipe sweep for the CPU demo, on one process: SmolLM2-135M on the built-in task.

    python -m experiments.studies.recipe_sweep --steps 40 --grid "norm:0.03:0.05,value:0.003:0.05"

Each grid entry is clip:lr:warmup_ratio (clip = norm (max norm 1.0) | value (|g| <= 1.0) | none).
LOMO's update is SGD without momentum, applied with the global batch's gradient; the engine's tests
prove it equal to torch.optim.SGD on 1-3 ranks, so one process with the demo's global batch of 8 and
the same data order (lomo_ds.data) is the demo's run, at a fraction of the CPU time: the model is
loaded once and restored between settings. Prints one JSON line per setting (final accuracy, the
loss and gradient norm per step); the chosen setting is then confirmed with launch/train.py.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM

from lomo_ds.config.run import load_run_config, resolve_model_source
from lomo_ds.data.collate import collate, pad_id_of
from lomo_ds.data.loading import build_datasets
from lomo_ds.data.order import batches_for_step, epoch_order, position_of_step, steps_per_epoch
from lomo_ds.engine.schedule import Schedule
from lomo_ds.evaluation.scoring import evaluate
from lomo_ds.storage.models import load_tokenizer


def run(model, init_state, data, pad_id, clip, lr, warmup, steps, seed, global_batch, eval_batch) -> dict:
    model.load_state_dict(init_state)
    model.train()
    sched = Schedule("linear", lr, steps, int(round(warmup * steps)))
    n_epoch = steps_per_epoch(len(data.train), 1, global_batch)
    losses, norms = [], []
    for step in range(steps):
        epoch, in_epoch = position_of_step(step, n_epoch)
        order = epoch_order(len(data.train), seed, epoch)
        batch = collate([data.train[i] for i in batches_for_step(order, in_epoch, 1, global_batch, 0)], pad_id)
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0 if clip == "norm" else float("inf"))
        with torch.no_grad():
            for p in params:
                g = p.grad.clamp(-1.0, 1.0) if clip == "value" else p.grad
                p.add_(g, alpha=-sched.lr_at(step))
        losses.append(round(loss.item(), 3))
        norms.append(round(norm.item(), 1))
        print(f"{clip}:{lr}:{warmup} step {step + 1} loss {losses[-1]} grad norm {norms[-1]}", file=sys.stderr,
              flush=True)
    model.eval()
    with torch.no_grad():
        acc = evaluate(lambda b: model(**b).logits, data.eval, pad_id, eval_batch)["accuracy"]
    return {"clip": clip, "lr": lr, "warmup_ratio": warmup, "steps": steps, "seed": seed, "accuracy": acc,
            "loss": losses, "grad_norm": norms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="ds_configs/cpu_default.json")
    ap.add_argument("--grid", required=True, help="comma-separated clip:lr:warmup_ratio")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seeds", default="42", help="comma-separated; sets train.seed")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="run-config override (JSON value)")
    ap.add_argument("--zero-shot", action="store_true", help="also print the zero-shot accuracy per seed")
    args = ap.parse_args()
    overrides = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
    cfg = load_run_config(args.config, overrides)
    tok = load_tokenizer(cfg)
    pad_id = pad_id_of(tok)
    source, gguf = resolve_model_source(cfg.model.path, cfg.model.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf, dtype=torch.float32)
    init_state = {k: v.clone() for k, v in model.state_dict().items()}
    global_batch = cfg.micro_batch * 2  # the demo's 2 ranks
    for seed in (int(s) for s in args.seeds.split(",")):
        cfg = load_run_config(args.config, {**overrides, "train.seed": seed})
        data = build_datasets(cfg, tok)
        if args.zero_shot:
            model.load_state_dict(init_state)
            model.eval()
            with torch.no_grad():
                acc = evaluate(lambda b: model(**b).logits, data.eval, pad_id, cfg.eval.batch_size)["accuracy"]
            print(json.dumps({"zero_shot": True, "seed": seed, "accuracy": acc}), flush=True)
        for entry in args.grid.split(","):
            clip, lr, warmup = entry.split(":")
            torch.manual_seed(seed)
            t0 = time.perf_counter()
            res = run(model, init_state, data, pad_id, clip, float(lr), float(warmup), args.steps, seed,
                      global_batch, cfg.eval.batch_size)
            res["seconds"] = round(time.perf_counter() - t0, 1)
            print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
