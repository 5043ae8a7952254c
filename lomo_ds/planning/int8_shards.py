"""The planner's terms for 8-bit weight shards (memory.int8_shards, memory.int8_block; the format
and its update: lomo_ds/runtime/quant8.py; the figures: docs/memory.md "8-bit weight shards").

Each rank keeps its ZeRO-3 shard of every non-persistent parameter as int8, one byte an element,
with one fp32 scale per piece: a piece is the shard's part of a block [kB, (k+1)B) of the
parameter's global flat index, so a shard of `part` elements holds ceil(part / B) pieces, one more
where a shard boundary cuts a block (each rank keeps a scale for its own piece of it). What does
not shrink:
    - persistent parameters (stage3_param_persistence_threshold: norms, biases) stay whole on
      every rank in the compute dtype, beside their compute-dtype shard;
    - the gathered layers are dequantized to full size in the compute dtype, on one GPU too (the
      shard is no longer the parameter): the working set W costs what it costs in bf16, so the
      peak does not halve;
    - the gather moves the 8-bit shards and their scales, then dequantizes each rank's part of
      each parameter through fp32, a chunk of INT8_DEQUANTIZE_CHUNK elements at a time;
    - the update reads each chunk of a slice into fp32, applies the rule and requantizes it with
      keyed stochastic rounding: more temporaries a chunk than bf16's rounding.
There are no fp32 master weights (4 bytes a parameter would undo the point; refused), and the
gradients are the compute dtype's, as in bf16.

Planning sits beside lomo_ds.runtime (neither imports the other), so the piece count is
written here; tests/planning/test_int8_planner.py checks it against quant8.piece_span.
"""
from __future__ import annotations

import math

from lomo_ds.config.engine_sections import INT8_DEQUANTIZE_CHUNK
from lomo_ds.planning.fetch_units import largest_fetch_unit, working_set
from lomo_ds.planning.specs import ModelSpec, RunSpec

QUANT_BYTES = 1  # an int8 element
SCALE_BYTES = 4  # an fp32 scale, one per piece


def check_int8(run: RunSpec) -> None:
    """Refuse what 8-bit shards cannot be planned with, naming the field (ValueError)."""
    if not run.int8_shards:
        return
    block = run.int8_block
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0 or block % 8:
        raise ValueError(f"int8_block: expected a positive multiple of 8 (elements per fp32 scale), got {block!r}")
    if run.lomo_fp32_master:
        raise ValueError("lomo_fp32_master: fp32 master weights (4 bytes a parameter) with int8_shards undo what "
                         "8-bit shards save; turn one of them off")
    if run.dtype == "fp16":
        raise ValueError("dtype: int8_shards dequantize to bf16 or fp32, not fp16")


def rank_pieces(numel: int, ranks: int, block: int) -> int:
    """The most pieces (scales) any of `ranks` ranks keeps of a parameter of `numel` elements: rank
    r's padded slice [r part, (r + 1) part), part = ceil(numel / ranks) (ZeRO-3 pads the last
    rank's), has a scale for every block it overlaps (ds_compat.set_int8_shard)."""
    part = math.ceil(numel / ranks)
    return max((r * part + part - 1) // block - r * part // block + 1 for r in range(ranks))


def shard_bytes(m: ModelSpec, run: RunSpec, n: int) -> tuple[int, int]:
    """(int8 bytes, fp32 scale bytes) of one rank's shards of the non-persistent parameters on n
    ranks, a parameter of x elements at most: its pieces (rank_pieces: ceil(x / n) / B, one more
    at each end where a shard boundary cuts a block) in whole blocks, B bytes each (the shard of
    ceil(x / n) elements is a view of the blocks quant8.quantize rounds, so its storage is theirs,
    at most 2 (B - 1) bytes more), and 4 bytes of scale a piece."""
    block = run.int8_block
    pieces = [rank_pieces(x, n, block) for x in m.param_numels() if x > run.persistence]
    return QUANT_BYTES * block * sum(pieces), SCALE_BYTES * sum(pieces)


def persistent_bytes(m: ModelSpec, run: RunSpec, n: int) -> int:
    """Persistent parameters in the compute dtype: whole on every rank, and on n > 1 their shards
    besides (ZeRO-3 keeps both; on one rank the shard is the parameter; with offload_param the
    shards are in host RAM, host_shard_bytes)."""
    small = [x for x in m.param_numels() if x <= run.persistence]
    shards = run.b * sum(math.ceil(x / n) for x in small) if n > 1 and not run.offload else 0
    return run.b * sum(small) + shards


def gathered_layer_bytes(m: ModelSpec, run: RunSpec) -> int:
    """The working set W dequantized in the compute dtype, on any rank count: what DeepSpeed keeps
    gathered (stage3_max_live_parameters, the largest fetch unit and the prefetch bucket), as in
    bf16. The prefetched units hold their 8-bit buffers until dequantized: fewer bytes than W counts
    for them."""
    return run.b * working_set(m, run)[1]


def gather_buffer_bytes(m: ModelSpec, run: RunSpec, n: int) -> int:
    """The 8-bit gather of the largest fetch unit U (lomo_ds's own, comm/int8_gather.py, on every
    device): the rank's shards of the unit copied into one send buffer (ceil(U / n) bytes), and on
    n > 1 ranks the all-gather's int8 output (n of those), with the scales of both (a piece a
    block, one more at each cut, per rank), held until every parameter of the unit is dequantized
    (an accelerator's asynchronous all-gather may hold its input that long; between CPU ranks the
    shared-memory route has let it go by then: tests/planning/test_int8_memory.py)."""
    part = math.ceil(largest_fetch_unit(m, run)[1] / n)
    pieces = math.ceil(part / run.int8_block) + 1
    copies = 1 if n == 1 else n + 1
    return copies * (QUANT_BYTES * part + SCALE_BYTES * pieces)


def dequantize_bytes(m: ModelSpec, run: RunSpec, n: int) -> int:
    """The dequantization's transient: each rank's part of a parameter, ceil(x / n) elements, is
    read into fp32 (4 bytes an element) and cast to the compute dtype (b) a chunk of whole pieces
    at a time (INT8_DEQUANTIZE_CHUNK elements, quant8.block_chunks) before it is copied into the
    gathered parameter (in W); a chunk that does not lie on whole blocks is first padded to them
    (an int8 copy of its pieces' blocks, read into fp32 whole). The largest parameter's largest
    chunk, one at a time."""
    big = [x for x in m.param_numels() if x > run.persistence]
    if not big:
        return 0
    x = max(big)
    part, block = math.ceil(x / n), run.int8_block
    chunk = min(part, max(block, INT8_DEQUANTIZE_CHUNK // block * block))
    if part % block == 0 and x % block == 0:
        return (4 + run.b) * chunk
    # a chunk that starts inside a block covers at most one piece more than its own length in blocks
    blocks = block * min(rank_pieces(x, n, block), math.ceil(chunk / block) + 1)
    return (QUANT_BYTES + 4) * blocks + run.b * chunk


def update_chunk(n: int, run: RunSpec) -> int:
    """Elements of one update chunk of an n-element slice: memory.update_chunk_elements rounded
    down to whole blocks (at least one), so that each chunk holds whole pieces
    (quant8.block_chunks); a chunk is never more than the slice."""
    block = run.int8_block
    return min(n, max(block, run.update_chunk // block * block))


def update_temp_bytes(n: int, run: RunSpec) -> int:
    """The fused update's transient bytes on an n-element slice of 8-bit shards, a chunk c at a
    time (update_chunk), at their peak in the requantize's rounding: the chunk's fp32 gradient
    (4 c) and dequantized fp32 weights (4 c), alive until the chunk is written back, w / s (4 c)
    and the keyed noise (its fp32 u, 4 c, and the two int32 words the hash works in, 8 c): 24 bytes
    an element, where bf16's stochastic rounding takes 21 (the int8 result, c, comes once the
    noise is freed). Beside them, per block of the chunk, its absolute maximum, its new scale and
    the divisor the rounding uses (fp32 each) and whether it grew: 13 bytes a block."""
    c = update_chunk(n, run)
    return 24 * c + 13 * math.ceil(c / run.int8_block)


def int8_terms(m: ModelSpec, run: RunSpec, n: int) -> dict[str, int]:
    """Each 8-bit term in bytes per GPU on n ranks (offload_param: the shards and scales are in host
    RAM instead, per rank), by name: what the planner's report prints."""
    q, s = shard_bytes(m, run, n)
    return {"8-bit shards": q, "scales (fp32, one a block)": s,
            "persistent parameters (compute dtype)": persistent_bytes(m, run, n),
            "gathered layers (dequantized, compute dtype)": gathered_layer_bytes(m, run),
            "gather in flight (8-bit buffers and scales)": gather_buffer_bytes(m, run, n),
            "dequantize (a part in fp32 and its cast)": dequantize_bytes(m, run, n)}


def param_bytes(m: ModelSpec, run: RunSpec, n: int) -> tuple[int, int]:
    """(shard bytes, gathered bytes) of the parameters on a GPU with 8-bit shards, the planner's
    `params` being their sum: the 8-bit shards and scales (0 on the GPU with offload_param), and the
    persistent parameters, the dequantized working set and the gather's transients."""
    t = int8_terms(m, run, n)
    shard = 0 if run.offload else t["8-bit shards"] + t["scales (fp32, one a block)"]
    return shard, sum(t.values()) - t["8-bit shards"] - t["scales (fp32, one a block)"]


def host_shard_bytes(m: ModelSpec, run: RunSpec, n: int) -> int:
    """One rank's shards in host RAM with offload_param: the 8-bit shards and their scales, and the
    persistent parameters' compute-dtype shards."""
    q, s = shard_bytes(m, run, n)
    return q + s + run.b * sum(math.ceil(x / n) for x in m.param_numels() if x <= run.persistence)
