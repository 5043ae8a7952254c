"""GRPO: TRL's GRPOTrainer with LOMO and AdaLomo (lomo_ds.integrations.grpo).

The multi-rank checks (tests/integrations/dist_grpo_checks.py) train through LomoGRPOTrainer on real
DeepSpeed ZeRO-3 ranks with fixed completions and compare with a single-process reference: TRL's
GRPO loss on an unpartitioned copy of the starting model, torch.optim.SGD (or the reference AdaLomo),
on each window's micro-batches of every rank, with the Trainer's schedule and global-norm clipping.
"""
import pytest

from tests.integrations import dist_grpo_checks as D
from tests.ranks import multi_rank_checks, ok

TOL = 1e-5
WORLDS = [1, 2]
EQUIVALENCE = multi_rank_checks(
    WORLDS,
    grpo_lomo=lambda: D.check_equivalence("lomo"),
)


@pytest.mark.parametrize("check", EQUIVALENCE, ids=str)
@pytest.mark.parametrize("world", WORLDS)
def test_grpo_matches_reference(rank_results, world, check):
    r = ok(rank_results(world), check)
    print(f"{check} on {world}: {r}")
    assert r["max_abs_diff"] <= TOL
