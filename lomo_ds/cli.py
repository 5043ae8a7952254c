"""`lomo-ds` command line. Subcommands are argparse subparsers; add one with a `_add_<name>` function
registered in `_SUBCOMMANDS`.

    lomo-ds train --config ds_configs/cpu_default.json        # under a launcher:
                                                               #   deepspeed --num_gpus 2 -m lomo_ds.cli train ...
    lomo-ds plan --model 65b --gpu-mem 24          # the shipped config's settings, assumptions printed
    lomo-ds plan --offload                         # LLaMA 7B-65B with offload_param: GPUs and host RAM
    lomo-ds plan --model ds_configs/llama13b.json --size 13b --gpus 2
    lomo-ds generate --model runs/cpu_chat/hf_model --prompt "..."   # answer prompts with a model directory
    lomo-ds chat --model runs/cpu_chat/hf_model                      # talk to it in the terminal
    lomo-ds eval --model runs/cpu_default/hf_model --tasks builtin    # lm-evaluation-harness, local tasks
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace

from lomo_ds.config.errors import ConfigError
from lomo_ds.config.run import load_run_config
from lomo_ds.planning import planner
from lomo_ds.planning.specs import ATTENTION
from lomo_ds.planning.tables import format_int8_table, format_long_context_table, format_models_table
from lomo_ds.recipe import generate, harness_eval, train
from lomo_ds.recipe.train import print_eval_plan


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="predict per-GPU memory for LOMO / SGD / AdamW under ZeRO-3",
                       description="Predict per-GPU memory (model states + activations + the update's "
                                   "temporaries) for LOMO, SGD and AdamW under DeepSpeed ZeRO-3, and the "
                                   "smallest GPU count that fits; with --offload, LOMO with its parameters in "
                                   "host RAM and the RAM that needs. Defaults are the shipped configs' "
                                   "(ds_configs/llama*.json); every plan prints its assumptions. "
                                   "Formulas: docs/memory.md.")
    p.add_argument("--model", default=None,
                   help="7b|13b|30b|65b (LLaMA, with its shipped config's settings), an HF config.json (or its "
                        "folder), or a run config; without it, a summary for every LLaMA size")
    p.add_argument("--size", default=None,
                   help="the architecture (7b|13b|30b|65b) of a run config whose model.path is not on this machine")
    p.add_argument("--gpus", type=int, default=None,
                   help="the GPU count you have: its row is added, and whether each method fits on it")
    p.add_argument("--gpu-mem", type=float, default=24.0, help="GiB per GPU (default 24: RTX 3090)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 512)")
    p.add_argument("--batch", type=int, default=None, help="micro-batch per GPU (default: the shipped config's)")
    p.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default=None, help="model dtype (default bf16)")
    p.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=None,
                   help="activation checkpointing (default on)")
    p.add_argument("--offload", action="store_true", help="zero_optimization.offload_param.device = cpu (LOMO)")
    p.add_argument("--lomo-bucket", type=int, default=None, help="comm.bucket_size in elements (default 25e6)")
    p.add_argument("--accumulation", type=int, default=None,
                   help="gradient_accumulation_steps K: LOMO keeps a 1/N shard accumulator when K > 1 (default 1)")
    p.add_argument("--accumulate-dtype", choices=["fp32", "bf16", "fp16"], default=None,
                   help="memory.accumulate_dtype (default fp32)")
    p.add_argument("--accumulate-on", choices=["device", "cpu"], default=None,
                   help="memory.accumulate_on: the accumulator on the GPU (default) or in host RAM")
    p.add_argument("--sp", type=int, default=None,
                   help="sequence-parallel ranks (Ulysses): each GPU holds seq / sp positions through the layers "
                        "(default 1; GPU counts that are not multiples of it are left out)")
    p.add_argument("--attn", choices=sorted(ATTENTION), default=None,
                   help="model.attn_implementation (default: sdpa, transformers' default; only eager keeps "
                        "S x S attention scores)")
    p.add_argument("--tiled-mlp", action=argparse.BooleanOptionalAction, default=None,
                   help="memory.tiled_mlp: each decoder layer's MLP a tile of positions at a time")
    p.add_argument("--mlp-tiles", type=int, default=None, help="memory.mlp_tiles (default: ceil(seq / sp / hidden))")
    p.add_argument("--offload-checkpoints", action=argparse.BooleanOptionalAction, default=None,
                   help="memory.offload_checkpoints: the checkpointed layer inputs in host RAM")
    p.add_argument("--int8-shards", action=argparse.BooleanOptionalAction, default=None,
                   help="memory.int8_shards: each rank's weight shard in int8 with an fp32 scale per block "
                        "(LOMO and AdaLomo; its terms are printed)")
    p.add_argument("--int8-block", type=int, default=None, help="memory.int8_block (default 128)")
    p.add_argument("--int8-fits", metavar="MODELS_DIR", default=None,
                   help="the 8-bit shards' goals table (docs/memory.md) for the config.json files of MODELS_DIR")
    p.add_argument("--long-context", metavar="MODELS_DIR", default=None,
                   help="the long-context goals table (docs/memory.md) for the config.json files of MODELS_DIR")
    p.add_argument("--grpo", action="store_true",
                   help="plan GRPO (TRL's GRPOTrainer, lomo_ds.planning.grpo) for --model: training, generation "
                        "and reference memory for LOMO, AdaLomo and AdamW")
    p.add_argument("--prompt", type=int, default=512, help="--grpo: max_prompt_length (default 512)")
    p.add_argument("--completion", type=int, default=1024, help="--grpo: max_completion_length (default 1024)")
    p.add_argument("--generations", type=int, default=8, help="--grpo: num_generations (default 8)")
    p.add_argument("--grpo-batch", type=int, default=1,
                   help="--grpo: per_device_train_batch_size, completions per micro-batch (default 1)")
    p.add_argument("--steps-per-generation", type=int, default=None,
                   help="--grpo: micro-batches per generation batch (default: generations / grpo-batch)")
    p.add_argument("--beta", type=float, default=0.0, help="--grpo: the KL coefficient (default 0: no reference)")
    p.add_argument("--reference", choices=["ref_model", "host"], default="host",
                   help="--grpo with beta > 0: a second ZeRO-3 model, or the starting weights in host RAM")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--models", nargs="+", default=None, metavar="CONFIG",
                   help="HF config.json files: one table of them side by side (micro-batch 1; LOMO and AdaLomo "
                        "with and without offload_param, SGD and AdamW) on 1, 2, 4 and 8 GPUs at each --seqs")
    p.add_argument("--seqs", default="2048,4096", help="sequence lengths for --models (default 2048,4096)")
    p.add_argument("--dpo-pairs", type=int, default=None, metavar="B",
                   help="plan DPO (TRL's DPOTrainer, lomo_ds.planning.dpo) with B preference pairs per micro-batch "
                        "(2B sequences of --seq tokens) for --model, each reference route")
    p.set_defaults(func=_run_plan)


def _plan_overrides(args) -> dict:
    flags = {"seq": args.seq, "batch": args.batch, "dtype": args.dtype, "checkpointing": args.checkpointing,
             "lomo_bucket": args.lomo_bucket, "offload": args.offload or None, "accumulation": args.accumulation,
             "accumulate_dtype": args.accumulate_dtype,
             "accumulate_on_host": None if args.accumulate_on is None else args.accumulate_on == "cpu",
             "sp": args.sp, "attn": None if args.attn is None else planner.attention_of(args.attn),
             "tiled_mlp": args.tiled_mlp, "mlp_tiles": args.mlp_tiles, "offload_checkpoints": args.offload_checkpoints,
             "int8_shards": args.int8_shards, "int8_block": args.int8_block}
    return {k: v for k, v in flags.items() if v is not None}


def _make_plan(args):
    """A Plan for --model, or None for the all-sizes summary. Raises ValueError / ConfigError."""
    overrides = _plan_overrides(args)
    counts = set(planner.GPU_COUNTS) | ({args.gpus} if args.gpus else set())
    if args.model is None:
        return None
    if os.path.isfile(args.model) and planner.hf_config_path(args.model) is None:
        cfg = load_run_config(args.model, check_files=False)
        return planner.plan_for_run(cfg, args.gpus, args.size, args.gpu_mem, overrides)
    if args.size is not None:
        raise ValueError("--size: only for a run config (--model names the architecture itself)")
    spec = planner.resolve_model(args.model)
    size = next((s for s, m in planner.LLAMA.items() if m is spec), None)
    run, source = ((planner.shipped_run(size), f"ds_configs/llama{size}.json defaults") if size else
                   (planner.RunSpec(), "planner defaults"))
    return planner.plan(spec, args.gpu_mem, replace(run, **overrides), gpu_counts=counts, source=source)


def _run_plan(args) -> int:
    if args.long_context or args.int8_fits:
        try:
            print(format_long_context_table(args.long_context, args.gpu_mem) if args.long_context
                  else format_int8_table(args.int8_fits))
        except ValueError as e:
            print(f"lomo-ds plan: {e}", file=sys.stderr)
            return 2
        return 0
    if args.models:
        extra = {k: v for k, v in _plan_overrides(args).items() if k not in ("seq", "offload")}
        try:
            seqs = [int(x) for x in args.seqs.split(",")]
            print(format_models_table(args.models, seqs, args.gpu_mem, **extra))
        except ValueError as e:
            print(f"lomo-ds plan: {e}", file=sys.stderr)
            return 2
        return 0
    if args.grpo:
        return _run_grpo(args)
    if args.dpo_pairs is not None:
        from lomo_ds.planning.dpo import format_dpo_for_args

        try:
            print(format_dpo_for_args(args.model, args.dpo_pairs, args.gpu_mem, _plan_overrides(args)))
        except (ValueError, ConfigError) as e:
            print(f"lomo-ds plan: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        p = _make_plan(args)
    except (ValueError, ConfigError) as e:
        print(f"lomo-ds plan: {e}", file=sys.stderr)
        return 2
    if p is None:
        plans = planner.shipped_plans(args.gpu_mem, **_plan_overrides(args))
        if args.json:
            print(json.dumps({size: {"min_gpus": q.min_gpus, "run": asdict(q.run)} for size, q in plans.items()},
                             indent=1))
        else:
            print(planner.format_summary(plans))
            if not args.offload:
                # The same sizes with gradient accumulation: where the accumulator fits.
                k = args.accumulation if args.accumulation and args.accumulation > 1 else 4
                extra = {key: v for key, v in _plan_overrides(args).items()
                         if key not in ("accumulation", "accumulate_dtype", "accumulate_on_host")}
                print()
                print(planner.format_accumulation_summary(args.gpu_mem, k, **extra))
        return 0
    if args.json:
        out = {"model": p.model.name, "params": p.model.n_params, "gpu_mem_gib": args.gpu_mem, "source": p.source,
               "assumptions": p.run.assumptions(), "run": asdict(p.run), "min_gpus": p.min_gpus,
               "estimates": [dict(e.gib(), fits=p.fits(e.method, e.gpus)) for e in p.estimates.values()]}
        print(json.dumps(out, indent=1))
        return 0
    print(planner.format_plan(p, args.gpus))
    if os.path.isfile(args.model) and planner.hf_config_path(args.model) is None:
        print_eval_plan(load_run_config(args.model, check_files=False), p, args.gpus)
    if args.gpus:
        print()
        for m in p.min_gpus:
            e = p.estimates[(m, args.gpus)]
            print(f"on {args.gpus} GPU(s): {m} needs {e.total / planner.GIB:.2f} GiB per GPU -> "
                  f"{'fits' if p.fits(m, args.gpus) else 'out of memory'}")
    return 0


def _run_grpo(args) -> int:
    from lomo_ds.planning.grpo import GrpoSpec, format_grpo_for_args

    steps = args.steps_per_generation or max(1, args.generations // args.grpo_batch)
    g = GrpoSpec(prompt=args.prompt, completion=args.completion, generations=args.generations, batch=args.grpo_batch,
                 steps_per_generation=steps, beta=args.beta, reference=args.reference)
    try:
        print(format_grpo_for_args(args.model, g, args.gpu_mem, _plan_overrides(args)))
    except (ValueError, ConfigError) as e:
        print(f"lomo-ds plan: {e}", file=sys.stderr)
        return 2
    return 0


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="fine-tune a model as one run config describes (lomo_ds/recipe/train.py)",
                       description=train.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_arguments(p)
    p.set_defaults(func=train.run)


def _add_generate(sub) -> None:
    generate.add_generate(sub)


def _add_chat(sub) -> None:
    generate.add_chat(sub)


def _add_eval(sub) -> None:
    harness_eval.add_eval(sub)


_SUBCOMMANDS = [_add_train, _add_plan, _add_generate, _add_chat, _add_eval]


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
