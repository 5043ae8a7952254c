"""Fixtures and hooks only (nothing imports this file): the multi-rank checks' figures, one launch
per world size; the tests that start ranks kept in one pytest-xdist worker."""
import pytest

from tests import ranks


def pytest_configure(config):
    config.addinivalue_line("markers", "ranks: the test starts several ranks itself (one xdist worker runs these)")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    # Under `pytest -n N --dist loadgroup` (make test) the single-process tests spread over the
    # workers while one worker runs every test that starts ranks: the multi-rank launches stay one
    # per world size (the rank_results cache is a worker's), and never two run at once.
    for item in items:
        if "rank_results" in getattr(item, "fixturenames", ()) or item.get_closest_marker("ranks"):
            item.add_marker(pytest.mark.xdist_group("ranks"))


@pytest.fixture(scope="session")
def rank_results(tmp_path_factory):
    """get(world): the figures of every multi-rank check declared for `world` in the collected test
    modules (tests/ranks.py), from one launch per world size, cached for the session."""
    cache: dict[int, dict] = {}

    def get(world: int) -> dict:
        if world not in cache:
            cache[world] = ranks.run_world(world, str(tmp_path_factory.mktemp(f"ranks{world}")))
        return cache[world]

    return get
