"""GRPO: TRL's GRPOTrainer with LOMO and AdaLomo (lomo_ds.integrations.grpo).

The multi-rank checks (tests/integrations/dist_grpo_checks.py) train through LomoGRPOTrainer on real
DeepSpeed ZeRO-3 ranks with fixed completions and compare with a single-process reference: TRL's
GRPO loss on an unpartitioned copy of the starting model, torch.optim.SGD (or the reference AdaLomo),
on each window's micro-batches of every rank, with the Trainer's schedule and global-norm clipping.

Reverts checked (1 rank, 2026-12-06):
- without the window factor in LomoGRPOTrainer.compute_loss (the engine's `mean` then divides TRL's
  already-divided loss by K again): parameters differ from the reference by 5.6e-3 (grpo, LOMO) and
  1.6e-4 (AdaLomo);
- the host reference's starting shards not swapped in (the "reference" is the live policy): the
  reference log-probs differ from the starting model's by 5.5e-2, the parameters by 5.3e-5;
- the generation batch checked against the launch's ranks but not derived again (grpo_checks): every
  2-rank check stopped, TRL having sized it for the one process accelerate saw (4, not 8).
"""
import re

import pytest

from tests.integrations import dist_grpo_checks as D
from tests.planning.test_grpo_planner import HOST_REFERENCE_SWAP  # declared with the planner's test of its bytes
from tests.ranks import LONG_TESTS, long_unless_declared, multi_rank_checks, ok

TOL = 1e-5
WORLDS = [1, 2]
# Each check's clip by world size, from the reference's pre-clip norms without one (1 rank; 2 ranks):
# grpo 1.60 1.04 1.75 1.39; 1.09 1.06 1.19 1.22. dapo 1.54 1.27 1.54 1.54; 1.04 1.03 1.07 1.06.
# adalomo 1.60 1.58 1.76 1.72; 1.09 1.08 1.19 1.20. beta 1.60 1.76 1.54 1.46; 1.09 1.19 1.10 0.98.
# spg4 1.51 1.56 1.62 1.93; 1.10 1.14 1.02 1.03. The test asserts that some steps clip and some do not.
CASES = {
    "grpo_lomo": (dict(optim="lomo", loss_type="grpo", num_iterations=2), {1: 1.5, 2: 1.15}),
    "dapo_lomo": (dict(optim="lomo", loss_type="dapo", num_iterations=2), {1: 1.4, 2: 1.05}),
    "grpo_adalomo": (dict(optim="adalomo", loss_type="grpo", num_iterations=2), {1: 1.65, 2: 1.15}),
    "beta_lomo": (dict(optim="lomo", loss_type="grpo", beta=0.5), {1: 1.55, 2: 1.09}),
    "spg4_lomo": (dict(optim="lomo", loss_type="dapo", steps_per_generation=4), {1: 1.6, 2: 1.05}),
}
# Every case on 1 rank; on 2, grpo with LOMO and the host reference in every suite, the others with
# the long checks (CI: LOMO_DS_LONG_TESTS=1): the 2-rank launch is the suite's longest.
ON_TWO = ("grpo_lomo", "beta_lomo")
EQUIVALENCE = [
    multi_rank_checks(WORLDS if name in ON_TWO or LONG_TESTS else [1],
                      **{f"grpo_{name}": lambda kw=kw, clip=clip: D.check_equivalence(clip=clip, **kw)})[0]
    for name, (kw, clip) in CASES.items()]
PAIRS = [pytest.param(world, check, marks=long_unless_declared(check, world))
         for world in WORLDS for check in EQUIVALENCE]
(REWARD_RAISES,) = multi_rank_checks([2], grpo_reward_raises=D.check_reward_raises)


@pytest.mark.parametrize(("world", "check"), PAIRS, ids=lambda v: str(v))
def test_grpo_matches_reference(rank_results, world, check):
    r = ok(rank_results(world), check)
    print(f"{check} on {world}: max |GRPO - reference| = {r['max_abs_diff']:.2e}, reference log-probs "
          f"{r['ref_logp_diff']:.2e}, old log-probs {r['old_logp_diff']:.2e}, norms {r['ref_grad_norm']}")
    assert r["wrapped"] == "DeepSpeedEngine"
    assert r["max_abs_diff"] <= TOL
    assert r["ref_logp_diff"] <= TOL and r["old_logp_diff"] <= TOL
    assert r["loss"] == pytest.approx(r["ref_loss"], abs=1e-5)
    assert r["grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-5)
    assert r["lr"] == pytest.approx(r["ref_lr"], abs=1e-12)
    clipped = [n > r["clip"] for n in r["ref_grad_norm"]]
    assert any(clipped) and not all(clipped), r["ref_grad_norm"]  # the clip acts on some steps only
    assert r["micro_batches"] == D.STEPS * D.K and r["rows_per_micro_batch"] == D.BATCH
    name = str(check)
    # One generation per generation batch: every steps_per_generation x num_iterations micro-batches.
    every = {"spg4": 4, "beta": 2}.get(name.split("_")[1], 4)
    assert r["generations"] == D.STEPS * D.K // every
    if "beta" in name:
        assert r["kl_logged"][0] == 0.0 and all(k > 0 for k in r["kl_logged"][1:])  # the reference stays put
    else:
        assert r["old_recomputed"] > 0  # old log-probs taken at generation, used later (num_iterations, spg)


def test_reward_function_error_on_every_rank(rank_results):
    r = ok(rank_results(2), REWARD_RAISES)
    assert r["raised"] == ["RewardFunctionError", "RewardFunctionError"], r
    assert "reward function 'picky_reward' raised ValueError: no 7 please" in r["message"]
    assert re.search(r"row \d+ of rank 1's generation batch, prompt '", r["message"]), r["message"]
    assert "\n" not in r["message"]


# ----------------------------------------------------------------------------- single process: the arguments
@pytest.fixture
def grpo_args(tmp_path):
    import os

    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    saved = dict(os.environ)

    def make(**kw):
        return D.grpo_config(str(tmp_path), kw.pop("optim", "lomo"), 1.0, **kw)

    yield make
    unset_hf_deepspeed_config()
    os.environ.clear()
    os.environ.update(saved)


REFUSED = [
    ({"use_vllm": True}, r"^use_vllm: vLLM is not installed"),
    ({"ds3_gather_for_generation": False}, r"^ds3_gather_for_generation: "),
    ({"beta": 0.1, "sync_ref_model": True}, r"^sync_ref_model: "),
    ({"optim": "adamw_torch"}, r"^optim: expected 'lomo' or 'adalomo'"),
    # GRPOConfig checks this against the processes accelerate saw; the trainer against the launch's ranks.
    ({"num_generations": 3}, r"^num_generations: 3 does not divide the generation batch of 4 completions"),
]


@pytest.mark.parametrize("fields,message", REFUSED, ids=lambda v: str(v)[:40])
def test_refused_before_deepspeed(grpo_args, fields, message):
    import importlib.util

    import torch

    from lomo_ds.integrations.grpo import LomoGRPOTrainer
    from lomo_ds.integrations.training_args import TrainingArgumentsError
    from lomo_ds.runtime import ds_compat
    from tests.helpers_data import chatml_tokenizer

    if "use_vllm" in fields and importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    tok = chatml_tokenizer()
    model = D.tiny_policy(len(tok))
    with pytest.raises(TrainingArgumentsError, match=message) as e:
        late = {k: fields.pop(k) for k in ("num_generations",) if k in fields}
        args = grpo_args(**fields)
        for k, v in late.items():
            setattr(args, k, v)  # as a config built for another rank count would hold it
        LomoGRPOTrainer(model=model, reward_funcs=[D.reward_mod3], args=args, train_dataset=D.prompts(8),
                        processing_class=tok)
    assert "\n" not in str(e.value)
    assert not ds_compat.is_zero_param(next(model.parameters())) and not torch.distributed.is_initialized()


def test_grpo_trainer_only_through_lomo_subclass():
    from trl import GRPOTrainer

    from lomo_ds.integrations.grpo import LomoGRPOTrainer
    from lomo_ds.integrations.training_args import TrainingArgumentsError, check_trainer_class
    from lomo_ds.integrations.transformers import LomoTrainerMixin

    with pytest.raises(TrainingArgumentsError, match=r"^GRPOTrainer: .*lomo_ds.integrations.grpo.LomoGRPOTrainer"):
        check_trainer_class(type("Mine", (LomoTrainerMixin, GRPOTrainer), {}))
    check_trainer_class(LomoGRPOTrainer)


@pytest.mark.parametrize("world", [1])
def test_host_reference_swap_orders_the_gathers_after_each_copy(rank_results, world):
    """The host reference's swap writes every shard (the starting values in, the live ones back):
    ZeRO-3's gather stream must be ordered after each set of writes, or on a GPU the reference's
    forward, and the next training forward, could gather shards half-written (a CPU records the
    order: what the shards hold each time the gathers are ordered)."""
    r = ok(rank_results(world), HOST_REFERENCE_SWAP)
    assert r["moved"] and r["restored"], r
    assert r["orders_in_block"][-1:] == ["start"], f"the forward's gathers not ordered after the starting shards: {r}"
    assert r["orders_after"][-1:] == ["trained"], f"the next gathers not ordered after the live shards' return: {r}"
