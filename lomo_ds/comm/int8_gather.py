"""8-bit weight shards (memory.int8_shards) on ZeRO-3: their conversion after the weights are
loaded, and the parameter gather that moves them in 8 bits.

Format (lomo_ds/runtime/quant8.py): a parameter's flat index is cut into blocks of B elements, one
fp32 absmax scale each. A rank's shard is the padded slice [r * part, (r + 1) * part) (part =
ceil(n / N), DeepSpeed's), stored as int8 with the scales of every block the slice touches. Where a
rank boundary cuts a block, the ranks holding its pieces keep ONE scale for it, the block's (its
absmax over every piece): so every rank count stores, and rounds, every element alike.

Conversion (`convert_to_int8`). Round to nearest at scale = block absmax / 127. The block maxima
of cut blocks come from one all-reduce MAX per process group of a small table: each rank's first
and last pieces' maxima, for every parameter (2 N values a parameter), from which each rank reads
the maxima of the blocks it shares. Persistent parameters (under
stage3_param_persistence_threshold: norms, biases) stay whole, in the compute dtype.

Gather (`gather_int8`). Every rank contributes its int8 shard and its scales, padded to the most
pieces any rank's slice has, to two all-gathers per group of parameters (int8, then fp32), through
deepspeed.comm: between CPU ranks of one node the shared-memory route of comm.param_gather carries
them, and count_comm counts them. Each rank's part is then dequantized on the global grid into the
compute dtype, INT8_DEQUANTIZE_CHUNK elements at a time. About 1 + 4 / B bytes an element against
bf16's 2 (0.52x at B = 128). lomo_ds takes every 8-bit gather on every device, not DeepSpeed's
quantized partition path: that path dequantizes equal groups of gathered_numel / scales_numel
elements, which are the global grid's blocks only where B divides part, and its coalesced form
casts the result to the partition's dtype, int8 (ds_compat.route_int8_gathers).

Writes of a whole modified weight into a partition (GatheredParameters(modifier_rank=...), how
from_pretrained loads under zero.Init) are requantized from the full weight, which every rank then
holds (`rewrite_from_full`): the same integers and scales as the conversion.
"""
from __future__ import annotations

import torch

from lomo_ds.config.engine_sections import INT8_DEQUANTIZE_CHUNK
from lomo_ds.runtime import ds_compat, quant8
from lomo_ds.runtime.device import accelerator_device, group_device


def scale_slots(part: int, world: int, block: int) -> int:
    """Scales per rank in a gather: the most pieces any rank's padded slice touches."""
    return max(quant8.piece_span(r * part, part, block)[1] for r in range(world))


def convert_to_int8(params: list, block: int, dtype: torch.dtype) -> list:
    """Convert the shard of every parameter of `params` (the same list, in the same order, on every
    rank of their groups) that is not persistent to 8 bits; returns those converted. Collective."""
    block = quant8.check_block(block)
    chosen = [p for p in params if ds_compat.is_zero_param(p) and not ds_compat.is_persistent(p)
              and ds_compat.int8_shard(p) is None]
    by_group: dict[int, tuple[object, list]] = {}
    for p in chosen:
        group = ds_compat.process_group(p)
        by_group.setdefault(id(group), (group, []))[1].append(p)
    for group, members in by_group.values():
        _convert_group(group, members, block)
    ds_compat.install_torch_quantizer(block, dtype)
    return chosen


def _convert_group(group, params: list, block: int) -> None:
    local = []  # (param, start, part, real elements here, rank, world, scales of its own real pieces)
    for p in params:
        start, part, rank, world = ds_compat.partition_slice(p)
        real = max(0, min(part, ds_compat.full_numel(p) - start))
        # ZeRO-3's padding past the weight's end is uninitialised memory: never part of a block.
        _, scales = quant8.quantize(ds_compat.shard(p).reshape(-1)[:real], start, block=block)
        local.append((p, start, part, real, rank, world, scales))
    world = local[0][5]
    ends = torch.zeros(len(params), world, 2, dtype=torch.float32, device=group_device(group))
    for i, (_, _, _, _, rank, _, scales) in enumerate(local):
        if scales.numel():
            ends[i, rank, 0], ends[i, rank, 1] = scales[0], scales[-1]
    if world > 1:
        ds_compat.all_reduce(ends, group=group, name="8-bit conversion's cut-block maxima", op="max")
    ends = ends.cpu()
    for i, (p, start, part, real, _rank, world, scales) in enumerate(local):
        shared = _shared_scales(ends[i], ds_compat.full_numel(p), start, part, world, block, scales)
        x = ds_compat.shard(p).reshape(-1)
        q = torch.zeros(part, dtype=torch.int8, device=x.device)
        if real:
            q[:real], _ = quant8.quantize(x[:real], start, block=block, scales=shared[:scales.numel()].to(x.device))
        ds_compat.set_int8_shard(p, q, shared.to(x.device), block)


def _real(numel: int, start: int, part: int) -> int:
    return max(0, min(part, numel - start))


def _shared_scales(ends: torch.Tensor, numel: int, start: int, part: int, world: int, block: int,
                   scales: torch.Tensor) -> torch.Tensor:
    """This rank's scales, one per block its padded slice touches (0 past the weight's end), with
    its first and last real pieces' replaced by their block's over every rank that holds a piece
    of it (`ends`: [world, 2], each rank's first and last real pieces' scales)."""
    _, slots = quant8.piece_span(start, part, block)
    # Host-side, once at conversion (its caller moves the result to the shard's device).
    out = torch.zeros(slots, dtype=torch.float32, device="cpu")
    out[:scales.numel()] = scales.detach().cpu()
    first, n = quant8.piece_span(start, _real(numel, start, part), block)
    for index in {0, n - 1} if n else ():
        k = first + index
        peak = out[index].clone()
        for r in range(world):
            rf, rn = quant8.piece_span(r * part, _real(numel, r * part, part), block)
            if rn and rf == k:
                peak = torch.maximum(peak, ends[r, 0])
            if rn and rf + rn - 1 == k:
                peak = torch.maximum(peak, ends[r, 1])
        out[index] = peak
    return out


class Int8Gather:
    """The handle of one 8-bit gather of `params` (one process group): the collectives start at
    construction, `wait()` dequantizes every parameter into the compute dtype."""

    def __init__(self, params: list) -> None:
        self.params = sorted(params, key=ds_compat.param_id)  # the same order on every rank
        self.done = False
        p0 = self.params[0]
        self.group = ds_compat.process_group(p0)
        _, _, self.rank, self.world = ds_compat.partition_slice(p0)
        self.layout = []  # per parameter: (part, its int8 offset, its scale offset, slots, block)
        q_off = s_off = 0
        for p in self.params:
            _, part, _, _ = ds_compat.partition_slice(p)
            block = ds_compat.int8_block(p)
            slots = scale_slots(part, self.world, block)
            self.layout.append((part, q_off, s_off, slots, block))
            q_off, s_off = q_off + part, s_off + slots
        self.q_width, self.s_width = q_off, s_off
        self.device = accelerator_device()
        self._start()

    def _start(self) -> None:
        comm = group_device(self.group) if self.world > 1 else self.device
        send_q = torch.empty(self.q_width, dtype=torch.int8, device=comm)
        send_s = torch.zeros(self.s_width, dtype=torch.float32, device=comm)
        for p, (part, qo, so, _, _) in zip(self.params, self.layout, strict=True):
            q, s = ds_compat.int8_shard(p)
            send_q[qo:qo + part].copy_(q.reshape(-1))
            send_s[so:so + s.numel()].copy_(s)
        if self.world == 1:
            self.recv_q, self.recv_s, self.handles = send_q, send_s, []
            return
        self.recv_q = torch.empty(self.world * self.q_width, dtype=torch.int8, device=comm)
        self.recv_s = torch.empty(self.world * self.s_width, dtype=torch.float32, device=comm)
        self.handles = [
            ds_compat.all_gather_into_tensor(self.recv_q, send_q, self.group, async_op=True, name="8-bit shards"),
            ds_compat.all_gather_into_tensor(self.recv_s, send_s, self.group, async_op=True, name="8-bit scales")]

    def wait(self, *_args, **_kwargs) -> None:
        if self.done:
            return
        for h in self.handles:
            if h is not None:
                h.wait()
        recv_q, recv_s = self.recv_q.to(self.device), self.recv_s.to(self.device)
        for p, lay in zip(self.params, self.layout, strict=True):
            ds_compat.gathered_into(p, self._dequantized(p, recv_q, recv_s, *lay))
        self.done = True

    def _dequantized(self, p, recv_q, recv_s, part: int, qo: int, so: int, _slots: int,
                     block: int) -> torch.Tensor:
        n = ds_compat.full_numel(p)
        out = torch.empty(n, dtype=p.dtype, device=self.device)
        for r in range(self.world):
            start = r * part
            local = max(0, min(part, n - start))
            if local == 0:
                continue
            q = recv_q[r * self.q_width + qo: r * self.q_width + qo + local]
            s = recv_s[r * self.s_width + so: r * self.s_width + so + quant8.piece_span(start, local, block)[1]]
            # A chunk of whole pieces at a time: the fp32 transient is a chunk's, not the part's.
            for a, b in quant8.block_chunks(start, local, INT8_DEQUANTIZE_CHUNK, block=block):
                pa, pb = quant8.chunk_pieces(start, a, b, block)
                out[start + a:start + b] = quant8.dequantize(q[a:b], s[pa:pb], start + a, block=block, dtype=p.dtype)
        return out


def gather_int8(params: list) -> Int8Gather | ds_compat.GatherHandles:
    """Start the gather of 8-bit parameters (one handle per process group)."""
    by_group: dict[int, list] = {}
    for p in params:
        by_group.setdefault(id(ds_compat.process_group(p)), []).append(p)
    handles = [Int8Gather(members) for members in by_group.values()]
    return handles[0] if len(handles) == 1 else ds_compat.GatherHandles(handles)  # none: a handle with nothing to wait


def rewrite_from_full(p) -> None:
    """The full weight p.data (compute dtype, the same on every rank of its group) written back into
    the parameter's 8-bit shard: the conversion's integers and scales, from the whole weight."""
    block = ds_compat.int8_block(p)
    start, part, _, _ = ds_compat.partition_slice(p)
    full = p.data.reshape(-1)
    n = full.numel()
    first, pieces = quant8.piece_span(start, part, block)
    blocks = max(first + pieces, -(-n // block))  # the slice's blocks, or the weight's, whichever reach further
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=full.device)
    padded[:n] = full.to(torch.float32)
    xb = padded.view(-1, block)[first:first + pieces]
    scales = xb.abs().amax(dim=1) / quant8.QMAX
    q, _ = quant8.quantize(padded[start:start + part], start, block=block, scales=scales)
    shard, _ = ds_compat.int8_shard(p)
    ds_compat.set_int8_shard(p, q.to(shard.device), scales.to(shard.device), block)


def install_int8_shards(module: torch.nn.Module, params: list, block: int, dtype: torch.dtype) -> list:
    """memory.int8_shards on a ZeRO-3 module whose weights are loaded: convert `params`' shards
    (the trainable ones; persistent ones stay in `dtype`) and route every gather of the module's
    8-bit parameters through `gather_int8`. Collective. Returns the converted parameters."""
    converted = convert_to_int8(params, block, dtype)
    ds_compat.route_int8_gathers(list(module.parameters()), gather_int8, rewrite_from_full)
    return converted
