"""Sequence parallelism (SP 2 on 2 ranks) for every model family users fine-tune (tests/families.py),
with SGD and AdaLomo, in fp32 and bf16, against one process training on the whole rows. Long checks
(CI: LOMO_DS_LONG_TESTS=1): forty engines are more than a newcomer's suite can spend;
tests/engine/test_sequence_parallel.py keeps a sliding window and fewer key/value heads than SP in it.

Each family's tiny config carries what SP must get right in it (tests/families.py:
sequence_parallel_variant): its sliding window, 5 positions of a 12-position row, on the layers the
family windows (Mistral, Phi-3, Mixtral: all; Qwen2, Qwen3, Qwen2-MoE: some; Gemma 2 and 3: the local
ones of alternating layers); one key/value head, fewer than SP, in LLaMA, Qwen3, Gemma 2, Phi-3 and
Mixtral; tied embeddings in LLaMA and Gemma; experts in Mixtral and Qwen2-MoE.

- fp32: 3 steps of K = 2 with norm clipping that bites, the parameters against torch.optim.SGD or the
  reference AdaLomo (tests/adalomo_reference.py) within TOL; then evaluation of the trained engine (a
  padded row's loss, greedy generation) against the reference model's.
- bf16 (shards without fp32 masters, round-to-nearest write-back): step by step against the reference
  on the same bf16 weights (tests/engine/bf16_checks.py), each step from the engine's weights. The
  stochastic rounding that is the default draws per rank, so it is switched off to compare. What
  remains between the two: the whole row's bf16 gradient is one rounding of one sum, the SP group's
  the fp32 sum of two slices' bf16 gradients, and the activations differ by bf16 roundings of sums
  taken in another order, together a relative error of the gradient of a few 2^-8. Measured in bf16
  ulps of each tensor's largest weight:
  SGD: a step lr * g then carries at most 2^-6 of itself into the difference, and the rounding of a
  result near a tie one ulp: 1 + moved / 64 ulps, `moved` the step's own size in ulps.
  AdaLomo normalises each tensor's gradient by its own second moment, so a tensor whose gradient is
  rounding noise (Qwen2's key bias: softmax is invariant to it, its exact gradient is 0) takes a
  full-size step in the noise's direction on either side; per tensor, the difference stays within
  half the norm of the step (measured: up to 0.45, in the two families with attention biases).
  Dropping the sliding window (the defect these guard against) fails both: SGD 2 to 198 ulps against
  tolerances of 1.1 to 6.5, AdaLomo 0.96 to 2.1 of the step (and fp32: 6e-4 to 5e-2 against 1e-5).
"""
from __future__ import annotations

import pytest

from tests.engine import dist_sp_checks as S
from tests.families import FAMILIES, sdpa_family
from tests.ranks import LONG_TESTS, assert_matches_reference, multi_rank_checks, ok

TOL = 1e-5  # fp32, as tests/engine/test_sequence_parallel.py
ADALOMO_STEP_PART = 0.5  # bf16 AdaLomo: |difference| / |step| per tensor
WORLDS = [2] if LONG_TESTS else []
OPTIMIZERS = ("sgd", "adalomo")
DTYPES = ("fp32", "bf16")


def _check(family: str, optimizer: str, dtype: str):
    def build(seed):
        return sdpa_family(family, seed)
    if dtype == "fp32":
        return lambda: S.equivalence(2, optimizer=optimizer, build=build, evaluate=True)
    return lambda: S.bf16_steps(2, optimizer, build)


CHECKS = {(f, o, d): check for (f, o, d), check in zip(
    [(f, o, d) for f in FAMILIES for o in OPTIMIZERS for d in DTYPES],
    multi_rank_checks(WORLDS, **{f"sp_{f}_{o}_{d}": _check(f, o, d)
                                 for f in FAMILIES for o in OPTIMIZERS for d in DTYPES}), strict=True)}


@pytest.mark.long
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_whole_rows(rank_results, family, optimizer, dtype):
    r = ok(rank_results(2), CHECKS[family, optimizer, dtype])
    label = f"{family} {optimizer} {dtype}, SP 2, against one process"
    if dtype == "bf16":
        print(f"{label}: {r['max_ulps']:.2f} ulp(s), max |diff| {r['max_abs_diff']:.2e}, "
              f"|diff| / |step| {r['step_rel']:.4f}; a step moved weights up to "
              f"{r['moved_ulps']:.0f} ulps")
        assert r["dtype"] == "torch.bfloat16"
        assert r["moved_ulps"] >= 2  # the comparison is of weights that moved
        if optimizer == "sgd":
            assert r["max_ulps"] <= 1 + r["moved_ulps"] / 64
        else:
            assert r["step_rel"] <= ADALOMO_STEP_PART
        return
    assert_matches_reference(r, TOL, label)
    assert r["eval_loss"] == pytest.approx(r["ref_eval_loss"], rel=1e-5)
    assert r["replies"] == r["ref_replies"] and all(r["replies"])
