"""8-bit weight shards (memory.int8_shards) through Hugging Face's Trainer and TRL's DPOTrainer.

A Trainer user turns them on as any other engine option: the DeepSpeed config given to
TrainingArguments(deepspeed=...) carries a `memory` section ({"int8_shards": true, "int8_block": B}),
which the mixin's config load (with the other engine sections) hands to the LomoEngine it builds.
What 8-bit shards cannot run with (fp32 masters, fp16, DeepSpeed's zero_quantized_* flags, a block
that is not a multiple of 8) is refused in the Trainer's constructor, naming the key, before
DeepSpeed starts.

The multi-rank checks (tests/integrations/dist_int8_trainer_checks.py) read every parameter's integers
and scales back after training and compare them with lomo_ds's engine on the same micro-batches and
with the single-process reference (dequantize, SGD in fp32, requantize with the same keyed noise).
The Trainer's loss (the token sum over the window's label tokens, times the rank count, turned back
into the micro-batch's token mean) is the engine's own up to fp32 rounding, so a weight may round to
the other integer where its value lies within an ulp of the rounding threshold: the integers are held
to the engine's and the reference's but for 1e-3 of them, and while none differs, each block's peak
127 s to 1e-6 (tests/engine/test_int8_engine.py's oracle); the rescaled blocks to within 1%. Where the
two losses agree bit for bit (K = 1, the same label count everywhere, the engine on the model's own
loss), the Trainer's integers and scales are the engine's exactly.

Revert checked: with the `memory` section dropped from the config the mixin loads, the Trainer's
engine has memory.int8_shards false (block 128) and converts none of the 21 parameters: both Trainer
checks fail. The engine and the reference are keyed by TrainingArguments.seed (0, not train.seed's
default 42): with `seed` not mapped onto train.seed, the Trainer's engine rounds with the default's
noise and both Trainer checks fail on their integers too.
"""
import pytest

from tests.integrations import dist_int8_trainer_checks as C
from tests.ranks import LONG_TESTS, multi_rank_checks, ok

trainer_int8, trainer_int8_bitwise = multi_rank_checks(
    [2], trainer_int8=C.check_trainer, trainer_int8_bitwise=lambda: C.check_trainer(k=1, masked=False, chunked=False))
# A DPO run on 8-bit shards: TRL's tokenization and the precomputed reference pass, a long check (CI).
dpo_int8 = multi_rank_checks([2], dpo_int8=C.check_dpo)[0] if LONG_TESTS else None
# Three Trainer runs and a resume: a long check (CI).
resume_int8 = multi_rank_checks([2], resume_int8=C.check_resume)[0] if LONG_TESTS else None


def _near(r: dict, what: str) -> None:
    assert "error" not in r, (what, r)
    assert r["ints"] <= 1e-3 * r["elements"], (what, r)
    if r["ints"] == 0:
        assert r["peak_diff"] <= 1e-6, (what, r)


def test_trainer_int8_matches_engine_and_reference(rank_results):
    r = ok(rank_results(2), trainer_int8)
    print(f"Trainer on 8-bit shards, 2 ranks: vs engine {r['vs_engine']}, vs reference {r['vs_reference']}; "
          f"rescaled blocks {r['rescaled']} (engine {r['engine_rescaled']}, reference {r['reference_rescaled']}); "
          f"integers moved from the start {r['moved']}")
    # The memory section reached the engine: every parameter's shard is 8-bit.
    assert r["memory"] == {"int8_shards": True, "int8_block": C.BLOCK}
    assert r["engine_seed"] == r["seed"] != 42  # TrainingArguments.seed keys the noise, not train.seed's default
    assert r["converted"] == r["params"]
    assert r["moved"] > 0  # the run trained
    assert r["saved_vs_shards"] == 0.0  # save_model's folder holds the 8-bit shards' weights
    _near(r["vs_engine"], "engine")
    _near(r["vs_reference"], "reference")
    assert r["rescaled"] > 0
    assert abs(r["rescaled"] - r["engine_rescaled"]) <= 1e-2 * r["engine_rescaled"], r
    assert abs(r["rescaled"] - r["reference_rescaled"]) <= 1e-2 * r["reference_rescaled"], r
    assert r["loss"] == pytest.approx(r["ref_loss"], abs=1e-5)
    assert r["grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-5)


def test_trainer_int8_bitwise_as_engine_where_the_losses_agree(rank_results):
    """K = 1 and every token a label: every micro-batch of every rank has the same label count, so
    the Trainer's loss (token sum / (2 x the count), times 2 ranks, times 1.0) is the micro-batch's
    token mean bit for bit, and so is every gradient where the engine computes the model's own loss
    too (memory.chunked_loss "off": its chunked loss sums in another order): the integers and the
    scales are the engine's exactly (the reference's single backward sums in another order: held to
    the tolerance)."""
    r = ok(rank_results(2), trainer_int8_bitwise)
    print(f"Trainer on 8-bit shards, K = 1, 2 ranks: vs engine {r['vs_engine']}, vs reference {r['vs_reference']}")
    assert r["converted"] == r["params"] and r["moved"] > 0
    assert r["engine_seed"] == r["seed"] != 42
    assert r["vs_engine"]["ints"] == 0 and r["vs_engine"]["peak_diff"] == 0.0, r["vs_engine"]
    assert r["rescaled"] == r["engine_rescaled"] > 0
    _near(r["vs_reference"], "reference")


@pytest.mark.long
def test_trainer_int8_resume_equals_uninterrupted(rank_results):
    """resume_from_checkpoint on 8-bit shards: the checkpoint's integers and scales (the engine
    state's layout), the scheduler and the data order restored, the run ends bit for bit where the
    uninterrupted one does.

    Revert checked: with the shard state not loaded on resume (the scheduler still is), 10425 of
    the 37480 integers differ; with a parameter's shard left out of it, the engine refuses it."""
    r = ok(rank_results(2), resume_int8)
    print(f"8-bit Trainer resumed vs uninterrupted: {r['resumed_vs_whole']}; stopped: {r['stopped_vs_whole']}")
    assert r["resumed_vs_whole"]["ints"] == 0 and r["resumed_vs_whole"]["peak_diff"] == 0.0, r
    assert r["stopped_vs_whole"]["ints"] > 0  # the stopped run is behind: the resume did the rest


@pytest.mark.long
def test_dpo_int8_matches_reference(rank_results):
    r = ok(rank_results(2), dpo_int8)
    print(f"DPO on 8-bit shards, 2 ranks: vs reference {r['vs_reference']}, reference log-probs "
          f"{r['ref_logp_diff']:.2e}, losses {r['loss']}")
    assert r["ref_logp_diff"] <= 1e-5  # the precomputed reference is the 8-bit start's
    _near(r["vs_reference"], "reference")
    assert r["moved"] > 0  # the run trained
    assert r["loss"] == pytest.approx(r["ref_loss"], abs=1e-5)
    assert r["grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-5)
    assert r["loss"][-1] != r["loss"][0]


# ----------------------------------------------------------------------------- single process: refusals
@pytest.fixture
def hf_args():
    """TrainingArguments(deepspeed=...) register their config with transformers and set accelerate's
    environment: both undone after the test (as tests/integrations/test_hf_trainer.py's fixture)."""
    import os

    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from tests.integrations import dist_hf_checks as H

    saved = dict(os.environ)

    def make(ds: dict, zero: dict, **kw):
        config = H.ds_config(**ds)
        config["zero_optimization"].update(zero)
        return H.TrainingArgumentsFor(output_dir="/tmp/unused", optim="lomo", learning_rate=0.05, report_to=[],
                                      deepspeed=config, **kw)

    yield make
    unset_hf_deepspeed_config()
    os.environ.clear()
    os.environ.update(saved)


REFUSED = [  # (engine options, zero_optimization keys, TrainingArguments fields, message)
    ({"fp32_master_weights": True}, {}, {}, r"^deepspeed: lomo.fp32_master_weights: expected false with "
                                            r"memory.int8_shards"),
    ({}, {}, {"fp16": True}, r"^fp16: expected False with the DeepSpeed config's memory.int8_shards"),
    ({}, {"zero_quantized_weights": True}, {}, r"^deepspeed: <config>: zero_optimization.zero_quantized_weights: "
                                               r".*expected false"),
    ({"int8_block": 12}, {}, {}, r"^deepspeed: <config>: memory.int8_block: .*multiple of 8"),
]


@pytest.mark.parametrize("ds,zero,fields,message", REFUSED, ids=lambda v: str(v)[:30])
def test_int8_conflicts_refused_in_constructor_before_deepspeed(hf_args, ds, zero, fields, message):
    """What 8-bit shards cannot run with: one line naming the field, from the Trainer's constructor,
    before any DeepSpeed engine exists (the engine would refuse it only once train() builds it).

    Revert checked: without the constructor's check, the fp32-masters and fp16 arguments construct
    a Trainer (refused only inside train())."""
    import torch

    from lomo_ds.integrations.training_args import TrainingArgumentsError
    from lomo_ds.runtime import ds_compat
    from tests.integrations import dist_hf_checks as H
    from tests.tiny import tiny_llama

    args = hf_args({"int8_shards": True, **ds}, zero, **fields)
    model = tiny_llama(0)
    with pytest.raises(TrainingArgumentsError, match=message) as e:
        H.lomo_trainer_class()(model=model, args=args)
    assert "\n" not in str(e.value)
    assert not ds_compat.is_zero_param(next(model.parameters())) and not torch.distributed.is_initialized()
