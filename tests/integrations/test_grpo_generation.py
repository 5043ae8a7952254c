"""LomoGRPOTrainer's completions come from TRL's own sampling on the gathered ZeRO-3 model, and
equal an unpartitioned model's with the engine's current weights and the same random state, at
each generation batch (tests/integrations/dist_grpo_generation_checks.py). On 2 ranks in the
newcomer's suite (two steps of a tiny model); 1 and 3 ranks are long checks."""
from __future__ import annotations

import pytest

from tests.integrations.dist_grpo_generation_checks import check_generation
from tests.ranks import LONG_TESTS, multi_rank_checks, ok

(GENERATION,) = multi_rank_checks([1, 2, 3] if LONG_TESTS else [2], grpo_generation=check_generation)


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.long), 2, pytest.param(3, marks=pytest.mark.long)])
def test_trl_generation_on_the_engine_samples_as_the_plain_model_with_its_weights(rank_results, world):
    r = ok(rank_results(world), GENERATION)
    assert r["weights_moved"] > 0, "the first step did not update the weights: the second batch proves nothing"
    for rank, batches in enumerate(r["per_rank"]):
        assert len(batches) == r["steps"], (rank, batches)  # one generation batch a step
        for i, b in enumerate(batches):
            assert b["do_sample"] and b["rows"] > 0, b
            assert b["same"], f"rank {rank}, generation batch {i}: the engine sampled other tokens than the " \
                              f"plain model with the engine's weights"
    # The starting weights must sample otherwise at the second batch on some rank, or a stale gather
    # (generation from the weights before the update) would pass.
    assert any(batches[1]["stale_differs"] for batches in r["per_rank"]), r
