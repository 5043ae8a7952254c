"""A step's memory against the vocabulary, measured on one CPU rank next to the planner's terms.

For a tiny LLaMA (bf16, untied embedding and head) at each vocabulary size, with LOMO (SGD) and
AdaLomo through `lomo_ds.initialize` + `train_step`:

  update   the largest rise of live tensor storage inside one slice's update (SGD.apply,
           AdaLomo's apply_bucket), counted by a dispatch mode over a whole step (the counter the
           planner's tests use): planner.update_temp_bytes / adalomo_update_temp_bytes
  loss     the largest rise inside the chunked loss's forward or backward, less what they return
           (the log-sum-exp; dh and the head's gradient, which the planner counts as the
           activations' gradient and "grads"): planner.loss_transient_bytes (a chunk's logits,
           and with several chunks the backward's fp32 sum of dh over the vocabulary's blocks)
  step     the process's resident high-water mark during a step above its resident size before it
           (the kernel's VmHWM, reset through /proc/self/clear_refs), after two warm-up steps: the
           planner's total less the steady part (the shards and AdaLomo's state)

Large allocations are given back to the system when freed (a fixed malloc mmap threshold, set
before torch loads), so the resident size follows live memory. The update and the loss are
chunked (memory.update_chunk_elements, memory.loss_chunk_logits set below the tiny model's largest
parameter and logits), so both terms must stay flat as V grows.

    python -m benchmarks.vocab_memory                       # V = 32k, 128k, 256k; SGD and AdaLomo
    python -m benchmarks.vocab_memory --vocabs 32000 --optimizers sgd --json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import weakref

from benchmarks.common import status_kib

MMAP_THRESHOLD = "65536"  # bytes: larger blocks are mmapped and unmapped on free (no dynamic threshold)


def _reexec_with_malloc_settings() -> None:
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD, "LOMO_DS_KEEP_FREED_MEMORY": "0"}
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.vocab_memory", *sys.argv[1:]], env)




def _reset_high_water() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class RegionCounter:
    """Live bytes of the storages ops allocate (views and in-place results are not new), with the
    peak rise inside named regions (the planner tests' counter, with regions)."""

    def __init__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                counter._note(out, torch)
                return out

        self.mode = Mode()
        self.known: set[int] = set()
        self.live = 0
        self.regions: dict[str, int] = {}
        self._open: list[list] = []  # [name, live at entry, peak inside, bytes to leave out]

    def _freed(self, ptr: int, nbytes: int) -> None:
        self.live -= nbytes
        self.known.discard(ptr)

    def _note(self, out, torch) -> None:
        from torch.utils._pytree import tree_leaves

        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                st = t.untyped_storage()
                if st.data_ptr() in self.known or st.nbytes() == 0:
                    continue
                self.known.add(st.data_ptr())
                self.live += st.nbytes()
                weakref.finalize(t, self._freed, st.data_ptr(), st.nbytes())
                for region in self._open:
                    region[2] = max(region[2], self.live)

    def region(self, name: str, fn, returned_bytes=lambda out, args: 0):
        def wrapped(*args, **kwargs):
            self._open.append([name, self.live, self.live])
            try:
                out = fn(*args, **kwargs)
            finally:
                _, entry, peak = self._open.pop()
            rise = peak - entry - returned_bytes(out, args)
            self.regions[name] = max(self.regions.get(name, 0), rise)
            return out
        return wrapped


def _tensor_bytes(x) -> int:
    import torch

    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (tuple, list)):
        return sum(_tensor_bytes(t) for t in x)
    return 0


def measure(vocab: int, optimizer: str, hidden: int, layers: int, seq: int, update_chunk: int, loss_chunk: int,
            seed: int = 0) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import lomo_ds
    from lomo_ds.engine import chunked_loss
    from lomo_ds.engine.update import adalomo as adalomo_mod
    from lomo_ds.engine.update import sgd as sgd_mod
    from lomo_ds.planning import planner

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                      tie_word_embeddings=False, attn_implementation="eager", torch_dtype="bfloat16")
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ds = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "lomo": {"optimizer": optimizer, "lr": 1e-3},
          "memory": {"update_chunk_elements": update_chunk, "loss_chunk_logits": loss_chunk}}
    engine = lomo_ds.initialize(model, ds)
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def batch():
        ids = torch.randint(0, vocab, (1, seq), generator=gen, device="cpu")
        return {"input_ids": ids, "labels": ids.clone()}

    for _ in range(2):  # warm-up: everything a step keeps for good is made
        engine.train_step(batch())
    step_batch = batch()
    steady = status_kib("VmRSS") * 1024
    _reset_high_water()
    engine.train_step(step_batch)
    step_extra = status_kib("VmHWM") * 1024 - steady

    counter = RegionCounter()
    saved = (sgd_mod.SGD.apply, adalomo_mod.AdaLomo.apply_bucket,
             chunked_loss.LinearCrossEntropy.forward, chunked_loss.LinearCrossEntropy.backward)
    sgd_mod.SGD.apply = counter.region("update", saved[0])
    adalomo_mod.AdaLomo.apply_bucket = counter.region("update", saved[1])
    # forward returns the loss (and keeps the log-sum-exp, 4 bytes a position, for the backward);
    # backward returns dh and the head's gradient: the activations' gradient and "grads".
    chunked_loss.LinearCrossEntropy.forward = staticmethod(counter.region(
        "loss", saved[2], lambda out, args: _tensor_bytes(out) + 4 * args[1].size(0)))
    chunked_loss.LinearCrossEntropy.backward = staticmethod(counter.region(
        "loss", saved[3], lambda out, args: _tensor_bytes(out)))
    # What exists before the step: the parameters, their shards, AdaLomo's state.
    from lomo_ds.runtime import ds_compat

    state = engine.updater.rule.state.values() if optimizer == "adalomo" else []
    counter.known = {t.untyped_storage().data_ptr() for t in
                     [*engine.module.parameters(), *(ds_compat.shard(p) for p in engine.params),
                      *(t for st in state for t in st.values() if torch.is_tensor(t))]}
    try:
        with counter.mode:
            engine.train_step(step_batch)
    finally:
        (sgd_mod.SGD.apply, adalomo_mod.AdaLomo.apply_bucket) = saved[:2]
        chunked_loss.LinearCrossEntropy.forward = staticmethod(saved[2])
        chunked_loss.LinearCrossEntropy.backward = staticmethod(saved[3])

    spec = planner.ModelSpec("tiny", hidden, layers, 2 * hidden, vocab, 4, kv_heads=2)
    run = planner.RunSpec(seq=seq, batch=1, dtype="bf16", checkpointing=False, update_chunk=update_chunk,
                          loss_chunk=loss_chunk, persistence=0)
    est = planner.estimate(spec, "lomo" if optimizer == "sgd" else "adalomo", 1, run)
    return {"vocab": vocab, "optimizer": optimizer, "param_bytes": param_bytes,
            "update": counter.regions.get("update", 0), "planner_update": est.update,
            "loss": counter.regions.get("loss", 0), "planner_loss": planner.loss_transient_bytes(spec, run),
            "step_extra": step_extra, "planner_step_extra": est.total - est.params - est.optimizer_states,
            "step_extra_over_params": step_extra / param_bytes}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocabs", default="32768,131072,262144")
    ap.add_argument("--optimizers", default="sgd,adalomo")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--update-chunk", type=int, default=1 << 20, help="memory.update_chunk_elements")
    ap.add_argument("--loss-chunk", type=int, default=1 << 22, help="memory.loss_chunk_logits")
    ap.add_argument("--json", action="store_true", help="one JSON line per run instead of the table")
    args = ap.parse_args(argv)
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"}.items():
        os.environ.setdefault(key, value)
    rows = [measure(int(v), opt, args.hidden, args.layers, args.seq, args.update_chunk, args.loss_chunk)
            for opt in args.optimizers.split(",") for v in args.vocabs.split(",")]
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    mib = 2**20
    print(f"tiny LLaMA h={args.hidden} L={args.layers}, seq {args.seq}, bf16, untied, one CPU rank; "
          f"update chunk {args.update_chunk:,} elements, loss chunk {args.loss_chunk:,} logits (MiB)")
    print("| optimizer | V | params | update (planner) | loss (planner) | step above steady (planner) "
          "| step / params |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['optimizer']} | {r['vocab']:,} | {r['param_bytes'] / mib:.1f} | {r['update'] / mib:.2f} "
              f"({r['planner_update'] / mib:.2f}) | {r['loss'] / mib:.2f} ({r['planner_loss'] / mib:.2f}) | "
              f"{r['step_extra'] / mib:.1f} ({r['planner_step_extra'] / mib:.1f}) | "
              f"{r['step_extra_over_params']:.2f} |")


if __name__ == "__main__":
    _reexec_with_malloc_settings()
    main()
