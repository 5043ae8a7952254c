"""bf16 shards without fp32 masters (the default) against a single-process reference on the same
bf16 weights (tests/engine/bf16_checks.py): SGD and AdaLomo, K = 1, 2 (and 4 with the long checks),
the reduce-scatter in fp32 and bf16, the accumulator in fp32 and bf16, clipping, and the host-update
worker, on 1, 2 and 3 ranks. A reduced slice or accumulated sum that the update overwrote and read
again (AdaLomo's three passes did: weights off by 10^5) is hundreds of ulps off; the rounding of sums
taken in another order or dtype is at most one.
"""
from __future__ import annotations

import pytest

from tests.engine import bf16_checks as B
from tests.ranks import LONG_TESTS, multi_rank_checks, ok

WORLDS = (1, 2, 3)
# One bf16 ulp: a result whose fp32 value lies within rounding error of a tie may round either way.
MAX_ULPS = 1.0
# K = 4 where the long checks run (CI): K = 2 already reads and writes the accumulator between
# micro-batches, which is where an update writing over what it reads again shows.
ACCUMULATIONS = (1, 2, 4) if LONG_TESTS else (1, 2)


def _matrix() -> dict:
    checks = {}
    for optimizer in ("adalomo", "sgd"):
        for k in ACCUMULATIONS:
            for reduce_dtype in ("fp32", "bf16"):
                for acc in (("fp32", "bf16") if k > 1 else ("fp32",)):
                    name = f"{optimizer}_k{k}_reduce_{reduce_dtype}" + (f"_acc_{acc}" if k > 1 else "")
                    checks[name] = (lambda o=optimizer, k=k, r=reduce_dtype, a=acc:
                                    B.against_reference(o, k, r, a))
        # Norm clipping (its measuring pass, or the accumulator's norm), value clipping with decay.
        checks[f"{optimizer}_k1_clip_norm"] = lambda o=optimizer: B.against_reference(o, 1, "fp32", clip_norm=0.5)
        checks[f"{optimizer}_k2_clip_norm"] = lambda o=optimizer: B.against_reference(o, 2, "fp32", clip_norm=0.5)
        checks[f"{optimizer}_k2_clip_value_decay"] = lambda o=optimizer: B.against_reference(
            o, 2, "fp32", clip_value=0.002, wd=0.1)
        # The host-update worker (what offload_param: cpu runs on an accelerator), the shards in
        # host memory, the accumulator there too.
        checks[f"{optimizer}_k2_thread_offload"] = lambda o=optimizer: B.against_reference(
            o, 2, "fp32", host_update="thread", offload=True)
        checks[f"{optimizer}_k2_thread_offload_clip"] = lambda o=optimizer: B.against_reference(
            o, 2, "fp32", host_update="thread", offload=True, clip_norm=0.5)
        checks[f"{optimizer}_k2_accumulate_on_cpu"] = lambda o=optimizer: B.against_reference(
            o, 2, "fp32", accumulate_on="cpu")
        # The CPU ranks' own transport (shared memory) in fp32.
        checks[f"{optimizer}_k2_shared_memory"] = lambda o=optimizer: B.against_reference(
            o, 2, "fp32", grad_reduction="auto")
    return checks


CHECKS = multi_rank_checks(WORLDS, **_matrix())


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("check", CHECKS, ids=str)
def test_bf16_update_matches_the_reference_on_bf16_weights(rank_results, world, check):
    r = ok(rank_results(world), check)
    print(f"{check} on {world}: {r['max_ulps']:.0f} ulp(s) from the reference, which moved up to "
          f"{r['moved_ulps']:.0f}; max |diff| {r['max_abs_diff']:.2e}")
    assert r["dtype"] == "torch.bfloat16"
    assert r["moved_ulps"] >= 10, "training must move the weights for the comparison to mean anything"
    assert r["max_ulps"] <= MAX_ULPS
