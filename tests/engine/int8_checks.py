"""What the 8-bit update checks build: a tiny model's parameters as ZeRO-3 int8 shards (the flat int8
piece, its pieces' scales, where it lies), the single-process reference that dequantizes the same
blocks, steps torch.optim.SGD (or the reference AdaLomo) in fp32 and requantizes with the same keyed
noise, and the sharded run through the engine's updater (ShardUpdater, the rules, ShardWeights'
8-bit path). tests/engine/test_int8_update.py declares the checks and asserts on them.

The shards are built here, from the reference's own quantization of the whole parameter (one scale
a global block, so a cut block's pieces share it); the gradient each rank updates from is its slice
of the reference's global-batch gradient, so that the update, not the forward, is what is compared.

The 8-bit tests elsewhere (the engine's, the gather's, the Trainer's, the GPU checks) read their
runs back through the same helpers: gathered (shards built here), module_gathered (an engine's
module) and fetched_weights (the weights the forward's fetch leaves).
"""
from __future__ import annotations

import torch

from lomo_ds.config.engine_config import AdaLomoConfig
from lomo_ds.engine.update import SGD, AdaLomo, PassSettings, PassStats, ShardGeometries, ShardUpdater
from lomo_ds.engine.update.int8 import Int8Shards, cut_blocks
from lomo_ds.runtime import ds_compat, quant8
from lomo_ds.runtime.shard_geometry import ShardGeometry
from tests.adalomo_reference import ReferenceAdaLomo
from tests.tiny import global_batch, tiny_llama

SEED, LR, BLOCK, CHUNK = 5, 0.05, 16, 48
MICRO = 3  # micro-batches of the global batch, whatever the rank count: the same gradient on each


class Int8Param:
    """A ZeRO-3 parameter as the update reads it: this rank's flat int8 piece (padded to the cut's
    length), its pieces' scales (ds_quant_scale), its id, shape and process group."""

    def __init__(self, ds_id: int, q_full: torch.Tensor, s_full: torch.Tensor, shape, group, world: int, rank: int):
        geo = ShardGeometry(q_full.numel(), world, rank)
        self.ds_id, self.ds_numel, self.ds_shape, self.ds_process_group = ds_id, q_full.numel(), shape, group
        self.ds_tensor = torch.zeros(geo.part, dtype=torch.int8, device="cpu")
        self.ds_tensor[:geo.local] = q_full[geo.start:geo.start + geo.local]
        # One scale per block the padded slice touches (ds_compat's layout), 0 past the parameter.
        first, pieces = quant8.piece_span(geo.start, geo.part, BLOCK)
        padded = torch.zeros(first + pieces, dtype=torch.float32, device="cpu")
        real = s_full[:first + pieces]
        padded[:real.numel()] = real
        self.ds_tensor.ds_quant_scale = padded[first:].clone()

    @property
    def ds_quant_scale(self) -> torch.Tensor:
        return self.ds_tensor.ds_quant_scale


class ShardedModel:
    """The shards as a module gives them to the updater (named_parameters)."""

    def __init__(self, params: list[tuple[str, Int8Param]]):
        self.params = params

    def named_parameters(self):
        return iter(self.params)


class Reference:
    """The tiny model in fp32 on one process, its weights the dequantized 8-bit blocks."""

    def __init__(self, rule: str = "sgd", seed: int = 3):
        self.model = tiny_llama(seed)
        self.names = [n for n, _ in self.model.named_parameters()]
        self.q, self.s = {}, {}
        for n, p in self.model.named_parameters():
            self.q[n], self.s[n] = quant8.quantize(p.detach().reshape(-1), 0, block=BLOCK)
        params = list(self.model.parameters())
        self.opt = torch.optim.SGD(params, lr=LR) if rule == "sgd" else ReferenceAdaLomo(params, lr=LR)
        self.rescaled = 0

    def _load(self) -> None:
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(quant8.dequantize(self.q[n], self.s[n], 0, block=BLOCK).view_as(p))

    def gradients(self, step: int) -> dict[str, torch.Tensor]:
        """The global batch's gradient at the current 8-bit weights, flat, by name."""
        self._load()
        self.model.zero_grad()
        loss = sum(self.model(**mb).loss for mb in global_batch(step, MICRO)) / MICRO
        loss.backward()
        return {n: p.grad.detach().reshape(-1).clone() for n, p in self.model.named_parameters()}

    def step(self, step: int) -> None:
        """One update in fp32 on the whole parameters (gradients() first), requantized with the
        keyed noise of (SEED, step, the parameter's index by name)."""
        self.opt.step()
        for i, (n, p) in enumerate(self.model.named_parameters()):
            self.q[n], self.s[n], grown = quant8.requantize(p.detach().reshape(-1), self.s[n], 0, (SEED, step, i),
                                                            block=BLOCK)
            self.rescaled += int(grown)


def shards(ref: Reference, group, world: int, rank: int, q=None, s=None) -> ShardedModel:
    q, s = q or ref.q, s or ref.s
    return ShardedModel([(n, Int8Param(100 + 7 * i, q[n], s[n], tuple(p.shape), group, world, rank))
                         for i, (n, p) in enumerate(ref.model.named_parameters())])


def updater(model: ShardedModel, rule: str = "sgd", int8_class=Int8Shards) -> ShardUpdater:
    geometry = ShardGeometries()
    noise_ids = {p.ds_id: i for i, (_, p) in enumerate(model.named_parameters())}
    params = [p for _, p in model.params]
    group = params[0].ds_process_group
    the_rule = SGD() if rule == "sgd" else AdaLomo(AdaLomoConfig(), model, params, group, geometry)
    return ShardUpdater(True, SEED, torch.device("cpu"), geometry, the_rule, chunk=CHUNK,
                        int8=int8_class(geometry, BLOCK, SEED, noise_ids))


def sharded_step(up: ShardUpdater, model: ShardedModel, grads: dict[str, torch.Tensor], step: int) -> None:
    """One updating pass over two buckets (each settles its own cut blocks)."""
    up.begin_pass(PassSettings(lr=LR), step=step)
    items = []
    for n, p in model.params:
        geo = up.geometry(p)
        items.append((p, grads[n][geo.start:geo.start + geo.local]))
    half = len(items) // 2
    for bucket in (items[:half], items[half:]):
        up.apply_bucket(bucket, PassStats(torch.device("cpu")))


def gathered(model: ShardedModel, group) -> tuple[dict, dict, int]:
    """(full int8 values, full scales, cut blocks whose pieces' scales disagree) put together on the
    host from every rank of `group`, on every rank. Each rank's pieces are copied to the host before
    they are sent: a device tensor pickled by one rank would be rebuilt on that rank's device by the
    others."""
    world = torch.distributed.get_world_size(group)
    mine = {}
    for n, p in model.params:
        geo = ShardGeometry(p.ds_numel, world, torch.distributed.get_rank(group))
        first, pieces = quant8.piece_span(geo.start, geo.local, BLOCK)
        mine[n] = (p.ds_tensor[:geo.local].to("cpu", copy=True), first,
                   p.ds_quant_scale[:pieces].to("cpu", copy=True))
    every = [None] * world
    torch.distributed.all_gather_object(every, mine, group=group)
    q, s, disagree = {}, {}, 0
    for n, p in model.params:
        q[n] = torch.cat([r[n][0] for r in every])
        full = torch.full((-(-p.ds_numel // BLOCK),), -1.0, device="cpu")
        for r in every:
            _, first, scales = r[n]
            held = full[first:first + scales.numel()]
            disagree += int(((held >= 0) & (held != scales)).sum())
            full[first:first + scales.numel()] = scales
        s[n] = full
    return q, s, disagree


def module_gathered(module, world: int, rank: int, block: int = BLOCK) -> tuple[dict, dict]:
    """Collective: every 8-bit parameter of an engine's `module` (its ZeRO-3 shards on `world`
    ranks, this one `rank`), its full integers and scales by name, on the host (a block cut by a
    shard boundary: its first holder's scale, which every holder shares)."""
    mine = {}
    for name, p in module.named_parameters():
        int8 = ds_compat.int8_shard(p)
        if int8 is None:
            continue
        geo = ShardGeometry(ds_compat.full_numel(p), world, rank)
        first, n = quant8.piece_span(geo.start, geo.local, block)
        mine[name] = (int8[0][:geo.local].cpu().clone(), first, int8[1][:n].cpu().clone())
    every = [None] * world
    torch.distributed.all_gather_object(every, mine)
    q, s = {}, {}
    for name in mine:
        q[name] = torch.cat([r[name][0] for r in every])
        blocks = {}
        for r in every:
            _, first, scales = r[name]
            for i, v in enumerate(scales.tolist()):
                blocks.setdefault(first + i, v)
        s[name] = torch.tensor([blocks[k] for k in sorted(blocks)], dtype=torch.float32, device="cpu")
    return q, s


def fetched_weights(engine, batch) -> dict[str, torch.Tensor]:
    """Every parameter as the forward's fetch leaves it (a forward pre-hook registered after
    DeepSpeed's, which gathers first), on the device the fetch left it."""
    seen, handles = {}, []
    names = {id(p): n for n, p in engine.module.named_parameters()}

    def hook(mod, _args):
        for p in mod.parameters(recurse=False):
            seen.setdefault(names[id(p)], p.data.detach().clone())

    for m in engine.module.modules():
        handles.append(m.register_forward_pre_hook(hook))
    with torch.no_grad():
        engine.eval_forward(batch)
    for h in handles:
        h.remove()
    return seen


def mismatches(ref: Reference, q: dict, s: dict) -> dict:
    rel = [((s[n] - ref.s[n]).abs() / ref.s[n].clamp_min(1e-30)).max().item() for n in ref.names]
    return {"ints": sum(int((q[n] != ref.q[n]).sum()) for n in ref.names),
            "scales": sum(int((s[n] != ref.s[n]).sum()) for n in ref.names), "scale_rel": max(rel),
            "elements": sum(ref.q[n].numel() for n in ref.names)}


def train_against_reference(rule: str = "sgd", steps: int = 3, int8_class=Int8Shards) -> dict:
    """The oracle: every step, the sharded 8-bit run's integers and scales against the reference's."""
    group = torch.distributed.group.WORLD
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    ref = Reference(rule)
    model = shards(ref, group, world, rank)
    up = updater(model, rule, int8_class)
    per_step, rescaled = [], 0
    for step in range(1, steps + 1):
        grads = ref.gradients(step)
        sharded_step(up, model, grads, step)
        ref.step(step)
        q, s, disagree = gathered(model, group)
        per_step.append({**mismatches(ref, q, s), "cut_scales_disagree": disagree})
        rescaled += up.shard.take_rescaled()
    total = torch.tensor([rescaled], dtype=torch.int64)
    torch.distributed.all_reduce(total)
    cut = sum(len(cut_blocks(p.ds_numel, world, BLOCK)) for _, p in model.params)
    moved = mismatches(Reference(rule), ref.q, ref.s)["ints"]
    return {"steps": per_step, "cut_blocks": cut, "rescaled": int(total), "reference_rescaled": ref.rescaled,
            "moved_ints": moved}


class PerRankNoise(Int8Shards):
    """The control: noise seeded per rank, as the bf16 path's is."""

    def key(self, param):
        rank = torch.distributed.get_rank()
        return ((SEED * 1_000_003 + self.step) * 4099 + rank, self.step, 0)


class PerPieceScales(Int8Shards):
    """The control: each rank's piece of a cut block scaled by its own maximum alone."""

    def _settle_group(self, group, blocks):
        super()._settle_group(None, blocks)
