"""A rule's state in a checkpoint: stored under the rule's name, cut by ranks where the rule declares
it cut, and refused by name by another rule.

- AdaLomo's state moved between rank counts: a 3-rank engine's state after 2 steps is re-cut for 2
  ranks (as a 2-rank run writes it), saved by 2 ranks, and resumed by a 3-rank engine through the
  recipe's and the Trainer's reader (methods/lomo.py:load_engine_state). Every rank then holds its
  own slice of each cut tensor (the vectors' second moment `sq`, the shards), and 1 more step equals
  3 uninterrupted ones bit for bit. The reverse way, the 3-rank checkpoint read by 2 ranks gives
  each its own slice. The mechanism is the state's declaration (Rule.state_layout, the engine
  state's PIECES), which storage reads without knowing a rule: a rule storage never heard of is
  tests/storage/test_engine_state.py's, on every N -> M of 1-3.
- A checkpoint of another rule (SGD's into AdaLomo, AdaLomo's into SGD) is refused by name, naming
  lomo.optimizer and both rules, before any tensor is read (the live shards untouched).
- A checkpoint written before rules were named (the rule's state under "adalomo"; SGD's None there)
  still resumes: on disk (engine_state/ as that layout wrote it) and in memory, exactly.
"""
from __future__ import annotations

import os

import pytest
import torch

import lomo_ds
from lomo_ds.engine.update import SGD
from lomo_ds.engine.update.updater import rule_entry
from lomo_ds.methods.lomo import load_engine_state
from lomo_ds.runtime.shard_geometry import PIECES, ShardGeometry
from lomo_ds.storage.engine_state import read_engine_state, save_engine_state
from tests.engine.dist_adalomo_checks import adalomo_cfg
from tests.engine.dist_engine_checks import ds_cfg
from tests.engine.state_cuts import at, cut_for, full_pieces
from tests.ranks import multi_rank, ok, work_dir
from tests.tiny import global_batch, tiny_llama

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _trained(cfg: dict, steps: int = 2, seed: int = 11):
    engine = lomo_ds.initialize(tiny_llama(seed), cfg)
    for step in range(steps):
        engine.train_step(global_batch(step, engine.world)[engine.rank])
    return engine


def _on_every_rank(fn):
    """fn() on every rank, one rank's failure raised on all: the others would otherwise wait in the
    next collective until the launch times out."""
    try:
        out, failed = fn(), None
    except Exception as e:  # noqa: BLE001 - re-raised below, on this rank and the others
        out, failed = None, e
    flag = torch.tensor([int(failed is not None)], dtype=torch.int32, device="cpu")
    torch.distributed.all_reduce(flag)
    if failed is not None:
        raise failed
    if flag.item():
        raise RuntimeError("another rank failed to load (its traceback is its own)")
    return out


def _slices_match(state: dict, full: dict[tuple, torch.Tensor]) -> tuple[int, list]:
    """(how many pieces were compared, the paths of those that are not this rank's slice)."""
    world, rank, wrong = state["world"], state["rank"], []
    for path, n in state[PIECES].items():
        geo = ShardGeometry(n, world, rank)
        if not torch.equal(at(state, path).reshape(-1)[:geo.local].cpu(), full[path][geo.start:geo.start + geo.local]):
            wrong.append("/".join(path))
    return len(state[PIECES]), wrong


@multi_rank(worlds=[3])
def adalomo_state_moves_between_rank_counts():
    rank = torch.distributed.get_rank()
    two = torch.distributed.new_group([0, 1], backend="gloo")
    straight = _trained(adalomo_cfg())
    state3 = straight.shard_state_dict()
    full = full_pieces(state3)
    cut_rule = sorted(p[2] for p in state3[PIECES] if p[:2] == ("rule", "state"))
    # 3 -> 2: the 3-rank checkpoint read by 2 ranks
    three_dir, two_dir = os.path.join(work_dir(), "adalomo_by_3"), os.path.join(work_dir(), "adalomo_by_2")
    save_engine_state(three_dir, state3, 60.0)
    read_by_two = None
    if rank < 2:
        template = cut_for(state3, {p: torch.zeros_like(t) for p, t in full.items()}, 2, rank)
        read_by_two = _slices_match(read_engine_state(three_dir, template, lambda s: None, 60.0, group=two), full)
        save_engine_state(two_dir, cut_for(state3, full, 2, rank), 60.0, group=two)  # 2 -> 3
    torch.distributed.barrier()
    resumed = lomo_ds.initialize(tiny_llama(12), adalomo_cfg())
    _on_every_rank(lambda: resumed.load_shard_state_dict(load_engine_state(resumed, two_dir, 60.0)))
    read_by_three = _slices_match(resumed.shard_state_dict(), full)
    for engine in (straight, resumed):
        engine.train_step(global_batch(2, 3)[rank])
    a, b = straight.full_state_dict(), resumed.full_state_dict()
    if rank != 0:
        return None
    return {"cut_rule_state": cut_rule, "read_by_two": read_by_two, "read_by_three": read_by_three,
            "rule": state3["rule"]["name"],
            "max_abs_diff": max((a[k].float() - b[k].float()).abs().max().item() for k in a)}


def _refusal(writer_cfg: dict, reader_cfg: dict, folder: str) -> dict:
    written = _trained(writer_cfg, steps=1)
    save_engine_state(folder, written.shard_state_dict(), 60.0)
    reader = lomo_ds.initialize(tiny_llama(12), reader_cfg)
    before = {n: t.clone() for n, t in reader.shard_state_dict()["shards"].items()}
    try:
        load_engine_state(reader, folder, 60.0)
    except ValueError as e:
        after = reader.shard_state_dict()["shards"]
        return {"refusal": str(e), "untouched": all(torch.equal(before[n], after[n]) for n in before)}
    return {"refusal": None}


@multi_rank(worlds=[3])
def another_rules_checkpoint_is_refused_by_name():
    folder = work_dir()
    return {"sgd_into_adalomo": _refusal(ds_cfg(), adalomo_cfg(), os.path.join(folder, "by_sgd")),
            "adalomo_into_sgd": _refusal(adalomo_cfg(), ds_cfg(), os.path.join(folder, "by_adalomo"))}


def _old_layout(state: dict) -> dict:
    """`state` as the engine wrote it before rules were named: the rule's state under "adalomo", the
    checkpoint cutting shards, masters and "adalomo/<name>/sq" (as that layout's storage did)."""
    old = {k: v for k, v in state.items() if k not in ("rule", PIECES)}
    old["adalomo"] = state["rule"]["state"]
    old[PIECES] = {(("adalomo", *p[2:]) if p[:2] == ("rule", "state") else p): n for p, n in state[PIECES].items()}
    return old


@multi_rank(worlds=[3])
def old_layout_checkpoints_resume():
    rank = torch.distributed.get_rank()
    straight = _trained(adalomo_cfg())
    old = _old_layout(straight.shard_state_dict())
    folder = os.path.join(work_dir(), "old_layout")
    save_engine_state(folder, old, 60.0)
    on_disk = lomo_ds.initialize(tiny_llama(12), adalomo_cfg())
    _on_every_rank(lambda: on_disk.load_shard_state_dict(load_engine_state(on_disk, folder, 60.0)))
    in_memory = lomo_ds.initialize(tiny_llama(12), adalomo_cfg())
    _on_every_rank(lambda: in_memory.load_shard_state_dict({k: v for k, v in old.items() if k != PIECES}))
    for engine in (straight, on_disk, in_memory):
        engine.train_step(global_batch(2, 3)[rank])
    fulls = [e.full_state_dict() for e in (straight, on_disk, in_memory)]
    # SGD's old state (None under "adalomo") resumes as SGD's, and AdaLomo refuses it by name.
    sgd = _trained(ds_cfg(), steps=1)
    sgd_old = {k: v for k, v in sgd.shard_state_dict().items() if k not in ("rule", PIECES)}
    sgd_folder = os.path.join(work_dir(), "old_layout_sgd")
    save_engine_state(sgd_folder, {**sgd_old, "adalomo": None, PIECES: sgd.shard_state_dict()[PIECES]}, 60.0)
    sgd.load_shard_state_dict(load_engine_state(sgd, sgd_folder, 60.0))
    try:
        load_engine_state(straight, sgd_folder, 60.0)
        refusal = None
    except ValueError as e:
        refusal = str(e)
    if rank != 0:
        return None
    a = fulls[0]
    return {"on_disk": max((a[k] - fulls[1][k]).abs().max().item() for k in a),
            "in_memory": max((a[k] - fulls[2][k]).abs().max().item() for k in a),
            "old_keys_on_disk": sorted({k.split("/")[0] for k in _saved_keys(folder)}),
            "sgd_old_refused_by_adalomo": refusal}


def _saved_keys(folder: str) -> list[str]:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    return list(FileSystemReader(os.path.join(folder, "engine_state")).read_metadata().state_dict_metadata)


@pytest.mark.parametrize("world", [3])  # the 3-rank launch's group (tests/conftest.py)
def test_adalomo_state_resumed_on_another_rank_count_is_each_ranks_own_slice(rank_results, world):
    r = ok(rank_results(world), adalomo_state_moves_between_rank_counts)
    assert r["rule"] == "adalomo" and r["cut_rule_state"], r  # the vectors' sq are declared cut
    for read in ("read_by_two", "read_by_three"):
        compared, wrong = r[read]
        assert compared > len(r["cut_rule_state"]) and not wrong, (read, r)
    assert r["max_abs_diff"] == 0.0, "2 steps on 3 ranks + moved to 2 and back + 1 step == 3 steps, bit for bit"


@pytest.mark.parametrize("world", [3])  # the 3-rank launch's group (tests/conftest.py)
def test_another_rules_checkpoint_is_refused_by_name_before_any_read(rank_results, world):
    r = ok(rank_results(world), another_rules_checkpoint_is_refused_by_name)
    for case, (written, reading) in {"sgd_into_adalomo": ("sgd", "adalomo"),
                                     "adalomo_into_sgd": ("adalomo", "sgd")}.items():
        msg = r[case]["refusal"]
        assert msg and "lomo.optimizer" in msg and f"'{written}'" in msg and f"'{reading}'" in msg, (case, msg)
        assert r[case]["untouched"], case


@pytest.mark.parametrize("world", [3])  # the 3-rank launch's group (tests/conftest.py)
def test_checkpoints_of_the_layout_before_rule_names_still_resume(rank_results, world):
    r = ok(rank_results(world), old_layout_checkpoints_resume)
    assert "adalomo" in r["old_keys_on_disk"] and "rule" not in r["old_keys_on_disk"], r
    assert r["on_disk"] == 0.0 and r["in_memory"] == 0.0, r
    msg = r["sgd_old_refused_by_adalomo"]
    assert msg and "lomo.optimizer" in msg and "'sgd'" in msg and "'adalomo'" in msg, msg


def test_the_old_layout_is_read_as_the_rule_that_wrote_it():
    state = {"shards": {}, "adalomo": {"w": {"step": 1}}}
    assert rule_entry(state) == {"name": "adalomo", "state": {"w": {"step": 1}}} and "adalomo" not in state
    assert rule_entry({"shards": {}, "adalomo": None}) == {"name": "sgd", "state": None}
    with pytest.raises(ValueError, match="no rule entry"):
        rule_entry({"shards": {}})


def test_sgd_refuses_a_rule_state():
    SGD().check_state(None)
    with pytest.raises(ValueError, match="SGD keeps no state.*lomo.optimizer"):
        SGD().check_state({"w": {"m": torch.zeros(1, device="cpu")}})


def test_storage_names_no_rule_and_imports_nothing_of_the_engine():
    """Weak on its own (a name can hide); the plug-in rule's resume on another rank count, whose
    name storage cannot know, is the proof that storage cuts by the declaration alone."""
    folder = os.path.join(ROOT, "lomo_ds", "storage")
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            text = open(os.path.join(folder, name)).read()
            for word in ("adalomo", '"sq"', "'sq'", "lomo_ds.engine", "`sq`"):
                assert word not in text.lower(), (name, word)
