"""`lomo-ds` command line. Subcommands are argparse subparsers; add one with a `_add_<name>` function
registered in `_SUBCOMMANDS`.

    lomo-ds train --config ds_configs/cpu_default.json        # under a launcher: deepspeed --num_gpus 2 -m lomo_ds.cli train ...
    lomo-ds plan --model 13b --gpus 8 --gpu-mem 24 --seq 1024 --batch 1 --dtype fp16 --checkpointing
"""
from __future__ import annotations

import argparse
import sys


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="predict per-GPU memory for LOMO / SGD / AdamW under ZeRO-3",
                       description="Predict per-GPU memory (model states + activations) for LOMO, SGD and "
                                   "AdamW under DeepSpeed ZeRO-3, and the smallest GPU count that fits. "
                                   "Formulas: lomo_ds/planner.py.")
    p.add_argument("--model", required=True,
                   help="7b|13b|30b|65b (LLaMA), an HF config.json (or its folder), or a run config JSON")
    p.add_argument("--gpus", type=int, default=None,
                   help="the GPU count you have: its row is marked, and whether each method fits on it")
    p.add_argument("--gpu-mem", type=float, default=24.0, help="GiB per GPU (default 24: RTX 3090)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 1024)")
    p.add_argument("--batch", type=int, default=None, help="micro-batch per GPU (default 1)")
    p.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default=None, help="model dtype (default fp16)")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    p.add_argument("--lomo-bucket", type=int, default=None, help="lomo.bucket_size in elements (default 25e6)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_run_plan)


def _run_plan(args) -> int:
    import json

    from .planner import GIB, GPU_COUNTS, METHODS, format_plan, plan, resolve_model, run_spec

    try:
        model, overrides = resolve_model(args.model)
    except ValueError as e:
        print(f"lomo-ds plan: {e}", file=sys.stderr)
        return 2
    for name, value in (("seq", args.seq), ("batch", args.batch), ("dtype", args.dtype), ("lomo_bucket", args.lomo_bucket)):
        if value is not None:
            overrides[name] = value
    if args.checkpointing:
        overrides["checkpointing"] = True
    counts = tuple(sorted(set(GPU_COUNTS) | ({args.gpus} if args.gpus else set())))
    p = plan(model, args.gpu_mem, run_spec(**overrides), gpu_counts=counts)
    if args.json:
        out = {"model": model.name, "params": model.n_params, "gpu_mem_gib": args.gpu_mem,
               "run": vars(p.run) if hasattr(p.run, "__dict__") else str(p.run),
               "min_gpus": p.min_gpus,
               "estimates": [dict(e.gib(), fits=p.fits(e.method, e.gpus)) for e in p.estimates.values()]}
        print(json.dumps(out, indent=1, default=str))
    else:
        print(format_plan(p, counts))
        if args.gpus:
            print()
            for m in METHODS:
                e = p.estimates[(m, args.gpus)]
                print(f"on {args.gpus} GPU(s): {m} needs {e.total / GIB:.2f} GiB per GPU -> "
                      f"{'fits' if p.fits(m, args.gpus) else 'out of memory'}")
    return 0


def _add_train(sub) -> None:
    from . import train

    p = sub.add_parser("train", help="fine-tune a model as one run config describes (lomo_ds/train.py)",
                       description=train.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_arguments(p)
    p.set_defaults(func=train.run)


_SUBCOMMANDS = [_add_train, _add_plan]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lomo-ds", description="LOMO on DeepSpeed ZeRO-3")
    # `deepspeed --module lomo_ds.cli train ...` puts --local_rank=N before the subcommand.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
