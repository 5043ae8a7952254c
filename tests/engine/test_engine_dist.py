"""The fused sharded update against single-process torch.optim.SGD, on 1, 2 and 3 ranks.

3 ranks make uneven shards (odd parameter sizes, padding on the last rank) and a parameter with
fewer elements than ranks. Each multi-rank check is declared here beside its assertions (tests/ranks.py);
what the checks build and measure is tests/engine/dist_engine_checks.py.
"""
import pytest

from tests.engine import dist_engine_checks as E
from tests.ranks import assert_matches_reference, multi_rank_checks, ok
from tests.tiny import ScaledLlama, tiny_llama

TOL = 1e-6  # fp32, 3 steps
WORLDS = [1, 2, 3]
CFG, EQ = E.ds_cfg, E.equivalence
EQUIVALENCE = multi_rank_checks(
    WORLDS,
    sgd=lambda: EQ(lambda: tiny_llama(0), CFG()),
    sgd_zero_init=lambda: EQ(lambda: tiny_llama(0), CFG(), zero_init=True),
    # Each decoder layer fetched whole: its gradients arrive while the whole layer is gathered.
    sgd_per_layer=lambda: EQ(lambda: tiny_llama(0), CFG(fetch=E.PER_LAYER)),
    clip_norm_per_layer=lambda: EQ(lambda: tiny_llama(1), CFG(clip_grad_norm=0.5, fetch=E.PER_LAYER),
                                   {"clip_norm": 0.5}),
    clip_norm=lambda: EQ(lambda: tiny_llama(1), CFG(clip_grad_norm=0.5), {"clip_norm": 0.5}),
    clip_norm_recompute=lambda: EQ(lambda: tiny_llama(1), CFG(clip_grad_norm=0.5, two_pass_mode="recompute"),
                                   {"clip_norm": 0.5}),
    clip_value=lambda: EQ(lambda: tiny_llama(2), CFG(clip_grad_value=0.002), {"clip_value": 0.002}),
    weight_decay=lambda: EQ(lambda: tiny_llama(2), CFG(weight_decay=0.3), {"wd": 0.3}),
    tied=lambda: EQ(lambda: tiny_llama(6, tie=True), CFG()),
    persistent=lambda: EQ(lambda: tiny_llama(7), CFG(persist=100_000)),
    persistent_mixed=lambda: EQ(lambda: tiny_llama(7), CFG(persist=2_000, clip_grad_norm=0.5), {"clip_norm": 0.5}),
    small_param=lambda: EQ(lambda: ScaledLlama(8), CFG(), forward=E.scaled_forward),
    grad_checkpointing=lambda: EQ(lambda: tiny_llama(9), CFG(clip_grad_norm=0.5), {"clip_norm": 0.5},
                                  prepare=lambda m: m.gradient_checkpointing_enable()),
    grad_checkpointing_reentrant=lambda: EQ(
        lambda: tiny_llama(9), CFG(clip_grad_norm=0.5), {"clip_norm": 0.5},
        prepare=lambda m: m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})),
    # Built under zero.Init as from_pretrained loads it: shards go straight to host memory. Their
    # updates on the host-update thread, as on GPUs (a CPU rank updates inline by default).
    offload_param=lambda: EQ(lambda: tiny_llama(0), E.offload_cfg(clip_grad_norm=0.5, host_update="thread"),
                             {"clip_norm": 0.5}, zero_init=True),
    dropout_recompute=lambda: EQ(lambda: E.with_dropout(tiny_llama(1)),
                                 CFG(clip_grad_norm=0.5, two_pass_mode="recompute"), {"clip_norm": 0.5}, seeded=True),
    # Sharded over a group object other than the default one: the engine reduces over each
    # parameter's own ds_process_group.
    own_process_group=lambda: EQ(lambda: tiny_llama(0), CFG(clip_grad_norm=0.5), {"clip_norm": 0.5},
                                 zero_init=True, own_group=True),
)
by_name = {str(c): c for c in EQUIVALENCE}
overflow, nonfinite_loss, nonfinite_grad, max_consecutive_skips, resume_masters, device, memory = multi_rank_checks(
    WORLDS, overflow=E.check_overflow, nonfinite_loss=E.check_nonfinite_loss, nonfinite_grad=E.check_nonfinite_grad,
    max_consecutive_skips=E.check_max_consecutive_skips, resume_masters=E.check_resume_masters,
    device=E.check_device, memory=E.check_memory)
# One rank without labels is the whole step on one rank.
unlabelled_rank, = multi_rank_checks([2, 3], unlabelled_rank=E.check_unlabelled_rank)
# The precision and traffic figures need one world size.
bf16, comm_one_pass, comm_two_pass, host_update_thread = multi_rank_checks(
    [2], bf16=E.check_bf16, comm_one_pass=lambda: E.check_comm(False), comm_two_pass=lambda: E.check_comm(True),
    host_update_thread=E.check_host_update_thread)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("check", EQUIVALENCE, ids=str)
def test_matches_sgd(rank_results, world, check):
    r = ok(rank_results(world), check)
    assert_matches_reference(r, TOL, f"{check} on {world} rank(s), against SGD")


@pytest.mark.parametrize("world", WORLDS)
def test_norm_clipping_reports_exact_global_norm(rank_results, world):
    for name in ("clip_norm", "clip_norm_recompute", "persistent_mixed", "grad_checkpointing", "offload_param",
                 "dropout_recompute", "own_process_group", "clip_norm_per_layer"):
        r = ok(rank_results(world), by_name[name])
        assert r["grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-5)
        assert all(n > 0.5 for n in r["ref_grad_norm"])  # the clip was active, not a no-op


@pytest.mark.parametrize("world", WORLDS)
def test_checks_cover_the_hard_cases(rank_results, world):
    res = rank_results(world)
    persistent, mixed = ok(res, by_name["persistent"]), ok(res, by_name["persistent_mixed"])
    assert persistent["n_persistent"] == persistent["n_params"]  # all persistent
    assert 0 < mixed["n_persistent"] < mixed["n_params"]
    assert ok(res, by_name["sgd"])["n_persistent"] == 0
    # Both fetch granularities: DeepSpeed's default (per module) and one gather per decoder layer.
    assert ok(res, by_name["sgd"])["leaf_modules"] == []
    for name in ("sgd_per_layer", "clip_norm_per_layer"):
        assert ok(res, by_name[name])["leaf_modules"] == ["LlamaDecoderLayer"]
    # Sharded over a group object other than the default one: the engine reduces over each
    # parameter's own ds_process_group.
    assert ok(res, by_name["own_process_group"])["param_group_is_world"] is False


def test_zero3_param_attributes_present(rank_results):
    # The multi-rank checks built real ZeRO-3 parameters; any missing attribute fails there with
    # its name (LomoEngine.__init__ checks them: lomo_ds/runtime/ds_compat.py), so a clean sgd run
    # proves they exist.
    ok(rank_results(2), by_name["sgd"])


@pytest.mark.parametrize("world", WORLDS)
def test_overflow_skips_everywhere_and_scale_recovers(rank_results, world):
    E.assert_overflow_recovers(ok(rank_results(world), overflow))


@pytest.mark.parametrize("world", WORLDS)
def test_backward_memory_stays_within_shard_bucket_and_one_layer(rank_results, world):
    m = ok(rank_results(world), memory)
    peak = m["peak"]
    print(f"{world} rank(s): peak {peak} vs shards {m['shard_bytes']}, block {m['block_bytes']}, "
          f"full model {m['full_model_bytes']}")
    assert m["samples"] > 0
    assert peak["shard"] == m["shard_bytes"]
    assert m["peak_gathered_plus_grad"] <= 2 * m["block_bytes"], "more than one layer (+ its grads) held"
    assert peak["bucket"] <= m["bucket_bound"]
    assert peak["total"] <= m["shard_bytes"] + m["bucket_bound"] + 2 * m["block_bytes"]
    # No whole-model gradient ever: live gradients stay below a single decoder block.
    assert peak["grad"] < m["block_bytes"] < m["full_model_bytes"]


def test_stochastic_rounding_keeps_small_bf16_updates(rank_results):
    E.assert_bf16_rounding(ok(rank_results(2), bf16))


@pytest.mark.parametrize("passes", [comm_one_pass, comm_two_pass], ids=str)
def test_bytes_sent_are_the_zero3_minimum(rank_results, passes):
    r = ok(rank_results(2), passes)
    counts = r["counts"]
    per_gather = r["ring"] * r["nonpersistent_padded_bytes"]  # one all-gather of every parameter
    gathered = counts["all_gather_into_tensor"]["bytes"]
    print(passes, counts)
    # One reduce-scatter of every gradient per backward pass, no all-reduce of gradients.
    assert counts["reduce_scatter"]["bytes"] == r["expected_reduce_scatter"]
    # Before the backward, the loss agreement (3 x fp32); after the updating pass, its non-finite
    # flag (fp32: the pass's one read, agreed); two passes add the squared norm (fp64).
    assert counts["all_reduce"]["bytes"] == (12 + 8 + 4 if passes is comm_two_pass else 12 + 4)
    if passes is comm_one_pass:
        assert gathered == 2 * per_gather  # forward + backward
    else:
        # forward + two backwards; a parameter still gathered from the first backward is reused.
        assert 2 * per_gather < gathered <= 3 * per_gather


@pytest.mark.parametrize("world", WORLDS)
def test_offload_param_updates_the_shard_in_host_memory(rank_results, world):
    r = ok(rank_results(world), by_name["offload_param"])
    assert r["shard_device"] == "cpu"
    assert r["host_updates"] > 0, "memory.host_update thread: the updates must run on the host-update thread"


def test_host_update_thread_keeps_rounding_and_the_nonfinite_skip(rank_results):
    """The worker applies the same slices in the same order as the hook would: bf16 shards with
    stochastic rounding come out bit-identical; a non-finite gradient in the updating pass (after a
    clean measuring pass) is skipped on every rank with the poisoned shard untouched."""
    r = ok(rank_results(2), host_update_thread)
    assert r["bitwise_equal"] is True and r["thread_applied"] > 0
    s0, s1, s2 = r["nonfinite"]["steps"]
    assert all(s1["skipped"]) and all(s1["target_unchanged"]) and all(s1["finite"])
    assert not any(s0["skipped"]) and not any(s2["skipped"]) and all(s2["finite"])


@pytest.mark.parametrize("world", WORLDS)
def test_nonfinite_loss_on_one_rank_skips_everywhere_before_the_backward(rank_results, world):
    r = ok(rank_results(world), nonfinite_loss)
    s0, s1, s2 = r["steps"]
    assert all(s1["skipped"]), "every rank must skip the step the last rank's loss was NaN"
    assert all(s1["unchanged"]), "a skipped step must leave every shard bit-identical"
    assert not any(s0["skipped"]) and not any(s2["skipped"]) and not any(s2["unchanged"])  # trains again
    assert all(s["finite"] == [True] * world for s in r["steps"])
    assert r["skipped_steps"] == 1


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", ["one_pass", "update_pass"])
def test_nonfinite_gradient_never_reaches_a_weight(rank_results, world, case):
    r = ok(rank_results(world), nonfinite_grad)[case]
    s0, s1, s2 = r["steps"]
    assert all(s1["skipped"]) and all(s1["target_unchanged"]) and all(s1["finite"])
    assert not any(s0["skipped"]) and not any(s2["skipped"]) and all(s2["finite"])
    assert r["skipped_steps"] == 1


@pytest.mark.parametrize("world", [2, 3])
def test_rank_without_labels_contributes_a_zero_gradient_and_no_nan(rank_results, world):
    r = ok(rank_results(world), unlabelled_rank)
    assert not any(r["skipped"])
    assert r["max_abs_diff"] <= TOL
    assert r["loss"] == pytest.approx(r["ref_loss"], abs=1e-5)  # the mean over the ranks with labels
    assert r["none_labelled"] == {"skipped": True, "unchanged": True, "scale_kept": True}


@pytest.mark.parametrize("world", WORLDS)
def test_consecutive_skips_stop_the_run_with_a_clear_error(rank_results, world):
    r = ok(rank_results(world), max_consecutive_skips)
    assert r["raised_at"] == [5] * world, "the third skip in a row (steps 3, 4, 5) raises on every rank"
    assert "lomo.max_consecutive_skips" in r["message"] and "3 steps" in r["message"]


@pytest.mark.parametrize("world", WORLDS)
def test_resume_takes_fp32_masters_from_the_checkpoint(rank_results, world):
    r = ok(rank_results(world), resume_masters)
    assert r["resumed_matches"] is True
    assert "fp32 master" in r["refused"] and "fp32_master_weights" in r["refused"]


@pytest.mark.parametrize("world", WORLDS)
def test_batches_move_to_the_engine_device_and_collectives_check_theirs(rank_results, world):
    r = ok(rank_results(world), device)
    assert r["device"] == "cpu"  # DeepSpeed's CPU accelerator
    assert r["train_moves"] == ["cpu", "cpu"] and r["eval_moves"] == ["cpu", "cpu"]  # input_ids, labels
    for name, message in r["refused"].items():
        assert "on meta" in message and "test " in message, (name, message)
    assert r["trained"]
    assert r["lr"] == pytest.approx([0.05, 0.025, 0.0])  # total_steps=10 given to the engine, 0 in the config
