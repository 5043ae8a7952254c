"""A DPO step's peak memory per rank on CPU ranks against the planner's DPO rows (lomo_ds.planning.dpo).

LomoDPOTrainer trains a LLaMA built from a config (the built-in tokenizer's vocabulary, eager
attention, fp32) on hard pairs of the built-in chat task, every sequence padded to --seq tokens
(pad_to_multiple_of), --pairs pairs per micro-batch (2 x pairs sequences). Each rank measures what
the engine accounts, as tests/test_planner.py does for LOMO: its parameters (shards + gathered +
persistent, at their peak; MemoryTracker, sampled at every gradient hook), its gradients and
reduce-scatter buckets alive at once, and what autograd saves in the forward (ActivationCounter,
TRL's fused LM head included). The second step is measured (the first records DeepSpeed's module
trace). The planner predicts the same categories (DpoEstimate.accounted) for the same run.

    python -m benchmarks.dpo_memory                     # 2 ranks, defaults below
    python -m benchmarks.dpo_memory --ranks 1 --pairs 2 --hidden 512
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAT = os.path.join(ROOT, "lomo_ds", "data", "builtin", "chat", "train.jsonl")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128, help="every sequence padded to this length")
    ap.add_argument("--pairs", type=int, default=2, help="pairs per rank and micro-batch")
    ap.add_argument("--optim", choices=["lomo", "adalomo"], default="lomo")
    ap.add_argument("--save", help="write the ranks' measured figures to this JSON file")
    ap.add_argument("--measured", help="print the comparison for figures an earlier --save wrote (no run)")
    ap.add_argument("--rank-run", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _ds(a) -> dict:
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "stage3_prefetch_bucket_size": 0}}


def _spec(a, vocab: int):
    from lomo_ds.planning import planner

    return planner.ModelSpec("dpo-memory", a.hidden, a.layers, int(2.75 * a.hidden), vocab, 8, 4, a.hidden // 8)


def head_saved_bytes(loss) -> int:
    """Bytes TRL's fused LM head saved for its backward (its autograd node's saved tensors, the
    LM-head weight, a parameter, left out)."""
    seen, stack, total, storages = set(), [loss.grad_fn], 0, set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if "ChunkedLogProb" in type(node).__name__:
            for t in node.saved_tensors:
                if t is None or hasattr(t, "ds_id") or isinstance(t, __import__("torch").nn.Parameter):
                    continue
                st = t.untyped_storage()
                if st.data_ptr() not in storages:
                    storages.add(st.data_ptr())
                    total += st.nbytes()
        stack.extend(n for n, _ in node.next_functions)
    return total


def rank_main(a) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, TrainerCallback
    from trl import DPOConfig

    import lomo_ds
    from lomo_ds.data.preference import hard_pairs, load_preference, write_jsonl
    from lomo_ds.integrations.dpo import LomoDPOTrainer
    from lomo_ds.integrations.models import pretrained_folders
    from lomo_ds.runtime.memory import ActivationCounter

    lomo_ds.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    _, tokenizer_dir = pretrained_folders("builtin:smollm2-135m", rank, torch.distributed.barrier)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    steps = 2
    out = os.path.dirname(a.out)
    path = os.path.join(out, "pairs.jsonl")
    if rank == 0:
        with open(CHAT, encoding="utf-8") as f:
            conv = [json.loads(line)["messages"] for line in f][: steps * world * a.pairs]
        write_jsonl(path, hard_pairs(conv, seed=0))
    torch.distributed.barrier()
    data = load_preference(path)
    args = DPOConfig(output_dir=out, optim=a.optim, deepspeed=_ds(a), learning_rate=1e-3,
                     per_device_train_batch_size=a.pairs, max_steps=steps, max_grad_norm=1.0, report_to=[],
                     save_strategy="no", logging_steps=1, disable_tqdm=True, dataset_num_proc=None,
                     precompute_ref_log_probs=True, activation_checkpointing=False, max_length=a.seq,
                     pad_to_multiple_of=a.seq, train_sampling_strategy="sequential", bf16=False)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=a.hidden, intermediate_size=int(2.75 * a.hidden),
                      num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=a.hidden // 8, max_position_embeddings=a.seq, tie_word_embeddings=False,
                      attn_implementation="eager")
    torch.manual_seed(0)
    trainer = LomoDPOTrainer(model=LlamaForCausalLM(cfg), args=args, train_dataset=data, processing_class=tok)
    engine = trainer.lomo_engine
    tracker = engine.enable_memory_tracking()
    # The backbone's saved tensors (the decoder layers and the final norm); TRL's fused LM head runs
    # after it in the top module's forward, and its saved tensors are read off its autograd node
    # (saved-tensor hooks around the head would hand its backward a plain tensor for the ZeRO-3
    # LM-head weight, which it gathers by its ZeRO attributes).
    acts = ActivationCounter(engine.module.model)
    head = {"peak": 0}
    lengths = []
    compute_loss = trainer.compute_loss

    def measured_loss(model, inputs, *args, **kw):
        loss = compute_loss(model, inputs, *args, **kw)
        head["peak"] = max(head["peak"], head_saved_bytes(loss))
        return loss

    trainer.compute_loss = measured_loss

    class AfterFirst(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 1:
                tracker.reset()
                acts.reset()
                head["peak"] = 0

    trainer.add_callback(AfterFirst())
    original = trainer.training_step

    def recording(model, inputs, num_items_in_batch=None):
        lengths.append(list(inputs["input_ids"].shape))
        return original(model, inputs, num_items_in_batch)

    trainer.training_step = recording
    trainer.train()
    measured = {"params": tracker.peak_param_bytes - tracker.master_bytes,
                "grads": tracker.peak.grad_bytes + tracker.peak.bucket_bytes,
                "optimizer_states": tracker.state_bytes, "activations": acts.peak + head["peak"],
                "head_saved": head["peak"], "batch_shapes": lengths,
                "vocab": len(tok)}
    every = [None] * world
    torch.distributed.all_gather_object(every, measured)
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(every, f)


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.rank_run:
        return rank_main(a)
    from dataclasses import replace

    from devkit.launch_local import run_local
    from lomo_ds.planning import planner
    from lomo_ds.planning.dpo import dpo_estimate

    flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
             if k not in ("rank_run", "out", "save", "measured")]
    env = {"LOMO_DS_KEEP_FREED_MEMORY": "0", "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    if a.measured:  # the figures of an earlier run (its --save)
        with open(a.measured) as f:
            ranks = json.load(f)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "measured.json")
            proc = run_local(["-m", "benchmarks.dpo_memory", *flags, "--rank-run", f"--out={out}"], a.ranks,
                             timeout=3600, env=env, cwd=ROOT)
            if proc.returncode != 0:
                sys.exit(f"the DPO run failed:\n{proc.stderr[-6000:]}")
            with open(out) as f:
                ranks = json.load(f)
        if a.save:
            with open(a.save, "w") as f:
                json.dump(ranks, f)
    ds = _ds(a)["zero_optimization"]
    overrides = {**planner.run_overrides_from_ds({"zero_optimization": ds}), "seq": a.seq, "dtype": "fp32",
                 "checkpointing": False, "lomo_bucket": 25_000_000, "attn": "eager"}  # the model built above
    run = planner.run_spec(**overrides)
    spec = _spec(a, ranks[0]["vocab"])
    est = dpo_estimate(spec, a.optim, a.ranks, replace(run, leaf_classes=()), pairs=a.pairs)
    predicted = {"params": est.policy.params, "grads": est.policy.grads,
                 "optimizer_states": est.policy.optimizer_states,
                 "activations": est.policy.activations - est._chunked_saved + est.head_saved}
    mib = 2**20
    print(f"model: hidden {a.hidden}, {a.layers} layers, vocab {spec.vocab}, fp32, eager attention; {a.ranks} CPU "
          f"rank(s), {a.pairs} pairs ({2 * a.pairs} sequences of {a.seq} tokens) per micro-batch, {a.optim}, "
          f"norm clipping; batches seen {ranks[0]['batch_shapes']}")
    print("MiB per rank: " + " | ".join(["category", "planner", *[f"rank {r}" for r in range(a.ranks)]]))
    for key in ("params", "grads", "optimizer_states", "activations"):
        print(f"  {key:17s} {predicted[key] / mib:9.2f} " + " ".join(f"{r[key] / mib:9.2f}" for r in ranks))
    total_pred = sum(predicted.values())
    totals = [sum(r[k] for k in predicted) for r in ranks]
    print(f"  {'total':17s} {total_pred / mib:9.2f} " + " ".join(f"{t / mib:9.2f}" for t in totals))
    ratios = [t / total_pred for t in totals]
    print("  measured / planner: " + "  ".join(f"{x:.3f}" for x in ratios)
          + f"   (within 10%: {all(abs(x - 1) <= 0.10 for x in ratios)})")
    print(f"  planner's whole DPO peak (with TRL's head backward transient {est.head_transient / mib:.2f} MiB): "
          f"{est.total / mib:.2f} MiB")


if __name__ == "__main__":
    main()
