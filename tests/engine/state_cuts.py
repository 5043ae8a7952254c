"""A resumable engine state moved between rank counts inside one launch: every declared piece put
together into its global flat tensor, and the state cut again as a rank of another count holds it
(ZeRO-3's cut, padded as a shard is). The engine runs on one group only, so a move N -> M is
simulated: the M-rank launch's state is cut as N ranks would hold it, saved by N of them, and read
by all M (tests/engine/test_rule_state.py, test_rule_plugin.py, test_int8_engine.py)."""
from __future__ import annotations

import torch

from lomo_ds.runtime.shard_geometry import PIECES, ShardGeometry


def at(state: dict, path: tuple):
    for key in path:
        state = state[key]
    return state


def full_pieces(state: dict) -> dict[tuple, torch.Tensor]:
    """Every declared piece of this launch's ranks put together: the global flat tensors."""
    world, rank = state["world"], state["rank"]
    mine = {path: at(state, path).detach().reshape(-1)[:ShardGeometry(n, world, rank).local].cpu().clone()
            for path, n in state[PIECES].items()}
    every = [None] * world
    torch.distributed.all_gather_object(every, mine)
    return {path: torch.cat([r[path] for r in every]) for path in state[PIECES]}


def cut_for(state: dict, full: dict[tuple, torch.Tensor], world: int, rank: int) -> dict:
    """`state` as rank `rank` of `world` holds it: each declared piece ZeRO-3's cut of the full
    tensor (padded to the cut's length, as a shard is), everything else as it is."""
    def walk(node, path):
        if path in full:
            geo = ShardGeometry(full[path].numel(), world, rank)
            out = torch.zeros(geo.part, dtype=full[path].dtype, device="cpu")
            out[:geo.local] = full[path][geo.start:geo.start + geo.local]
            return out
        if isinstance(node, dict) and path != (PIECES,):
            return {k: walk(v, (*path, k)) for k, v in node.items()}
        return node.detach().clone() if torch.is_tensor(node) else node

    return {**walk({k: v for k, v in state.items() if k != PIECES}, ()), "world": world, "rank": rank,
            PIECES: state[PIECES]}
