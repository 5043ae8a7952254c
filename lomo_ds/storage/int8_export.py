"""The 8-bit form of a run's export (output.export_int8, memory.int8_shards): each quantized
parameter's int8 values and its fp32 block scales on the global grid, as the engine keeps them,
beside the bf16 Hugging Face model (hf_model) that dequantizes them.

Layout of the folder (hf_model_int8 by the recipe):
    model.safetensors, or model-0000i-of-0000n.safetensors   the tensors, cut into files as hf_model's
    int8_export.json                                         the format (INDEX below), written last
    config.json, generation_config.json                      the model's, to build it (load_int8_model)

In the safetensors files a quantized parameter NAME is two tensors: NAME, int8 in the parameter's
shape (its flat index is the global one the blocks lie on), and NAME + SCALES, fp32, one scale per
block of `block` elements of that flat index (block k = [k * block, (k + 1) * block), the last one
ending at numel): element i reads q[i] * scales[i // block], computed in fp32 and cast once to the
compute dtype, as the run's gathers read it (runtime/quant8.py's dequantize). Every other parameter
(persistent ones: norms, biases; anything the run kept in its compute dtype) is NAME in its dtype. A
tied tensor is written once, under its first name, as in hf_model.

Written parameter by parameter: a quantized one is gathered as its int8 pieces over its partition
group and its scales put on the global grid by an all-reduce MAX (a block cut between two ranks
carries the same scale on both), so no rank holds the model, or any parameter, in fp32; rank 0 holds
one file's tensors at a time, as export_hf does.
"""
from __future__ import annotations

import gc
import json
import math
import os
import shutil

import torch

from lomo_ds.runtime import ds_compat, quant8
from lomo_ds.runtime.device import group_device
from lomo_ds.runtime.dist import full_copy_where, io_barrier
from lomo_ds.storage.checkpoint import MAX_SHARD_SIZE, export_groups, parse_size, write_atomic
from lomo_ds.storage.models import drop_gguf_marker

FORMAT = "lomo_ds.int8_blocks"
VERSION = 1
INDEX = "int8_export.json"
SCALES = ".int8_scales"  # the suffix of a quantized parameter's scales tensor


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str, what: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{what}: expected a torch dtype name, got {name!r}")
    return dtype


def gathered_int8(p, here: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Collective over the parameter's partition group, for a parameter whose shard is in 8 bits:
    (int8 values in its full shape, fp32 scales on the global grid), host tensors where `here` is
    true (None elsewhere). The int8 pieces travel, never a dequantized copy."""
    q, scales = ds_compat.int8_shard(p)
    block = ds_compat.int8_block(p)
    numel = ds_compat.full_numel(p)
    start, part, _, world = ds_compat.partition_slice(p)
    local = max(0, min(part, numel - start))
    first, pieces = quant8.piece_span(start, local, block)
    grid = torch.zeros(math.ceil(numel / block), dtype=torch.float32, device=scales.device)
    grid[first:first + pieces] = scales[:pieces]
    if world > 1:
        group = ds_compat.process_group(p)
        device = group_device(group)
        full = torch.empty(world * part, dtype=torch.int8, device=device)
        ds_compat.all_gather_into_tensor(full, q.to(device), group, name="8-bit export's integers")
        grid = grid.to(device)
        ds_compat.all_reduce(grid, group=group, name="8-bit export's scales", op="max")
    else:
        full = q
    if not here:
        return None
    return full[:numel].to("cpu", copy=True).view(ds_compat.full_shape(p)), grid.to("cpu", copy=True)


def _file_tensors(group, here: bool) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """Collective: one file's tensors (where `here`) and their entries in the index."""
    tensors, entries = {}, {}
    for name, p in group:
        if ds_compat.is_zero_param(p) and ds_compat.int8_shard(p) is not None:
            got = gathered_int8(p, here)
            if here:
                tensors[name], tensors[name + SCALES] = got
                entries[name] = {"quantized": True, "dtype": _dtype_name(p.dtype), "shape": list(got[0].shape),
                                 "block": ds_compat.int8_block(p)}
        else:
            full = full_copy_where(p, here)
            if here:
                tensors[name] = full.contiguous()
                entries[name] = {"quantized": False, "dtype": _dtype_name(full.dtype), "shape": list(full.shape)}
    return tensors, entries


def _refuse_unsupported(module: torch.nn.Module) -> None:
    if hasattr(module, "get_base_model") and hasattr(module, "peft_config"):
        raise ValueError("output.export_int8: a LoRA model's 8-bit shards are its adapters, not the model's weights; "
                         "its export is hf_model, the adapters merged")


def write_int8_model(module: torch.nn.Module, rank: int, out_dir: str, io_timeout: float,
                     max_shard_size: int | str = MAX_SHARD_SIZE) -> None:
    """Collective: the 8-bit form of `module` into `out_dir` (made if missing), cut into files as
    write_hf_model cuts hf_model (by the parameters' compute-dtype bytes), rank 0 writing."""
    from safetensors.torch import save_file

    _refuse_unsupported(module)
    groups = export_groups(module, parse_size(max_shard_size))
    writes = rank == 0
    if writes:
        os.makedirs(out_dir, exist_ok=True)
    params, weight_map = {}, {}
    for i, group in enumerate(groups):
        tensors, entries = _file_tensors(group, writes)
        if writes:
            fname = "model.safetensors" if len(groups) == 1 else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
            params.update(entries)
            weight_map.update(dict.fromkeys(tensors, fname))
        del tensors
        gc.collect()
        io_barrier(io_timeout)
    if writes:
        base = getattr(module, "get_base_model", lambda: module)()
        base.config.save_pretrained(out_dir)
        drop_gguf_marker(os.path.join(out_dir, "config.json"))
        if getattr(base, "generation_config", None) is not None:
            base.generation_config.save_pretrained(out_dir)
        blocks = {e["block"] for e in params.values() if e["quantized"]}
        index = {"format": FORMAT, "version": VERSION, "qmax": quant8.QMAX, "scales_suffix": SCALES,
                 "block": blocks.pop() if len(blocks) == 1 else None, "parameters": params,
                 "weight_map": dict(sorted(weight_map.items()))}
        write_atomic(os.path.join(out_dir, INDEX), lambda f: f.write(json.dumps(index, indent=1).encode()))
    io_barrier(io_timeout)


def export_int8(engine, out_dir: str, io_timeout: float, max_shard_size: int | str = MAX_SHARD_SIZE) -> str | None:
    """Collective: write_int8_model into a staging folder renamed into place whole (an interrupted
    export leaves `out_dir.partial`, never a half `out_dir`); `out_dir` on rank 0, None elsewhere."""
    staging = f"{out_dir}.partial"
    if engine.rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    write_int8_model(engine.module, engine.rank, staging, io_timeout, max_shard_size)
    if engine.rank == 0:
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(staging, out_dir)
    io_barrier(io_timeout)
    return out_dir if engine.rank == 0 else None


# ----------------------------------------------------------------------------- reading it back
def read_index(path: str) -> dict:
    """The folder's int8_export.json, checked to be this format."""
    index_file = os.path.join(path, INDEX)
    if not os.path.exists(index_file):
        raise FileNotFoundError(f"{index_file}: missing; expected a folder written with output.export_int8")
    with open(index_file) as f:
        index = json.load(f)
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise ValueError(f"{index_file}: expected format {FORMAT!r} version {VERSION}, "
                         f"got {index.get('format')!r} version {index.get('version')!r}")
    return index


def _dequantized(name: str, entry: dict, q: torch.Tensor, scales: torch.Tensor, dtype) -> torch.Tensor:
    numel, block = math.prod(entry["shape"]), entry["block"]
    if q.dtype != torch.int8 or list(q.shape) != entry["shape"]:
        raise ValueError(f"{name}: expected int8 of shape {entry['shape']}, got {q.dtype} of shape {list(q.shape)}")
    if scales.dtype != torch.float32 or scales.shape != (math.ceil(numel / block),):
        raise ValueError(f"{name}{SCALES}: expected {math.ceil(numel / block)} fp32 scales (blocks of {block}), "
                         f"got {scales.dtype} of shape {tuple(scales.shape)}")
    return quant8.dequantize(q.reshape(-1), scales, 0, block=block, dtype=dtype).view(entry["shape"])


def load_int8_export(path: str, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The state dict of an 8-bit export: the quantized parameters dequantized to `dtype` (None:
    the compute dtype the run gathered them in, so that they equal hf_model's bitwise), the others
    as stored (cast to `dtype` when given). One file's tensors are read at a time."""
    from safetensors.torch import load_file

    index = read_index(path)
    params, out = index["parameters"], {}
    for fname in sorted(set(index["weight_map"].values())):
        tensors = load_file(os.path.join(path, fname))
        for name, entry in params.items():
            if index["weight_map"].get(name) != fname:
                continue
            want = dtype or _dtype(entry["dtype"], f"{name}'s dtype in {INDEX}")
            if entry["quantized"]:
                out[name] = _dequantized(name, entry, tensors[name], tensors[name + SCALES], want)
            else:
                out[name] = tensors[name].to(want)
        del tensors
    return out


def load_int8_model(path: str, dtype: torch.dtype | None = None):
    """A transformers model (AutoModelForCausalLM, from the folder's config) holding
    load_int8_export(path, dtype); tied weights re-tied as from_pretrained ties them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    state = load_int8_export(path, dtype)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    model.to(dtype or next(iter(state.values())).dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    model.tie_weights()
    names = {n for n, _ in model.named_parameters()}  # a tied tensor under its first name only
    left = sorted(set(missing) & names - set(state))
    if unexpected or left:
        raise ValueError(f"{path}: the 8-bit export does not fit its config's model: unexpected {unexpected[:5]}, "
                         f"missing {left[:5]}")
    return model.eval()
