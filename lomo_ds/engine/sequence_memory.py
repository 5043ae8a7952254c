"""Activation memory that does not grow with the sequence beyond what must be kept (the `memory`
section's tiled_mlp, mlp_tiles and offload_checkpoints), installed on a model's decoder layers.

- Tiled MLP: each decoder layer's MLP runs through DeepSpeed's TiledMLP
  (deepspeed.runtime.sequence_parallel.ulysses_sp): the forward keeps only the MLP's input and
  computes it a tile of positions at a time without a graph; the backward recomputes one tile at a
  time with its graph. Each tile's backward adds into the MLP weights' .grad, and TiledMLP marks them
  ready only after the last tile (ds_compat.grad_is_ready): the engine's gradient hook waits for it,
  so the fused update sees each weight's whole gradient once, as without tiles.
- Offloaded checkpoints: each checkpointed layer's inputs go to host memory (pinned on an
  accelerator) from the forward until the backward recomputes the layer, through torch's
  save_on_cpu around the layer's checkpoint call, as transformers' own
  activation_checkpointing_enable(offload=True) does. The copy back to the device is asynchronous
  from pinned memory; the copy out waits for the device. On CPU ranks the host is the device's
  memory: the copies are made all the same (so the path is the one a GPU run takes).

The planner's terms for both: lomo_ds/planning/sequence.py (docs/memory.md, "Long sequences").
"""
from __future__ import annotations

import math

import torch

from lomo_ds.config.engine_sections import MemoryConfig


def decoder_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: the longest ModuleList (as the planner finds them)."""
    lists = [m for m in module.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def install(module: torch.nn.Module, memory: MemoryConfig, group, device: torch.device) -> None:
    """Install the configured options on `module`'s decoder layers; a clear error where one cannot apply."""
    if memory.tiled_mlp:
        mlps = [layer.mlp for layer in decoder_layers(module) if isinstance(getattr(layer, "mlp", None),
                                                                             torch.nn.Module)]
        if not mlps:
            raise ValueError(f"memory.tiled_mlp: {type(module).__name__} has no decoder layers with an `mlp` "
                             "module to tile")
        for mlp in mlps:
            if hasattr(mlp, "experts"):
                raise ValueError(f"memory.tiled_mlp: {type(mlp).__name__} routes tokens to experts; tiling is for "
                                 "a dense MLP (a position's output depends on that position only)")
            tile_mlp(mlp, memory.mlp_tiles, group, device)
    if memory.offload_checkpoints:
        layers = [layer for layer in decoder_layers(module) if getattr(layer, "gradient_checkpointing", False)]
        if not layers:
            raise ValueError("memory.offload_checkpoints: the model does not checkpoint its decoder layers; enable "
                             "model.gradient_checkpointing (TrainingArguments.gradient_checkpointing) first")
        for layer in layers:
            offload_checkpoint(layer, device)


def exact_tiles(rows: int, tiles: int) -> int:
    """At most `tiles` tiles that torch.chunk cuts `rows` rows into exactly (TiledMLP's backward marks
    the weights ready after its `tiles`-th tile: fewer pieces would never mark them)."""
    tiles = max(1, min(tiles, rows))
    return math.ceil(rows / math.ceil(rows / tiles))


def tile_mlp(mlp: torch.nn.Module, tiles: int, group, device: torch.device) -> None:
    """Route `mlp`'s forward through TiledMLP: `tiles` tiles, or 0 for ceil(positions / hidden)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    forward = mlp.forward  # the module's own, bound: the tiles call it directly

    def tiled(x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return forward(x)  # no graph to keep: nothing to save by tiling
        want = tiles or math.ceil(x.shape[-2] / x.shape[-1])
        if group is not None and torch.distributed.get_world_size(group) > 1:
            # every rank runs the same number of tiles (each may gather the MLP's weights)
            agreed = torch.tensor([want], device=device)
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX, group=group)
            want = int(agreed.item())
        n = exact_tiles(x.numel() // x.shape[-1], want)
        if n <= 1:
            return forward(x)
        params = [p for p in mlp.parameters() if p.requires_grad]
        return TiledMLP.apply(lambda _, t: forward(t), mlp, x, n, params)

    mlp.forward = tiled


def offload_checkpoint(layer: torch.nn.Module, device: torch.device) -> None:
    """Wrap `layer`'s checkpoint call in save_on_cpu: its saved inputs live in host memory."""
    checkpoint = layer._gradient_checkpointing_func
    pin = device.type != "cpu"

    def offloaded(function, *args, **kwargs):
        with torch.autograd.graph.save_on_cpu(pin_memory=pin, device_type=device.type):
            return checkpoint(function, *args, **kwargs)

    layer._gradient_checkpointing_func = offloaded
