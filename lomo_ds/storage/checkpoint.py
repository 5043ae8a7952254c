"""Sharded, resumable checkpoints written atomically, and export to a Hugging Face directory
(sharded safetensors with an index).

Layout under <output.dir>/checkpoints/:
    step_00000040/...                 the engine's own files (engine.save_state: LOMO's rank_00000.pt
                                      shards + step state, DeepSpeed's checkpoint for its optimizers)
    step_00000040/rng_00000.pt ...    each rank's random state (CPU and device)
    step_00000040/meta.json           written last: world size, step, data position, config
    latest                            the name of the newest complete checkpoint

A checkpoint is first written to a temporary directory; only when every rank's file is on disk
(and synced) does rank 0 write meta.json, rename the directory into place and then replace
`latest`, each step atomic. A crash at any point leaves the previous checkpoint intact and
`latest` pointing at it.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch

from lomo_ds.runtime.device import capture_rng, restore_rng
from lomo_ds.storage.models import plain_state_dict

CKPT_DIR = "checkpoints"
# The largest safetensors file export_hf writes (huggingface_hub's default): a 65B model in fp16
# becomes ~26 files, not one of 130 GB.
MAX_SHARD_SIZE = "5GB"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, write) -> None:
    """`write(f)` into a temporary file, synced, then renamed over `path`."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(output_dir: str, engine, extra: dict[str, Any], keep_last: int, barrier) -> str:
    """Collective: every rank writes its shard file; rank 0 seals the checkpoint."""
    root = os.path.join(output_dir, CKPT_DIR)
    name = f"step_{engine.global_step:08d}"
    final = os.path.join(root, name)
    staging = os.path.join(root, f".{name}.partial")
    if engine.rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    barrier()
    engine.save_state(staging)
    rng = capture_rng(engine.device)  # dropout continues as in an uninterrupted run (CPU and device)
    write_atomic(_rng_file(staging, engine.rank), lambda f: torch.save(rng, f))
    barrier()
    if engine.rank == 0:
        meta = {"step": engine.global_step, "world": engine.world, **extra}
        write_atomic(os.path.join(staging, "meta.json"), lambda f: f.write(json.dumps(meta, indent=1).encode()))
        _fsync_dir(staging)
        if os.path.exists(final):  # a re-save of the same step (e.g. the end of a resumed run)
            shutil.rmtree(final)
        os.replace(staging, final)
        _fsync_dir(root)
        write_atomic(os.path.join(root, "latest"), lambda f: f.write(name.encode()))
        _prune(root, keep_last)
    barrier()
    return final


def _rng_file(path: str, rank: int) -> str:
    return os.path.join(path, f"rng_{rank:05d}.pt")


def _complete_checkpoints(root: str) -> list[str]:
    if not os.path.isdir(root):
        return []
    return sorted(d for d in os.listdir(root)
                  if d.startswith("step_") and os.path.exists(os.path.join(root, d, "meta.json")))


def _prune(root: str, keep_last: int) -> None:
    for old in _complete_checkpoints(root)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)


def latest_checkpoint(output_dir: str) -> str | None:
    root = os.path.join(output_dir, CKPT_DIR)
    pointer = os.path.join(root, "latest")
    if os.path.exists(pointer):
        with open(pointer) as f:
            name = f.read().strip()
        if os.path.exists(os.path.join(root, name, "meta.json")):
            return os.path.join(root, name)
    done = _complete_checkpoints(root)
    return os.path.join(root, done[-1]) if done else None


def load_checkpoint(path: str, engine) -> dict[str, Any]:
    """Collective: load the engine's state and this rank's RNG; returns the checkpoint's meta (with `extra`)."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    if meta["world"] != engine.world:
        raise ValueError(f"{path}: written by {meta['world']} ranks, this run has {engine.world}; "
                         f"resume with the same number of ranks")
    rng_file = _rng_file(path, engine.rank)
    if not os.path.exists(rng_file):
        raise FileNotFoundError(f"{rng_file}: missing RNG state file for rank {engine.rank}")
    engine.load_state(path)
    restore_rng(torch.load(rng_file, weights_only=False), engine.device)
    return meta


def export_hf(engine, tokenizer, out_dir: str, barrier, max_shard_size: int | str = MAX_SHARD_SIZE) -> str | None:
    """Collective: write the full fine-tuned model as a Hugging Face directory that
    `AutoModelForCausalLM.from_pretrained(out_dir)` loads: safetensors shards of at most
    `max_shard_size` (bytes, or "5GB"-style) with an index, or one model.safetensors when it all
    fits in one, as `save_pretrained` writes them. Parameters are gathered one at a time. A LoRA
    model is written merged; the tokenizer (with its chat template) is saved beside the weights."""
    from huggingface_hub import save_torch_state_dict

    state = engine.full_state_dict()
    if engine.rank == 0:
        module = engine.module
        state = plain_state_dict(module, state)  # LoRA adapters merged: a plain model of the base architecture
        # Tied weights are one tensor under several names; safetensors stores it once (under its
        # first name, the input embedding) and transformers re-ties on load.
        tensors, seen = {}, set()
        for name, t in state.items():
            if id(t) not in seen:
                seen.add(id(t))
                tensors[name] = t
        staging = f"{out_dir}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        module.config.save_pretrained(staging)
        if getattr(module, "generation_config", None) is not None:
            module.generation_config.save_pretrained(staging)
        save_torch_state_dict(tensors, staging, max_shard_size=max_shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(staging, out_dir)
    barrier()
    return out_dir if engine.rank == 0 else None
