"""8-bit weight shards in the fused update (memory.int8_shards): the rules read a chunk of the shard
dequantized to fp32 and write it back requantized, in runtime/quant8.py's format (int8 blocks of
memory.int8_block elements on the parameter's global flat index, one fp32 scale each).

Noise. The stochastic rounding floor(w/s + u) draws u keyed by (train.seed, the optimizer step, the
parameter's index in module.named_parameters(), the element's global index): the same on every rank
count and in a one-process reference, whatever the chunks (an index by name, not DeepSpeed's ds_id,
which need not agree between runs).

Cut blocks. A ZeRO-3 shard boundary may cut a block; the ranks holding its pieces keep ONE scale for
it, the same on each, so that it is the scale a one-process run gives the block. Requantizing such a
piece needs the block's absolute maximum over all its pieces (the scale rule recomputes the scale only
where that maximum exceeds 127 s): write_back defers a cut piece (its fp32 values, at most B - 1
elements at each end of the slice) and `settle` finishes them once per bucket with one small
all-reduce MAX over the bucket's cut blocks' piece maxima. Every rank then applies the same rule to
the same maximum and rounds each element with the same noise: a block is quantized exactly as the
reference quantizes it, cut or whole, and the stored integers and scales do not depend on the rank
count. Which blocks are cut follows from the geometry alone, so every rank builds the same vector.

Chunks written back must hold whole pieces (their ends on the global block grid: `chunks`), so that a
piece's maximum is taken over all of its elements at once.

The count of recomputed scales (`take_rescaled`) counts each block once: a cut block on the rank that
holds its first element.

A bucket the step skips (a non-finite gradient) is written back unchanged, and so re-rounded: w = q s
read in fp32 and divided by s again is q only to within an fp32 ulp of q, so an element moves by one
step with a chance of about 2^-17 (up or down alike), as in the one-process reference.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lomo_ds.runtime import ds_compat, quant8
from lomo_ds.runtime.device import group_device


def int8_shard(param) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(int8 shard, fp32 scales) of a parameter kept in 8 bits, else None (ds_compat's reading of
    DeepSpeed's quantized-partition attributes)."""
    return ds_compat.int8_shard(param)


def cut_blocks(numel: int, world: int, block: int) -> list[int]:
    """Blocks of a parameter of `numel` elements that a ZeRO-3 cut over `world` ranks splits between
    ranks (a rank boundary strictly inside the block), ascending."""
    part = -(-numel // world)
    return sorted({r * part // block for r in range(1, world) if r * part < numel and (r * part) % block})


@dataclass
class _Pending:
    """A cut piece written back and not yet requantized: its fp32 values and where they go."""

    param: torch.nn.Parameter
    piece: int  # its index among the slice's pieces (its scale's index)
    first: int  # its first element in the slice
    values: torch.Tensor  # fp32, the piece's elements


class Int8Shards:
    """The 8-bit path of ShardWeights: reads, deferred writes of cut pieces, and their settling."""

    def __init__(self, geometry, block: int, seed: int, noise_ids: dict[int, int], headroom: float = 0.0):
        self.geometry = geometry
        self.block = quant8.check_block(block)
        self.seed = seed
        self.noise_ids = noise_ids  # ds_id -> index in module.named_parameters()
        self.headroom = headroom
        self.step = 0
        self.pending: dict[tuple[int, int], _Pending] = {}  # (ds_id, global block) -> piece
        self._rescaled: dict[torch.device, torch.Tensor] = {}

    def key(self, param) -> tuple[int, int, int]:
        pid = ds_compat.param_id(param)
        if pid not in self.noise_ids:
            raise KeyError(f"8-bit shards: parameter ds_id {pid} has no noise index (not among the module's "
                           "named parameters the updater was built with)")
        return (self.seed, self.step, self.noise_ids[pid])

    def _pieces(self, param) -> tuple[torch.Tensor, torch.Tensor, int, int, int]:
        """(int8 shard, scales of the real slice's pieces, slice start, real elements, first block)."""
        q, scales = int8_shard(param)
        geo = self.geometry(param)
        first, n = quant8.piece_span(geo.start, geo.local, self.block)
        return q, scales[:n], geo.start, geo.local, first

    def _cut_here(self, param) -> set[int]:
        geo = self.geometry(param)
        return set(cut_blocks(geo.numel, geo.world, self.block))

    # ----------------------------------------------------------------- chunks, reads, writes
    def chunks(self, param, size: int, align: int = 1) -> list[tuple[int, int]]:
        geo = self.geometry(param)
        return quant8.block_chunks(geo.start, geo.local, size, block=self.block, align=align)

    def weights(self, param, a: int, b: int) -> torch.Tensor:
        q, scales, start, _, _ = self._pieces(param)
        pa, pb = quant8.chunk_pieces(start, a, b, self.block)
        return quant8.dequantize(q[a:b], scales[pa:pb], start + a, block=self.block)

    def write_back(self, param, weights: torch.Tensor, a: int, b: int) -> None:
        """Requantize chunk [a, b) (whole pieces: `chunks`) from its updated fp32 weights; its cut
        pieces wait for `settle`."""
        q, scales, start, local, first = self._pieces(param)
        for end, edge in ((a, 0), (b, local)):
            if end != edge and (start + end) % self.block:
                raise ValueError(f"8-bit shards: a chunk [{a}, {b}) of a slice at {start} ends off the block grid "
                                 f"(blocks of {self.block}): take chunks from ShardWeights.chunks")
        pa, pb = quant8.chunk_pieces(start, a, b, self.block)
        cut = self._cut_here(param)
        lo, hi = a, b  # the elements of the chunk's whole pieces
        # Only a slice's first and last pieces can be cut: no loop over a chunk's blocks on the host.
        for p in sorted(p for p in {0, scales.numel() - 1} if pa <= p < pb):
            k = first + p
            if k not in cut:
                continue
            ea, eb = max(k * self.block - start, 0), min((k + 1) * self.block - start, local)
            self.pending[(ds_compat.param_id(param), k)] = _Pending(
                param, p, ea, weights[ea - a:eb - a].to(torch.float32, copy=True))
            if ea <= lo:
                lo = max(lo, eb)
            else:
                hi = min(hi, ea)
        if hi <= lo:
            return
        pl, ph = quant8.chunk_pieces(start, lo, hi, self.block)
        new_q, new_s, grown = quant8.requantize(weights[lo - a:hi - a], scales[pl:ph], start + lo, self.key(param),
                                                block=self.block, headroom=self.headroom)
        q[lo:hi].copy_(new_q)
        scales[pl:ph].copy_(new_s)
        self._count(grown)

    def _count(self, grown: torch.Tensor) -> None:
        total = self._rescaled.get(grown.device)
        if total is None:
            self._rescaled[grown.device] = grown.to(torch.int64).clone()
        else:
            total.add_(grown)

    def take_rescaled(self) -> int:
        """Blocks whose scale was recomputed since the last call (a host read)."""
        n = sum(int(t.item()) for t in self._rescaled.values())
        self._rescaled.clear()
        return n

    # ----------------------------------------------------------------- cut blocks
    def settle(self, params: list) -> None:
        """Requantize the cut pieces of `params` (a bucket's, the same list on every rank of their
        group): one all-reduce MAX of their blocks' piece maxima per process group, then the scale
        rule and the keyed rounding on each piece. Collective wherever the list has a cut block."""
        by_group: dict[object, list[tuple[torch.nn.Parameter, int]]] = {}
        for p in params:
            if int8_shard(p) is None:
                continue
            for k in cut_blocks(ds_compat.full_numel(p), self.geometry(p).world, self.block):
                group = ds_compat.process_group(p) if torch.distributed.is_initialized() else None
                by_group.setdefault(group, []).append((p, k))
        for group, blocks in by_group.items():
            self._settle_group(group, blocks)

    def _settle_group(self, group, blocks: list) -> None:
        device = group_device(group) if group is not None else torch.device("cpu")
        mine = [self.pending.pop((ds_compat.param_id(p), k), None) for p, k in blocks]
        peaks = torch.zeros(len(blocks), dtype=torch.float32, device=device)
        for i, piece in enumerate(mine):
            if piece is not None and piece.values.numel():
                peaks[i] = piece.values.abs().amax().to(device)
        if group is not None and torch.distributed.get_world_size(group) > 1:
            ds_compat.all_reduce(peaks, group=group, name="8-bit cut blocks' maxima", op="max")
        for (param, k), piece, peak in zip(blocks, mine, peaks, strict=True):
            if piece is not None:
                self._requantize_piece(param, k, piece, peak)

    def _requantize_piece(self, param, k: int, piece: _Pending, peak: torch.Tensor) -> None:
        q, scales, start, _, _ = self._pieces(param)
        s = scales[piece.piece:piece.piece + 1]
        peak = peak.to(s.device)
        grown = peak > s * quant8.QMAX
        # The same arithmetic as quant8.requantize's on a whole block (a one-process reference).
        new_s = torch.where(grown, peak / (quant8.QMAX / (1.0 + self.headroom)), s)
        n = piece.values.numel()
        new_q, _ = quant8.quantize(piece.values, start + piece.first, block=self.block, scales=new_s,
                                   key=self.key(param))
        q[piece.first:piece.first + n].copy_(new_q)
        s.copy_(new_s)
        if k * self.block >= start:  # this rank holds the block's first element: it counts it
            self._count(grown.sum())

    def check_settled(self) -> None:
        if self.pending:
            names = sorted({f"ds_id {pid} block {k}" for pid, k in self.pending})[:3]
            raise RuntimeError(f"8-bit shards: cut pieces written back and never settled ({names}): every "
                               "bucket's update must end in ShardWeights.settle")

    def write_full(self, param, full: torch.Tensor) -> None:
        """This rank's slice of the whole parameter's values `full` (flat, the same on every rank:
        LoRA's fp32 adapter masters) rounded to nearest into the 8-bit shard, each block's scale its
        absmax over `full`: a cut block gets one scale on every rank with no collective."""
        q, scales, start, local, first = self._pieces(param)
        if not local:
            return
        lo, hi = first * self.block, min((first + scales.numel()) * self.block, full.numel())
        block_q, block_s = quant8.quantize(full[lo:hi].to(q.device, torch.float32), lo, block=self.block)
        q[:local].copy_(block_q[start - lo:start - lo + local])
        scales.copy_(block_s)
        self.pending = {k: v for k, v in self.pending.items() if k[0] != ds_compat.param_id(param)}

    # ----------------------------------------------------------------- checkpoints
    def global_scales(self, param) -> torch.Tensor:
        """The parameter's scales on the global grid (one a block), on the host: every rank's pieces
        put together by an all-reduce MAX over its group (a cut block's pieces agree). Collective."""
        _, scales, _, _, first = self._pieces(param)
        geo = self.geometry(param)
        group = ds_compat.process_group(param) if torch.distributed.is_initialized() else None
        device = group_device(group) if group is not None else scales.device
        out = torch.zeros(-(-geo.numel // self.block), dtype=torch.float32, device=device)
        out[first:first + scales.numel()] = scales.to(device)
        if group is not None and torch.distributed.get_world_size(group) > 1:
            ds_compat.all_reduce(out, group=group, name="8-bit scales for a checkpoint", op="max")
        return out.cpu()

    def check_scales(self, param, name: str, scales) -> None:
        blocks = -(-ds_compat.full_numel(param) // self.block)
        if not torch.is_tensor(scales) or scales.shape != (blocks,) or scales.dtype != torch.float32:
            got = f"{scales.dtype} of shape {tuple(scales.shape)}" if torch.is_tensor(scales) else type(scales).__name__
            raise ValueError(f"memory.int8_block: the checkpoint's scales of {name!r} are {got}, this run keeps "
                             f"{blocks} fp32 scales (blocks of {self.block}): resume with the block size it was "
                             "written with")

    def load_scales(self, param, scales: torch.Tensor) -> None:
        """This rank's pieces' scales from the global grid's (the integers are read as saved: a
        block's scale is one whatever the rank count, so they need no re-rounding)."""
        _, mine, _, _, first = self._pieces(param)
        mine.copy_(scales[first:first + mine.numel()])
        self.pending = {k: v for k, v in self.pending.items() if k[0] != ds_compat.param_id(param)}
