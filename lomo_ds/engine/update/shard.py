"""This rank's shard of each parameter: where its slice lies (geometry), how a slice is read in
chunks, and its weights as the update rules read and write them (fp32 masters, stochastic rounding).

Shard layout (DeepSpeed ZeRO-3): ShardGeometry (runtime/shard_geometry.py, below this layer and the
checkpoint's, which both cut by it).

Chunks (memory.update_chunk_elements): a slice is updated `chunk` elements at a time, so the update's
temporaries (an fp32 copy of the gradient and of the weights where they are not fp32, and the
stochastic-rounding noise) are bounded by the chunk, not by the largest parameter. Stochastic
rounding draws its noise chunk by chunk from the same per-device generator, in the slice's order:
on a CPU the draws come from the generator one element after another, so the noise is the same as
one draw over the slice; on an accelerator each draw advances the generator's offset by its own
amount, so the noise differs from an unchunked update's, and is still independent and uniform for
every element (unbiased).

8-bit shards (memory.int8_shards) go through int8.py instead: a chunk is dequantized to fp32 and
requantized on write-back with noise keyed by the element's global index, so their chunks lie on the
global block grid (`ShardWeights.chunks`) and the noise does not depend on them or on the rank.
"""
from __future__ import annotations

from typing import Any

import torch

from lomo_ds.engine.precision import stochastic_round_to_bf16
from lomo_ds.engine.update.int8 import Int8Shards, int8_shard
from lomo_ds.runtime import ds_compat
from lomo_ds.runtime.shard_geometry import ShardGeometry, chunk_bounds


def geometry(param: torch.nn.Parameter, world: int, rank: int) -> ShardGeometry:
    return ShardGeometry(ds_compat.full_numel(param), world, rank)


class ShardGeometries:
    """This rank's ShardGeometry of each parameter, from the parameter's own process group
    (`ds_process_group`): that group's size and this rank's place in it."""

    def __init__(self):
        self._cache: dict[int, ShardGeometry] = {}

    def __call__(self, param: torch.nn.Parameter) -> ShardGeometry:
        pid = ds_compat.param_id(param)
        if pid not in self._cache:
            if torch.distributed.is_initialized():
                group = ds_compat.process_group(param)
                world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
            else:  # a single process without a process group holds the whole parameter
                world, rank = 1, 0
            self._cache[pid] = geometry(param, world, rank)
        return self._cache[pid]




def grad_chunk(grad, a: int, b: int, device: torch.device, *, fresh: bool = False) -> torch.Tensor:
    """Elements [a, b) of a reduced gradient slice as fp32 on `device`. `fresh`: a new tensor the
    caller may overwrite; else possibly a view of the slice itself (the received bucket, the
    accumulator's buffer), which the caller must never write: an update that reads a chunk more than
    once (AdaLomo's three phases) would read its own writes. `grad` is a tensor, or an object with
    `chunk(a, b, device, fresh)` (the accumulator's sum, accumulation.py)."""
    if torch.is_tensor(grad):
        return grad[a:b].to(device, torch.float32, copy=fresh)
    return grad.chunk(a, b, device, fresh=fresh)


def grad_in_place(grad, n: int, device: torch.device) -> torch.Tensor | None:
    """The slice's first n elements as one fp32 tensor on `device` without a copy, or None where
    that needs one (then it is read chunk by chunk). It is the received bucket or the accumulator's
    buffer itself: a caller that writes it reads the gradient through this tensor alone from then
    on (AdaLomo's in-place route), and nothing reads the slice after the update (the bucket is
    freed, the accumulator zeroed)."""
    if torch.is_tensor(grad):
        real = grad[:n]
        return real if real.dtype == torch.float32 and real.device == device else None
    return grad.in_place(n, device)


def grad_sum_sq(grad, n: int, chunk: int) -> torch.Tensor:
    """fp64 squared L2 norm of a gradient slice's first n elements, on the slice's device: one
    fp32 norm over the slice where it is fp32 (as clip_grad_norm_ takes it per tensor), else
    fp32 norms of its chunks, summed in fp64 (no fp32 copy of the whole slice)."""
    device = grad.device
    whole = grad_in_place(grad, n, device)
    if whole is not None:
        return torch.linalg.vector_norm(whole, dtype=torch.float32).double().square_()
    total = torch.zeros((), dtype=torch.float64, device=device)
    for a, b in chunk_bounds(n, chunk):
        total.add_(torch.linalg.vector_norm(grad_chunk(grad, a, b, device)).double().square_())
    return total


def check_shapes(state: dict[str, Any], module: torch.nn.Module) -> None:
    """Refuse a rank state (shard_state_dict's) written for another model: a parameter this model
    lacks, or one of another shape (checkpoints that record the shapes)."""
    by_name = dict(module.named_parameters())
    for name in state["shards"]:
        if name not in by_name:
            raise ValueError(f"checkpoint has parameter {name!r}, the model does not: a checkpoint of another "
                             f"model?")
    for name, shape in (state.get("shapes") or {}).items():
        mine = list(ds_compat.full_shape(by_name[name]))
        if list(shape) != mine:
            raise ValueError(f"checkpoint's {name!r} has shape {tuple(shape)}, this model's {tuple(mine)}: a "
                             f"checkpoint of another model (model.path)")


class ShardWeights:
    """The weights of this rank's real shard elements as the update rules see them: fp32, read and
    written chunk by chunk. They are the fp32 master copy where one is kept
    (lomo.fp32_master_weights), the shard itself where it is fp32, else an fp32 copy of the chunk
    that write_back rounds into the shard (stochastically, where lomo.stochastic_rounding asks)."""

    def __init__(self, geometry: ShardGeometries, stochastic_rounding: bool, seed: int, master_params=(),
                 chunk: int = 1 << 22, int8: Int8Shards | None = None):
        self.geometry = geometry
        self.stochastic_rounding = stochastic_rounding
        self.seed = seed
        self.chunk = chunk  # memory.update_chunk_elements
        # memory.int8_shards: the 8-bit path of the shards that carry scales (int8.py); None: none do.
        self.int8 = int8
        self.masters: dict[int, torch.Tensor] = {}  # ds_id -> fp32 copy of the local real elements
        for p in master_params:
            n = self.geometry(p).local
            self.masters[ds_compat.param_id(p)] = ds_compat.shard(p)[:n].detach().float().clone()
        # Stochastic rounding draws its noise on each shard's device (torch refuses a generator on
        # another device): one generator per device, reseeded every step.
        self._generators: dict[torch.device, torch.Generator] = {}
        self._step = 0

    # ----------------------------------------------------------------- stochastic rounding
    def reseed(self, step: int) -> None:
        """The rounding noise of optimizer step `step`."""
        self._step = step
        if self.int8 is not None:
            self.int8.step = step
        for gen in self._generators.values():
            gen.manual_seed(self._seed_for(step))

    def _seed_for(self, step: int) -> int:
        # A pure function of (seed, rank, step): resumed runs round exactly as uninterrupted ones.
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return (self.seed * 1_000_003 + step) * 4099 + rank

    def generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self._seed_for(self._step))
        return self._generators[device]

    # ----------------------------------------------------------------- the weights
    def _is_int8(self, param: torch.nn.Parameter) -> bool:
        return self.int8 is not None and int8_shard(param) is not None

    def in_place(self, param: torch.nn.Parameter) -> bool:
        """Whether `weights(param)` is the stored fp32 weights themselves (a master, or an fp32
        shard), not a copy: then a whole-slice pass over them needs no temporary."""
        return (ds_compat.param_id(param) in self.masters
                or ds_compat.shard(param).dtype == torch.float32)

    def chunks(self, param: torch.nn.Parameter, align: int = 1, on_grid: bool = False) -> list[tuple[int, int]]:
        """[a, b) chunks of this rank's slice of `param` to read, update and write back one at a
        time (memory.update_chunk_elements): with `align` a row length, whole rows in a chunk. Their
        ends lie at multiples of the chunk size in the parameter's flat index where `on_grid`, else
        in the slice's. On an 8-bit shard they always lie on the global block grid (a block is
        requantized at once, and every rank count cuts the same chunks there)."""
        geo = self.geometry(param)
        if self._is_int8(param):
            return self.int8.chunks(param, self.chunk, align)
        return chunk_bounds(geo.local, self.chunk, geo.start if on_grid else 0, align)

    def settle(self, params: list) -> None:
        """Finish a bucket's writes (every rank of the parameters' group, the same list): the
        8-bit shards' cut blocks are requantized here (a small all-reduce). Nothing otherwise."""
        if self.int8 is not None:
            self.int8.settle(params)

    def take_rescaled(self) -> int:
        """8-bit blocks whose scale was recomputed since the last call (0 without 8-bit shards)."""
        return self.int8.take_rescaled() if self.int8 is not None else 0

    def sum_sq(self, param: torch.nn.Parameter) -> torch.Tensor:
        """sum(θ^2) of this rank's real elements (fp32, on the shard's device): one norm over the
        stored fp32 weights, or over fp32 copies of their chunks (summed in fp32)."""
        if self.in_place(param):
            return torch.linalg.vector_norm(self.weights(param)).square()
        total = torch.zeros((), dtype=torch.float32, device=ds_compat.shard(param).device)
        for a, b in self.chunks(param):
            total += torch.linalg.vector_norm(self.weights(param, a, b)).square()
        return total

    def weights(self, param: torch.nn.Parameter, a: int = 0, b: int | None = None) -> torch.Tensor:
        """fp32 weights of this rank's real elements [a, b) (default: all of them) to update in
        place: the master copy, the shard itself when it is fp32, else an fp32 copy that write_back
        rounds into the shard."""
        b = self.geometry(param).local if b is None else b
        master = self.masters.get(ds_compat.param_id(param))
        if master is not None:
            return master[a:b]
        if self._is_int8(param):
            return self.int8.weights(param, a, b)
        return ds_compat.shard(param)[a:b].float()

    def write_back(self, param: torch.nn.Parameter, weights: torch.Tensor, a: int = 0, b: int | None = None) -> None:
        """Store updated fp32 `weights` (from `weights(param, a, b)`) into elements [a, b) of the
        parameter's shard."""
        b = self.geometry(param).local if b is None else b
        if self._is_int8(param):
            self.int8.write_back(param, weights, a, b)  # [a, b): whole blocks (chunks)
            return
        shard = ds_compat.shard(param)[a:b]
        if weights.dtype == shard.dtype and weights.data_ptr() == shard.data_ptr():
            return  # fp32 shard updated in place
        if shard.dtype == torch.bfloat16 and self.stochastic_rounding and ds_compat.param_id(param) not in self.masters:
            shard.copy_(stochastic_round_to_bf16(weights, self.generator(shard.device)))
        else:
            shard.copy_(weights)

    def write_full(self, param: torch.nn.Parameter, full: torch.Tensor) -> None:
        """Store this rank's slice of the whole parameter's values `full` (flat, the same on every
        rank) into its shard: copied, or rounded to nearest into an 8-bit shard (int8.py)."""
        if self._is_int8(param):
            self.int8.write_full(param, full)
            return
        geo = self.geometry(param)
        if geo.local:
            ds_compat.shard(param)[:geo.local].copy_(full[geo.start:geo.start + geo.local])

    def master_bytes(self) -> int:
        return sum(m.numel() * m.element_size() for m in self.masters.values())

    # ----------------------------------------------------------------- resumable state
    def state_dict(self, module: torch.nn.Module, params: list) -> dict[str, Any]:
        """{"shards", "masters"} by parameter name. The tensors are the live shards themselves, not
        copies (a node's ranks would otherwise hold the whole model twice in host memory): write
        them out before the next step. torch.save copies a device tensor to the host one at a time
        as it writes it."""
        names = {id(p): n for n, p in module.named_parameters()}
        int8 = {}
        if self.int8 is not None:
            self.int8.check_settled()
            # The scales on the global grid, one a block, the same on every rank (Replicated: no
            # PIECES entry); every rank count reads its own pieces' from them. Collective.
            int8 = {"int8_scales": {names[id(p)]: self.int8.global_scales(p) for p in params if self._is_int8(p)}}
        return {**int8, "shards": {names[id(p)]: ds_compat.shard(p).detach() for p in params},
                "masters": {names[id(p)]: self.masters[ds_compat.param_id(p)].detach()
                            for p in params if ds_compat.param_id(p) in self.masters},
                # The whole parameters' shapes: a checkpoint of another model is refused by name
                # (check_shapes), on any rank count.
                "shapes": {names[id(p)]: list(ds_compat.full_shape(p)) for p in params}}

    def check_state(self, state: dict[str, Any], module: torch.nn.Module, params: list) -> None:
        """Refuse, before anything is written, shards and masters that do not fit this run."""
        check_shapes(state, module)
        by_name = dict(module.named_parameters())
        names = {id(p): n for n, p in by_name.items()}
        scales = state.get("int8_scales") or {}
        for p in params:
            name = names[id(p)]
            if name not in state["shards"]:
                raise ValueError(f"checkpoint has no shard of {name!r}, which this run trains")
            if self._is_int8(p) != (name in scales):
                raise ValueError(f"memory.int8_shards: the checkpoint's {name!r} is {'' if name in scales else 'not '}"
                                 f"an 8-bit shard and this run's is {'' if self._is_int8(p) else 'not'}: resume "
                                 "with the memory.int8_shards setting it was written with")
            if name in scales:
                self.int8.check_scales(p, name, scales[name])
            if ds_compat.param_id(p) in self.masters and name not in state["masters"]:
                # Left at its pretrained value, the master would overwrite the trained shard at
                # the first update.
                raise ValueError(f"checkpoint has no fp32 master of {name!r}: it was written without "
                                 f"lomo.fp32_master_weights; resume with the setting it was written with")

    def load_state_dict(self, state: dict[str, Any], module: torch.nn.Module) -> None:
        """Write what state_dict wrote (checked by check_state) into the shards and masters."""
        by_name = dict(module.named_parameters())
        for name, tensor in state["shards"].items():
            ds_compat.shard(by_name[name]).copy_(tensor)  # an 8-bit shard's integers as saved
        for name, scales in (state.get("int8_scales") or {}).items():
            self.int8.load_scales(by_name[name], scales)
        for name in state["masters"]:
            master = self.masters.get(ds_compat.param_id(by_name[name]))
            if master is not None:
                master.copy_(state["masters"][name])
