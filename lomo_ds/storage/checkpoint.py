"""Sharded, resumable checkpoints written atomically, and export to a Hugging Face directory
(sharded safetensors with an index).

Layout under <output.dir>/checkpoints/:
    step_00000040/...                 the engine's own files (engine.save_state: LOMO's engine_state/,
                                      storage/engine_state.py, resumable on any rank count; DeepSpeed's
                                      checkpoint for its optimizers)
    step_00000040/rng_00000.pt ...    each rank's random state (CPU and device)
    step_00000040/meta.json           written last: world size, step, data position, config
    latest                            the name of the newest complete checkpoint

A checkpoint is first written to a temporary directory; only when every rank's file is on disk
(and synced) does rank 0 write meta.json, rename the directory into place and then replace
`latest`, each step atomic. A crash at any point leaves the previous checkpoint intact and
`latest` pointing at it. The recipe's barrier here is io_barrier (output.io_timeout): ranks wait
for disk writes under that timeout, not the collectives'.
"""
from __future__ import annotations

# DeepSpeed, transformers, safetensors and peft are imported inside the functions that use them: the
# CLI and the config checks start without them, and recipe/train.py's show_what_matters sets the
# ranks' logging before their first import.
import gc
import json
import os
import shutil
from typing import Any

import torch

from lomo_ds.runtime import ds_compat
from lomo_ds.runtime.device import capture_rng, restore_rng
from lomo_ds.runtime.dist import full_copy_where, io_barrier
from lomo_ds.storage.models import drop_gguf_marker, plain_state_dict

CKPT_DIR = "checkpoints"


class CheckpointError(ValueError):
    """A checkpoint this run cannot resume from (another model, another method's files); names it."""
# Seconds ranks wait for each other's disk writes where no run config says (output.io_timeout's default).
IO_TIMEOUT_S = 4 * 3600.0
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
        # `latest`'s new text is on disk before the checkpoint is sealed, so that the two renames
        # follow each other at once: a checkpoint is `latest` as soon as it is whole (a process
        # killed between them: latest_checkpoint takes the newer whole checkpoint).
        pointer = os.path.join(root, "latest")
        write_atomic(f"{pointer}.next", lambda f: f.write(name.encode()))
        os.replace(staging, final)
        os.replace(f"{pointer}.next", pointer)
        _fsync_dir(root)
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
    done = _complete_checkpoints(root)
    if os.path.exists(pointer):
        with open(pointer) as f:
            name = f.read().strip()
        # Not one older than the newest whole checkpoint: a process killed between sealing a
        # checkpoint and replacing the pointer leaves the pointer one behind.
        if os.path.exists(os.path.join(root, name, "meta.json")) and not (done and done[-1] > name):
            return os.path.join(root, name)
    return os.path.join(root, done[-1]) if done else None


def load_checkpoint(path: str, engine) -> dict[str, Any]:
    """Collective: load the engine's state and this rank's RNG; returns the checkpoint's meta (with `extra`)."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    if meta["world"] != engine.world and not getattr(engine, "reshards", False):
        raise ValueError(f"{path}: written by {meta['world']} ranks, this run has {engine.world}; "
                         f"train.method {getattr(engine, 'method', '?')!r} resumes on the same number of ranks")
    # On another rank count, a new rank continues an old one's random streams (dropout): the same
    # streams, dealt out again, not those of an uninterrupted run.
    rng = read_rng(path, engine.rank % meta["world"])
    engine.load_state(path)
    restore_rng(rng, engine.device)
    return meta


def read_rng(path: str, rank: int) -> dict[str, torch.Tensor]:
    """A rank's random state from checkpoint `path`; tensors only (weights_only: a checkpoint from
    anywhere else must not run code on every rank)."""
    rng_file = _rng_file(path, rank)
    if not os.path.exists(rng_file):
        raise FileNotFoundError(f"{rng_file}: missing RNG state file for rank {rank}")
    return torch.load(rng_file, weights_only=True)


_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a "5GB"-style string (decimal units, as save_pretrained's max_shard_size)."""
    if isinstance(size, int):
        return size
    text = size.strip().upper()
    for unit, factor in _UNITS.items():
        if text.endswith(unit) and text[:-len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(text[:-len(unit)]) * factor)
    if text.isdigit():
        return int(text)
    raise ValueError(f"max_shard_size: expected bytes or a size like '5GB', got {size!r}")


def _lora_layer(name: str) -> str | None:
    """The peft LoRA layer a parameter belongs to (its base weight and adapters are merged together),
    or None."""
    for part in (".base_layer.", ".lora_A.", ".lora_B."):
        if part in name:
            return name.split(part, 1)[0]
    return None


def export_groups(module: torch.nn.Module, limit: int) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """The parameters an export writes, in order, cut into files of at most `limit` bytes (a LoRA
    layer's base weight and adapters never split, nor one tensor larger than the limit). A tied
    tensor is written once, under its first name (transformers re-ties it on load). The same on
    every rank: sizes come from each parameter's full shape, not its shard."""
    units: list[list[tuple[str, torch.nn.Parameter]]] = []
    seen: set[int] = set()
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        layer = _lora_layer(name)
        if units and layer is not None and _lora_layer(units[-1][-1][0]) == layer:
            units[-1].append((name, p))
        else:
            units.append([(name, p)])
    groups: list[list[tuple[str, torch.nn.Parameter]]] = []
    size = 0
    for unit in units:
        nbytes = sum(ds_compat.full_numel(p) * p.element_size() for _, p in unit)
        if not groups or size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].extend(unit)
        size += nbytes
    return groups


def _gathered(params: list[tuple[str, torch.nn.Parameter]], here: bool) -> dict[str, torch.Tensor]:
    """Collective: the full parameters on the host of the ranks where `here` is true (empty
    elsewhere), gathered one at a time."""
    out = {}
    for name, p in params:
        full = full_copy_where(p, here)
        if here:
            out[name] = full
    return out


def export_hf(engine, tokenizer, out_dir: str, io_timeout: float, max_shard_size: int | str = MAX_SHARD_SIZE,
              write_file=None) -> str | None:
    """Collective: write the full fine-tuned model as a Hugging Face directory that
    `AutoModelForCausalLM.from_pretrained(out_dir)` loads (write_hf_model), into a staging folder
    renamed into place whole: an interrupted export leaves `out_dir.partial`, never a half `out_dir`."""
    staging = f"{out_dir}.partial"
    if engine.rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    write_hf_model(engine.module, engine.rank, staging, tokenizer, io_timeout, max_shard_size, write_file)
    if engine.rank == 0:
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(staging, out_dir)
    io_barrier(io_timeout)
    return out_dir if engine.rank == 0 else None


def write_hf_model(module: torch.nn.Module, rank: int, out_dir: str, tokenizer, io_timeout: float,
                   max_shard_size: int | str = MAX_SHARD_SIZE, write_file=None, writes: bool | None = None) -> None:
    """Collective: the full model into `out_dir` (made if missing) as `save_pretrained` writes it:
    safetensors files of at most `max_shard_size` (bytes, or "5GB"-style) with an index, or one
    model.safetensors when it all fits in one; the config, the generation config, and the tokenizer
    (with its chat template) beside them. A LoRA model is written merged.

    Streamed: parameters are gathered one at a time and rank 0 holds at most one file's tensors in
    host memory (a 65B model is 130 GB; one file is 5 GB). While rank 0 writes a file the others
    wait in io_barrier, under `io_timeout` (output.io_timeout), not the collectives' timeout.
    `write_file(tensors, path)`: how a file is written (safetensors; tests slow it down).
    `writes`: whether this rank makes and writes the folder (None: rank 0 only). Where every node
    keeps its own copy (the Trainer's save_on_each_node, storage no node shares) each node's first
    rank writes, holding one file's tensors as rank 0 does."""
    from safetensors.torch import save_file

    write_file = write_file or (lambda tensors, path: save_file(tensors, path, metadata={"format": "pt"}))
    groups = export_groups(module, parse_size(max_shard_size))
    writes = rank == 0 if writes is None else writes
    if writes:
        os.makedirs(out_dir, exist_ok=True)
    weight_map, total_size = {}, 0
    for i, group in enumerate(groups):
        tensors = _gathered(group, writes)
        if writes:
            # LoRA adapters merged: a plain model of the base architecture.
            tensors = {k: v.contiguous() for k, v in plain_state_dict(module, tensors).items()}
            fname = "model.safetensors" if len(groups) == 1 else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            write_file(tensors, os.path.join(out_dir, fname))
            for k, v in tensors.items():
                weight_map[k] = fname
                total_size += v.numel() * v.element_size()
        del tensors
        gc.collect()  # a group's tensors may sit in reference cycles (the gathers' hooks): free them now
        io_barrier(io_timeout)
    if writes:
        if len(groups) > 1:
            index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
            with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
        base = getattr(module, "get_base_model", lambda: module)()
        base.config.save_pretrained(out_dir)
        drop_gguf_marker(os.path.join(out_dir, "config.json"))  # the built-in model's: its weights are plain
        if getattr(base, "generation_config", None) is not None:
            base.generation_config.save_pretrained(out_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
    io_barrier(io_timeout)
