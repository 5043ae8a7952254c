"""Fixtures and hooks only (nothing imports this file): the multi-rank checks' figures, one launch
per world size, also under pytest-xdist."""
import json
import os
import warnings

import pytest
from filelock import FileLock

from tests import ranks


def pytest_configure(config):
    config.addinivalue_line("markers", "ranks: the test starts several ranks itself")
    config.addinivalue_line("markers", "long: launch after launch; runs with LOMO_DS_LONG_TESTS=1 (CI)")


def pytest_runtest_setup(item):
    if item.get_closest_marker("long") and not ranks.LONG_TESTS:
        pytest.skip("a long check: LOMO_DS_LONG_TESTS=1 runs it (CI does)")


@pytest.hookimpl(wrapper=True)  # around pytest-xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config, items):
    # Under `pytest -n N --dist loadgroup` (make test) each launch's tests go to one worker when
    # pytest-xdist honours the groups. The 2-rank launch (most checks: the longest) is a group of its
    # own; the 1-rank launch another (it takes one core, like a single-process test); the 3-rank launch
    # (the 4-rank one too, under LOMO_DS_LONG_TESTS) and the tests that start ranks themselves a third.
    # The 2-rank launch leaves part of the cores idle while one rank waits on the other, so the other
    # worker's launches and tests run beside it instead of after it.
    for item in items:
        if "rank_results" in getattr(item, "fixturenames", ()) or item.get_closest_marker("ranks"):
            world = item.callspec.params.get("world") if getattr(item, "callspec", None) is not None else None
            if world is None and "rank_results" in item.fixturenames:
                _only_two_ranks(item)
            if item.get_closest_marker("ranks") or world in (3, 4):
                group = "ranks_own"
            else:
                group = "rank1" if world == 1 else "ranks2"
            item.add_marker(pytest.mark.xdist_group(group))
    result = yield
    # pytest-xdist tells its scheduler an item's group by the suffix it adds to the item's id; where
    # that fails (pytest 9.2: https://github.com/pytest-dev/pytest-xdist/issues/1386) the tests still
    # pass, spread over the workers, each waiting for the launch another started: much slower.
    if getattr(config.option, "loadgroup", False):
        lost = [i.nodeid for i in items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
        if lost:
            warnings.warn(pytest.PytestWarning(
                f"pytest-xdist did not group {len(lost)} tests by xdist_group (e.g. {lost[0]}): each launch's "
                "tests may wait on other workers; pytest<9.2 groups them"), stacklevel=1)
    return result


def _only_two_ranks(item) -> None:
    """A test without a `world` parameter is grouped with the 2-rank launch: one that reads another
    launch would wait, in the 2-rank launch's worker, for the worker that runs it."""
    import inspect
    import re

    other = sorted(set(re.findall(r"rank_results\((\d+)\)", inspect.getsource(item.function))) - {"2"})
    if other:
        raise pytest.UsageError(f"{item.nodeid} reads rank_results({other[0]}) without a `world` parameter: "
                                f'parametrize it (@pytest.mark.parametrize("world", [{other[0]}])) so that it '
                                "runs in that launch's group")


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
