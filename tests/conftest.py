"""Fixtures and hooks only (nothing imports this file): the multi-rank checks' figures, one launch
per world size, also under pytest-xdist."""
import json
import os

import pytest
from filelock import FileLock

from tests import ranks


def pytest_configure(config):
    config.addinivalue_line("markers", "ranks: the test starts several ranks itself")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    # Under `pytest -n N --dist loadgroup` (make test) the tests that start ranks go to one worker
    # when pytest-xdist honours the group; the lock below keeps the launches of several ranks one at
    # a time and one per world size whatever worker runs them. The tests of the 1-rank launch (a
    # test parametrized with world 1) are a group of their own: that launch takes one core, like a
    # single-process test, and runs beside the launches of several ranks (which leave a core idle
    # while a rank waits on another) instead of after them.
    for item in items:
        if "rank_results" in getattr(item, "fixturenames", ()) or item.get_closest_marker("ranks"):
            one_rank = getattr(item, "callspec", None) is not None and item.callspec.params.get("world") == 1
            item.add_marker(pytest.mark.xdist_group("rank1" if one_rank else "ranks"))


@pytest.fixture(scope="session", autouse=True)
def one_thread_per_worker():
    """Under pytest-xdist (make test) each worker computes on one thread: the workers and the
    multi-rank launches beside them share the cores, and torch's default (a thread per core) in
    every process makes threads wait on each other across cores that are busy."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def shared_tmp(tmp_path_factory):
    """A folder every pytest-xdist worker of this session shares (the session's own without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session", autouse=True)
def one_launch_at_a_time(shared_tmp):
    """Every launch of several ranks in this session (tests.ranks.launch) takes this lock: on a few
    cores two such launches side by side only fight over them (a 1-rank launch does not take it)."""
    ranks.LAUNCH_LOCK = FileLock(str(shared_tmp / "launch.lock"))
    yield
    ranks.LAUNCH_LOCK = None


@pytest.fixture(scope="session")
def rank_results(shared_tmp):
    """get(world): the figures of every multi-rank check declared for `world` in the collected test
    modules (tests/ranks.py), from one launch per world size in the session: the first worker that
    needs them launches, the others read its results."""
    cache: dict[int, dict] = {}

    def get(world: int) -> dict:
        if world not in cache:
            out_dir = shared_tmp / f"ranks{world}"
            with FileLock(str(shared_tmp / f"ranks{world}.lock")):
                if (out_dir / "results.json").exists():
                    cache[world] = json.loads((out_dir / "results.json").read_text())
                else:
                    out_dir.mkdir(exist_ok=True)
                    try:
                        cache[world] = ranks.run_world(world, str(out_dir))
                    except Exception as e:
                        # Every test of this world size fails with the launch's error (tests.ranks.ok)
                        # instead of launching it again, each waiting out its timeout.
                        cache[world] = {ranks.LAUNCH_ERROR: f"{type(e).__name__}: {e}"[-12000:]}
                        (out_dir / "results.json").write_text(json.dumps(cache[world]))
        return cache[world]

    return get
