"""The tiled MLP and the offloaded checkpoints (memory.tiled_mlp, memory.offload_checkpoints;
lomo_ds/engine/sequence_memory.py): the engine's fused update with them equals single-process
torch.optim.SGD on the same global batches, with norm clipping, within fp32 rounding (the same
reference the engine meets without them, tests/engine/test_engine_dist.py), and its loss is the
untiled model's. Multi-rank checks are long checks (CI: LOMO_DS_LONG_TESTS=1)."""
from __future__ import annotations

import pytest
import torch

from tests.engine import dist_engine_checks as E
from tests.ranks import LONG_TESTS, assert_matches_reference, multi_rank_checks, ok
from tests.tiny import VOCAB, global_batch, tiny_llama

TOL = 1e-6  # fp32, 3 steps: the tiles' gradients are summed in another order than one matmul's
WORLDS = [1, 2] if LONG_TESTS else []


def _checkpointed(m):
    m.gradient_checkpointing_enable()


def _long_rows(step: int, world: int) -> list[dict]:
    return global_batch(step, world, seq=90)  # 90 positions, hidden 40: ceil(90 / 40) = 3 tiles by default


def _name(f) -> str | None:
    return None if f is None else getattr(f, "__name__", type(f).__name__)


def _equivalence(cfg, batches=global_batch, prepare=None):
    import lomo_ds
    from lomo_ds.engine import sequence_memory

    made, tiles = [], []
    real, real_tiles = lomo_ds.initialize, sequence_memory.exact_tiles

    def spy(model, config, *a, **k):  # keep the engine to read what it installed
        made.append(real(model, config, *a, **k))
        return made[-1]

    def counted(rows, want):  # the tiles each tiled forward ran
        tiles.append(real_tiles(rows, want))
        return tiles[-1]

    lomo_ds.initialize, sequence_memory.exact_tiles = spy, counted
    try:
        r = E.equivalence(lambda: tiny_llama(9), cfg, {"clip_norm": 0.5}, prepare=prepare, batches=batches)
    finally:
        lomo_ds.initialize, sequence_memory.exact_tiles = real, real_tiles
    layer = made[0].module.model.layers[0]
    return {**r, "mlp_forward": _name(layer.mlp.forward), "tiles": sorted(set(tiles)),
            "checkpoint_call": _name(getattr(layer, "_gradient_checkpointing_func", None))}


CHECKS = multi_rank_checks(
    WORLDS,
    tiled=lambda: _equivalence(E.ds_cfg(clip_grad_norm=0.5, tiled_mlp=True, mlp_tiles=3), prepare=_checkpointed),
    tiled_auto=lambda: _equivalence(E.ds_cfg(clip_grad_norm=0.5, tiled_mlp=True), batches=_long_rows),
    tiled_per_layer=lambda: _equivalence(E.ds_cfg(clip_grad_norm=0.5, tiled_mlp=True, mlp_tiles=4, fetch=E.PER_LAYER),
                                         prepare=_checkpointed),
    offload=lambda: _equivalence(E.ds_cfg(clip_grad_norm=0.5, offload_checkpoints=True), prepare=_checkpointed),
    tiled_offload=lambda: _equivalence(E.ds_cfg(clip_grad_norm=0.5, tiled_mlp=True, offload_checkpoints=True),
                                       batches=_long_rows, prepare=_checkpointed),
)


def _adalomo(**memory):
    from tests.engine import dist_adalomo_checks as A

    def make():
        model = tiny_llama(9)
        model.gradient_checkpointing_enable()
        return model

    return A.equivalence(make, A.adalomo_cfg(clip_grad_norm=0.5, **memory), clip_norm=0.5)


# AdaLomo needs each bucket's statistics before it updates: the whole gradient, after the last tile.
ADALOMO = multi_rank_checks(WORLDS, adalomo_tiled_offload=lambda: _adalomo(tiled_mlp=True, mlp_tiles=3,
                                                                          offload_checkpoints=True))


@pytest.mark.long
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("check", ADALOMO, ids=str)
def test_adalomo_matches_its_reference_with_the_options(rank_results, world, check):
    r = ok(rank_results(world), check)
    assert_matches_reference(r, TOL, f"{check} on {world} rank(s), against the reference AdaLomo")
    assert r["moved"] > 1000 * TOL


@pytest.mark.long
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("check", CHECKS, ids=str)
def test_matches_sgd_with_the_options(rank_results, world, check):
    r = ok(rank_results(world), check)
    assert_matches_reference(r, TOL, f"{check} on {world} rank(s), against SGD")
    name = str(check)
    assert (r["mlp_forward"] == "tiled") == name.startswith("tiled"), r
    if name.startswith("tiled"):
        assert r["tiles"] == [{"tiled": 3, "tiled_per_layer": 4}.get(name, 3)], r  # 2 x 11 rows in 3 or 4; 90 / 40
    assert (r["checkpoint_call"] == "offloaded") == name.endswith("offload"), r


def test_tiles_are_exact_for_torch_chunk():
    from lomo_ds.engine.sequence_memory import exact_tiles

    for rows in range(1, 60):
        for tiles in range(1, 12):
            n = exact_tiles(rows, tiles)
            assert 1 <= n <= tiles and len(torch.chunk(torch.empty(rows, device="cpu"), n)) == n, (rows, tiles, n)


@pytest.mark.long  # over a second: DeepSpeed's sequence-parallel module is imported
def test_each_weight_is_handed_over_once_with_its_whole_gradient():
    """One process, no engine: the gradient hooks fire once per weight per backward (after the last
    tile, where ds_compat.grad_is_ready says so), with the untiled gradient."""
    import copy

    from lomo_ds.config.engine_sections import MemoryConfig
    from lomo_ds.engine import sequence_memory
    from lomo_ds.runtime import ds_compat

    plain = tiny_llama(3)
    tiled = copy.deepcopy(plain)
    sequence_memory.install(tiled, MemoryConfig(tiled_mlp=True, mlp_tiles=4), None, torch.device("cpu"))
    handed = {}

    def hook(p):
        if ds_compat.grad_is_ready(p):
            handed.setdefault(p, []).append(p.grad.clone())
            p.grad = None

    for p in tiled.parameters():
        p.register_post_accumulate_grad_hook(hook)
    ids = torch.randint(0, VOCAB, (2, 21), generator=torch.Generator(device="cpu").manual_seed(0), device="cpu")
    loss_plain = plain(input_ids=ids, labels=ids).loss
    loss_tiled = tiled(input_ids=ids, labels=ids).loss
    assert loss_tiled.item() == pytest.approx(loss_plain.item(), rel=1e-6)
    loss_plain.backward(), loss_tiled.backward()
    for p, q in zip(plain.parameters(), tiled.parameters(), strict=True):
        assert len(handed[q]) == 1
        torch.testing.assert_close(handed[q][0], p.grad, rtol=1e-5, atol=1e-6)


def test_options_that_cannot_apply_are_refused():
    from lomo_ds.config.engine_sections import MemoryConfig
    from lomo_ds.config.errors import ConfigError
    from lomo_ds.config.run import load_run_config
    from lomo_ds.engine import sequence_memory

    with pytest.raises(ValueError, match="memory.offload_checkpoints: the model does not checkpoint"):
        sequence_memory.install(tiny_llama(0), MemoryConfig(offload_checkpoints=True), None, torch.device("cpu"))
    with pytest.raises(ValueError, match="memory.tiled_mlp: Linear has no decoder layers"):
        sequence_memory.install(torch.nn.Linear(2, 2), MemoryConfig(tiled_mlp=True), None, torch.device("cpu"))
    base = {"model": {"path": "tiny"}, "lomo": {"lr": 1e-3}}
    with pytest.raises(ConfigError, match="memory.offload_checkpoints: needs model.gradient_checkpointing"):
        load_run_config({**base, "memory": {"offload_checkpoints": True}}, check_files=False)
    with pytest.raises(ConfigError, match="memory.tiled_mlp: applied by the fused-update engine"):
        load_run_config({**base, "memory": {"tiled_mlp": True}, "train": {"method": "adamw"}}, check_files=False)
