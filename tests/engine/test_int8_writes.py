"""Every direct write of an 8-bit shard goes through the 8-bit path (lomo_ds/engine/update/int8.py),
on ranks simulated in one process (each rank's ShardGeometry of a 3-way cut, blocks of 16):

- LoRA's adapter write (ShardWeights.write_full): each rank's integers and scales are the whole
  parameter's quantization on the global grid, a cut block's scale the same on every rank holding it;
- GRPO's swap of the starting weights (StartingWeights) swaps an 8-bit shard's scales with its
  integers, and puts both back;
- checkpoint refusals: an 8-bit checkpoint into a run without 8-bit shards, the reverse, and scales
  of another block size, each refused naming the setting;
- reads: a chunk's weights are its blocks dequantized, chunks lie on the global block grid.
"""
from __future__ import annotations

import types

import pytest
import torch

from lomo_ds.engine.update import ShardWeights
from lomo_ds.engine.update.int8 import Int8Shards, cut_blocks
from lomo_ds.runtime import quant8
from lomo_ds.runtime.shard_geometry import ShardGeometry
from tests.engine.int8_checks import BLOCK, Int8Param

NUMEL, WORLD = 203, 3  # part 68: every rank boundary cuts a block of 16


def _param(rank: int, full: torch.Tensor, ds_id: int = 1) -> Int8Param:
    q, s = quant8.quantize(full, 0, block=BLOCK)
    return Int8Param(ds_id, torch.zeros_like(q), torch.zeros_like(s), (NUMEL,), None, WORLD, rank)


def _weights(rank: int, chunk: int = 40) -> ShardWeights:
    geometry = lambda p: ShardGeometry(p.ds_numel, WORLD, rank)  # noqa: E731 - one rank of a simulated cut
    return ShardWeights(geometry, True, 0, chunk=chunk, int8=Int8Shards(geometry, BLOCK, 0, {1: 0}))


def test_adapter_write_quantizes_the_whole_on_the_global_grid():
    full = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0), device="cpu")
    q_ref, s_ref = quant8.quantize(full, 0, block=BLOCK)
    assert cut_blocks(NUMEL, WORLD, BLOCK), "no block is cut: the shared-scale case is not exercised"
    q_all, scales = [], {}
    for rank in range(WORLD):
        p = _param(rank, full)
        _weights(rank).write_full(p, full)
        geo = ShardGeometry(NUMEL, WORLD, rank)
        q_all.append(p.ds_tensor[:geo.local])
        first, n = quant8.piece_span(geo.start, geo.local, BLOCK)
        for i in range(n):
            scales.setdefault(first + i, set()).add(float(p.ds_quant_scale[i]))
    assert torch.equal(torch.cat(q_all), q_ref)
    assert all(len(v) == 1 for v in scales.values()), "a cut block's pieces hold different scales"
    assert [scales[k].pop() for k in sorted(scales)] == s_ref.tolist()


def test_chunks_lie_on_the_global_block_grid_and_read_dequantized():
    full = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1), device="cpu")
    q_ref, s_ref = quant8.quantize(full, 0, block=BLOCK)
    for rank in range(WORLD):
        p, w = _param(rank, full), _weights(rank)
        w.write_full(p, full)
        geo = ShardGeometry(NUMEL, WORLD, rank)
        bounds = w.chunks(p)
        assert bounds[0][0] == 0 and bounds[-1][1] == geo.local
        assert all((geo.start + b) % BLOCK == 0 for _, b in bounds[:-1]), bounds
        read = torch.cat([w.weights(p, a, b) for a, b in bounds])
        expect = quant8.dequantize(q_ref, s_ref, 0, block=BLOCK)[geo.start:geo.start + geo.local]
        assert torch.equal(read, expect)


def test_grpo_swap_carries_the_scales():
    pytest.importorskip("trl")
    from lomo_ds.integrations.grpo import StartingWeights

    full = torch.randn(NUMEL, generator=torch.Generator().manual_seed(2), device="cpu")
    p = _param(1, full)
    w = _weights(1)
    w.write_full(p, full)
    start_q, start_s = p.ds_tensor.clone(), p.ds_quant_scale.clone()
    engine = types.SimpleNamespace(params=[p], release_gathered=lambda: None, shards_written=lambda: None)
    weights = StartingWeights(engine)
    w.write_full(p, 3.0 * full)  # training moved the weights: new integers and scales
    live_q, live_s = p.ds_tensor.clone(), p.ds_quant_scale.clone()
    assert not torch.equal(live_s, start_s)
    with weights.swapped_in():
        assert torch.equal(p.ds_tensor, start_q) and torch.equal(p.ds_quant_scale, start_s)
    assert torch.equal(p.ds_tensor, live_q) and torch.equal(p.ds_quant_scale, live_s)
    assert weights.nbytes() == start_q.numel() + 4 * start_s.numel()


class _Module:
    def __init__(self, params):
        self.params = params

    def named_parameters(self):
        return iter(self.params)


def _state(int8_scales=None) -> dict:
    state = {"shards": {"w": torch.zeros(68, dtype=torch.int8)}, "masters": {}, "shapes": {"w": [NUMEL]}}
    if int8_scales is not None:
        state["int8_scales"] = {"w": int8_scales}
    return state


def test_checkpoint_of_another_int8_setting_is_refused():
    full = torch.randn(NUMEL, generator=torch.Generator().manual_seed(3), device="cpu")
    p = _param(0, full)
    module = _Module([("w", p)])
    w = _weights(0)
    blocks = -(-NUMEL // BLOCK)
    w.check_state(_state(torch.zeros(blocks)), module, [p])  # its own kind: accepted
    with pytest.raises(ValueError, match="memory.int8_shards"):
        w.check_state(_state(), module, [p])
    with pytest.raises(ValueError, match="memory.int8_block"):
        w.check_state(_state(torch.zeros(blocks + 1)), module, [p])
    plain = types.SimpleNamespace(ds_id=1, ds_numel=NUMEL, ds_shape=(NUMEL,), ds_process_group=None,
                                  ds_tensor=torch.zeros(68, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="memory.int8_shards"):
        _weights(0).check_state(_state(torch.zeros(blocks)), _Module([("w", plain)]), [plain])


def test_load_reads_this_ranks_scales_from_the_global_grid():
    full = torch.randn(NUMEL, generator=torch.Generator().manual_seed(4), device="cpu")
    q_ref, s_ref = quant8.quantize(full, 0, block=BLOCK)
    for rank in range(WORLD):
        p = _param(rank, full)
        geo = ShardGeometry(NUMEL, WORLD, rank)
        shard = torch.zeros(geo.part, dtype=torch.int8)
        shard[:geo.local] = q_ref[geo.start:geo.start + geo.local]
        w = _weights(rank)
        w.load_state_dict({"shards": {"w": shard}, "masters": {}, "int8_scales": {"w": s_ref}}, _Module([("w", p)]))
        first, n = quant8.piece_span(geo.start, geo.local, BLOCK)
        assert torch.equal(p.ds_quant_scale[:n], s_ref[first:first + n])
        assert torch.equal(p.ds_tensor[:geo.local], q_ref[geo.start:geo.start + geo.local])


def test_write_back_off_the_block_grid_is_refused():
    full = torch.randn(NUMEL, generator=torch.Generator().manual_seed(5), device="cpu")
    p, w = _param(1, full), _weights(1)
    w.write_full(p, full)
    with pytest.raises(ValueError, match="off the block grid"):
        w.write_back(p, w.weights(p, 0, 10), 0, 10)  # the slice starts at 68: 78 is mid-block
