"""The engine's resumable state in torch.distributed.checkpoint's layout (lomo_ds/storage/engine_state.py):
written by N ranks, read by M, for every N, M of 1-3 inside one 3-rank launch (subgroups of its
ranks write and read). Parameters of 1 to 11 elements, fewer than the ranks included, so pieces are
uneven and some empty; every rank's read is compared element by element with the piece ZeRO-3's
partition gives it, padding zeros included. The state is a rule's that storage has never heard of
("a_rule", its per-element buffer `m` declared cut, its `row` replicated): which tensors are pieces
comes from the state's PIECES declaration alone; again with LOMO_DS_EMULATE_DEVICE_COPY=1, where every
piece goes through a host copy as an accelerator's shards do. Whole runs moved between 1-4 ranks:
tests/recipe/test_resume_elsewhere.py (long). The host memory a save and a load hold:
tests/host_memory.py (long)."""
import math
import os

import pytest
import torch

from lomo_ds.runtime.shard_geometry import PIECES
from lomo_ds.storage.engine_state import read_engine_state, save_engine_state
from tests.host_memory import emulated_device_copy
from tests.ranks import multi_rank, ok, work_dir

NUMELS = {"a.weight": 11, "b.weight": 2, "c.bias": 1, "d.weight": 7}
WORLDS = (1, 2, 3)


def _full(name: str, what: str) -> torch.Tensor:
    """The whole flat tensor `what` of parameter `name`: distinct values everywhere."""
    base = 1000 * list(NUMELS).index(name) + {"shards": 0, "masters": 100, "m": 200}[what]
    return torch.arange(NUMELS[name], dtype=torch.float32) + base


def _piece(full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    part = math.ceil(full.numel() / world)
    out = torch.zeros(part, dtype=full.dtype)
    got = full[rank * part:(rank + 1) * part]
    out[:got.numel()] = got
    return out


def _state(world: int, rank: int, filled: bool) -> dict:
    """A rank's state in shard_state_dict's layout: the real one (filled) or the template a reading run holds."""
    def piece(name, what):
        p = _piece(_full(name, what), world, rank)
        return p if filled else torch.zeros_like(p)

    return {"world": world, "rank": rank, "global_step": 7 if filled else 0, "skipped_steps": 1 if filled else 0,
            "shapes": {n: [k] for n, k in NUMELS.items()},
            "shards": {n: piece(n, "shards") for n in NUMELS},
            "masters": {n: piece(n, "masters") for n in NUMELS},
            "rule": {"name": "a_rule",
                     "state": {n: {"m": piece(n, "m"), "row": torch.full((3,), 5.0 if filled else 0.0),
                                   "step": 3 if filled else 0} for n in NUMELS}},
            "loss_scaler": None,
            # What the engine declares (ShardUpdater.state_dict): the shards, the masters and the
            # rule's cut buffer are pieces of a flat tensor of the parameter's numel; `row` is not.
            PIECES: {**{(part, n): k for part in ("shards", "masters") for n, k in NUMELS.items()},
                     **{("rule", "state", n, "m"): k for n, k in NUMELS.items()}}}


def _reads_every_other(folder: str) -> dict:
    """Every rank count of 1-3 writes its state under `folder`; every rank count reads each back."""
    rank = torch.distributed.get_rank()
    groups = {n: torch.distributed.new_group(list(range(n)), backend="gloo") for n in WORLDS}
    worst, checked, unequal = 0.0, 0, []
    for n in WORLDS:
        path = os.path.join(work_dir(), folder, f"written_by_{n}")
        if rank < n:
            save_engine_state(path, _state(n, rank, True), 60.0, group=groups[n])
        torch.distributed.barrier()
        for m in WORLDS:
            if rank >= m:
                torch.distributed.barrier()
                continue
            seen = {}
            got = read_engine_state(path, _state(m, rank, False), seen.update, 60.0, group=groups[m])
            want = _state(m, rank, True)
            assert sorted(seen["shards"]) == sorted(NUMELS) and seen["global_step"] == 7, seen
            assert got["world"] == m and got["rank"] == rank and got["skipped_steps"] == 1
            for name in NUMELS:
                pairs = [(got["shards"][name], want["shards"][name]), (got["masters"][name], want["masters"][name]),
                         (got["rule"]["state"][name]["m"], want["rule"]["state"][name]["m"]),
                         (got["rule"]["state"][name]["row"], want["rule"]["state"][name]["row"])]
                for a, b in pairs:
                    assert a.shape == b.shape, (n, m, name, a.shape, b.shape)
                    worst = max(worst, (a - b).abs().max().item() if a.numel() else 0.0)
                    if not torch.equal(a, b):  # bit for bit
                        unequal.append(f"{n} -> {m} ranks: {name}")
                    checked += 1
                assert got["rule"]["state"][name]["step"] == 3 and got["rule"]["name"] == "a_rule"
            torch.distributed.barrier()
    return {"max_abs_diff": worst, "tensors_checked": checked, "unequal": unequal[:5]}


@multi_rank(worlds=[3])
def every_rank_count_reads_every_other():
    return _reads_every_other("host")


@multi_rank(worlds=[3])
def every_rank_count_reads_every_other_through_host_copies():
    """As on an accelerator: no piece is host memory (runtime.device.host_resident), so the save
    copies each piece to the host as it writes it and the load reads into the live tensors' ranges."""
    with emulated_device_copy():
        return _reads_every_other("emulated_device")


@multi_rank(worlds=[3])
def another_model_is_refused_before_any_read():
    rank = torch.distributed.get_rank()
    path = os.path.join(work_dir(), "for_refusal")
    save_engine_state(path, _state(3, rank, True), 60.0)

    def check(state):
        if state["shapes"]["a.weight"] != [12]:
            raise ValueError(f"checkpoint's 'a.weight' has shape {tuple(state['shapes']['a.weight'])}, "
                             "this model's (12,)")

    template = _state(3, rank, False)
    try:
        read_engine_state(path, template, check, 60.0)
    except ValueError as e:
        untouched = all(not t.any() for t in template["shards"].values())
        return {"refusal": str(e), "untouched": untouched}
    return {"refusal": None}


def _declared_otherwise(state: dict, cut: bool) -> dict:
    """`state` with a.weight's rule buffer `m` declared cut (as _state does) or replicated."""
    pieces = {p: n for p, n in state[PIECES].items() if p != ("rule", "state", "a.weight", "m")}
    if cut:
        pieces[("rule", "state", "a.weight", "m")] = NUMELS["a.weight"]
    return {**state, PIECES: pieces}


@multi_rank(worlds=[3])
def a_tensor_cut_otherwise_than_declared_is_refused():
    """Written with `m` cut and read by a state that keeps it whole, and the other way round: refused
    by the key, before anything is read (else every rank would keep rank 0's, or its own stale one)."""
    from lomo_ds.storage.checkpoint import CheckpointError

    rank, out = torch.distributed.get_rank(), {}
    for written_cut in (True, False):
        path = os.path.join(work_dir(), f"m_cut_{written_cut}")
        save_engine_state(path, _declared_otherwise(_state(3, rank, True), written_cut), 60.0)
        template = _declared_otherwise(_state(3, rank, False), not written_cut)
        try:
            read_engine_state(path, template, lambda state: None, 60.0)
            out[f"written_cut_{written_cut}"] = None
        except CheckpointError as e:
            out[f"written_cut_{written_cut}"] = str(e)
        out[f"untouched_{written_cut}"] = all(not t.any() for t in template["shards"].values())
    return out


class _RunsCode:
    """Unpickling it would run code (writes a marker file)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


@multi_rank(worlds=[3])
def pickled_code_is_refused():
    """A checkpoint whose non-tensor entries carry a pickled callable: refused before it runs."""
    from lomo_ds.storage.checkpoint import CheckpointError

    rank = torch.distributed.get_rank()
    path, marker = os.path.join(work_dir(), "carrying_code"), os.path.join(work_dir(), "ran")
    save_engine_state(path, {**_state(3, rank, True), "global_step": _RunsCode(marker)}, 60.0)
    try:
        read_engine_state(path, _state(3, rank, False), lambda state: None, 60.0)
    except CheckpointError as e:
        return {"refused": str(e), "ran": os.path.exists(marker)}
    return {"refused": None, "ran": os.path.exists(marker)}


@pytest.mark.parametrize("world", [3])  # the 3-rank launch's group (tests/conftest.py)
def test_every_rank_count_reads_what_any_other_wrote(rank_results, world):
    r = ok(rank_results(world), every_rank_count_reads_every_other)
    # rank 0 reads in every one of the 9 pairs: 4 parameters x 4 tensors each
    assert r["tensors_checked"] == len(WORLDS) ** 2 * len(NUMELS) * 4, r
    assert r["max_abs_diff"] == 0.0 and not r["unequal"], r


@pytest.mark.parametrize("world", [3])  # the 3-rank launch's group (tests/conftest.py)
def test_every_rank_count_reads_what_any_other_wrote_through_host_copies(rank_results, world):
    r = ok(rank_results(world), every_rank_count_reads_every_other_through_host_copies)
    assert r["tensors_checked"] == len(WORLDS) ** 2 * len(NUMELS) * 4, r
    assert r["max_abs_diff"] == 0.0 and not r["unequal"], r


@pytest.mark.parametrize("world", [3])  # the 3-rank launch's group (tests/conftest.py)
def test_another_model_is_refused_before_any_tensor_is_read(rank_results, world):
    r = ok(rank_results(world), another_model_is_refused_before_any_read)
    assert r["refusal"] and "a.weight" in r["refusal"], r
    assert r["untouched"], r


def test_the_pieces_are_zero3s_partition():
    """The reference pieces above are ZeRO-3's cut (ceil(n / N) a rank, zeros past the end)."""
    assert _piece(torch.arange(7.0), 3, 2).tolist() == [6.0, 0.0, 0.0]
    assert _piece(torch.arange(2.0), 3, 2).tolist() == [0.0]


@pytest.mark.parametrize("world", [3])  # the 3-rank launch's group (tests/conftest.py)
def test_a_checkpoint_carrying_pickled_code_is_refused(rank_results, world):
    r = ok(rank_results(world), pickled_code_is_refused)
    assert r["refused"] and "carrying_code" in r["refused"] and "weights_only" in r["refused"].lower(), r
    assert not r["ran"], r


@pytest.mark.parametrize("world", [3])  # the 3-rank launch's group (tests/conftest.py)
def test_a_tensor_cut_otherwise_than_the_reading_state_declares_is_refused(rank_results, world):
    r = ok(rank_results(world), a_tensor_cut_otherwise_than_declared_is_refused)
    assert "rule/state/a.weight/m" in r["written_cut_True"] and "declares it replicated" in r["written_cut_True"], r
    assert "rule/state/a.weight/m" in r["written_cut_False"] and "declares it cut" in r["written_cut_False"], r
    assert r["untouched_True"] and r["untouched_False"], r
