"""A rank's state for another rank count (lomo_ds/engine/update/reslice.py), on states laid out as
ZeRO-3 lays them out for N ranks, cut again for M: every element where ZeRO-3 puts it for M, the
padding zero, the replicated values rank 0's. The training program's resume across rank counts is
tests/recipe/test_resume_elsewhere.py's."""
import math

import pytest
import torch

from lomo_ds.engine.update.reslice import reslice

NUMELS = {"embed": 23, "norm": 5, "tiny": 2}  # 2 elements: fewer than the ranks on 3 and 4


def _rank_state(full: dict, world: int, rank: int, replicated: torch.Tensor) -> dict:
    shards, masters, adalomo = {}, {}, {}
    for name, n in NUMELS.items():
        part = math.ceil(n / world)
        start = rank * part
        local = max(0, min(part, n - start))
        shard = torch.zeros(part, dtype=torch.bfloat16)
        shard[:local] = full[name][start:start + local]
        shards[name] = shard
        masters[name] = full[name][start:start + local].clone()  # fp32, the real elements only
        adalomo[name] = ({"step": torch.tensor(3.0, dtype=torch.float64), "row": replicated.clone(),
                          "col": replicated.clone()} if name == "embed" else
                         {"step": torch.tensor(3.0, dtype=torch.float64),
                          "sq": full[name][start:start + local].clone() * 2})
    return {"world": world, "rank": rank, "shards": shards, "masters": masters, "adalomo": adalomo,
            "global_step": 7, "skipped_steps": 1, "consecutive_skips": 0, "loss_scaler": None}


@pytest.mark.parametrize("old", [1, 2, 3, 4])
@pytest.mark.parametrize("new", [1, 2, 3, 4])
def test_every_element_lands_where_zero3_puts_it_for_the_new_rank_count(old, new):
    torch.manual_seed(0)
    full = {name: torch.randn(n) for name, n in NUMELS.items()}
    replicated = torch.randn(4)
    olds = [_rank_state(full, old, r, replicated) for r in range(old)]
    for rank in range(new):
        want = _rank_state(full, new, rank, replicated)
        got = reslice(olds, want, NUMELS, new, rank)
        assert (got["world"], got["rank"], got["global_step"], got["skipped_steps"]) == (new, rank, 7, 1)
        for name in NUMELS:
            assert torch.equal(got["shards"][name], want["shards"][name]), (old, new, rank, name)
            assert got["shards"][name].dtype == torch.bfloat16
            assert torch.equal(got["masters"][name], want["masters"][name]), (old, new, rank, name)
            for key, value in want["adalomo"][name].items():
                assert torch.equal(got["adalomo"][name][key], value), (old, new, rank, name, key)


def test_files_that_do_not_say_their_rank_are_refused():
    full = {name: torch.zeros(n) for name, n in NUMELS.items()}
    olds = [_rank_state(full, 2, r, torch.zeros(4)) for r in range(2)]
    olds[1]["rank"] = 0  # two copies of rank 0's file
    with pytest.raises(ValueError, match="rank file 1 says rank 0 of 2"):
        reslice(olds, olds[0], NUMELS, 3, 0)
