"""Fixtures only (nothing imports this file): the multi-rank checks' figures, one launch per world size."""
import pytest

from tests import ranks


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
