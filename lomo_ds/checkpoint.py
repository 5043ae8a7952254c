"""Sharded, resumable checkpoints written atomically, and export to a Hugging Face directory.

Layout under <output.dir>/checkpoints/:
    step_00000040/rank_00000.pt ...   each rank's parameter shards (+ fp32 masters) and step state
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

from .device import capture_rng, restore_rng

CKPT_DIR = "checkpoints"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: str, write) -> None:
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
    state = engine.shard_state_dict()
    state["rng"] = capture_rng(engine.device)  # dropout continues as in an uninterrupted run
    _write_file(os.path.join(staging, f"rank_{engine.rank:05d}.pt"), lambda f: torch.save(state, f))
    barrier()
    if engine.rank == 0:
        meta = {"step": engine.global_step, "world": engine.world, **extra}
        _write_file(os.path.join(staging, "meta.json"), lambda f: f.write(json.dumps(meta, indent=1).encode()))
        _fsync_dir(staging)
        if os.path.exists(final):  # a re-save of the same step (e.g. the end of a resumed run)
            shutil.rmtree(final)
        os.replace(staging, final)
        _fsync_dir(root)
        _write_file(os.path.join(root, "latest"), lambda f: f.write(name.encode()))
        _prune(root, keep_last)
    barrier()
    return final


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
    """Load this rank's shards and step state; returns the checkpoint's meta (with `extra`)."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    if meta["world"] != engine.world:
        raise ValueError(f"{path}: written by {meta['world']} ranks, this run has {engine.world}; "
                         f"resume with the same number of ranks")
    shard_file = os.path.join(path, f"rank_{engine.rank:05d}.pt")
    if not os.path.exists(shard_file):
        raise FileNotFoundError(f"{shard_file}: missing shard file for rank {engine.rank}")
    state = torch.load(shard_file, map_location="cpu", weights_only=False)
    engine.load_shard_state_dict(state)
    restore_rng(state["rng"], engine.device)
    return meta


def export_hf(engine, tokenizer, out_dir: str, barrier) -> str | None:
    """Collective: write the full fine-tuned model as a Hugging Face directory (safetensors) that
    `AutoModelForCausalLM.from_pretrained(out_dir)` loads. Parameters are gathered one at a time."""
    from safetensors.torch import save_file

    state = engine.full_state_dict()
    if engine.rank == 0:
        module = engine.module
        config = module.config
        tied = getattr(config, "tie_word_embeddings", False)
        tensors = {}
        seen = set()
        for name, t in state.items():
            # Tied weights are one tensor; safetensors stores it once and HF re-ties on load.
            if tied and id(t) in seen:
                continue
            seen.add(id(t))
            tensors[name] = t.contiguous()
        staging = f"{out_dir}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        config.save_pretrained(staging)
        if getattr(module, "generation_config", None) is not None:
            module.generation_config.save_pretrained(staging)
        save_file(tensors, os.path.join(staging, "model.safetensors"), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(staging, out_dir)
    barrier()
    return out_dir if engine.rank == 0 else None
