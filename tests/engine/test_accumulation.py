"""Gradient accumulation on shards against single-process references, on 1, 2 and 3 ranks.

K micro-batches on N ranks must equal torch.optim.SGD (or the reference AdaLomo) stepping once on
the concatenated K x N global batch. What the checks build and measure is
tests/engine/dist_accumulation_checks.py; they are declared here (tests/ranks.py runs them in one launch
per world size).

Reverts checked (each made temporarily in lomo_engine.py, then these checks run on 2 ranks):
- the 1/K scaling dropped (the step divided by N only): sgd, persistent, short_window fail (max |diff|
  6.5e-3, 7.1e-3, 7.6e-3); clip_norm's parameters still match (clipping to the same norm hides a
  scale) but its reported norm is K times the reference's, which the norm test catches; AdaLomo
  is invariant to a gradient's scale by construction.
- the accumulator zeroed at the start of the window's last micro-batch: sgd, clip_norm, tokens,
  adalomo fail (3.5e-3, 1.6e-3, 3.2e-3, 4.3e-2).
- token normalisation weighing micro-batches by their mean: tokens fails (4.5e-3).
"""
import pytest

from tests.engine import dist_accumulation_checks as A
from tests.engine.dist_engine_checks import offloaded
from tests.ranks import assert_matches_reference, multi_rank_checks, ok
from tests.tiny import tiny_llama

K, EQ, CFG = A.K, A.equivalence, A.acc_cfg

TOL = 1e-5  # the required bound on max |param diff|; measured differences are ~1e-8 (SGD), ~1e-7 (AdaLomo)
WORLDS = [1, 2, 3]
EQUIVALENCE = multi_rank_checks(
    WORLDS,
    sgd=lambda: EQ(lambda: tiny_llama(0), CFG()),
    clip_norm=lambda: EQ(lambda: tiny_llama(1), CFG(clip_grad_norm=0.5), clip_norm=0.5),
    clip_value=lambda: EQ(lambda: tiny_llama(2), CFG(clip_grad_value=0.002), clip_value=0.002),
    tied=lambda: EQ(lambda: tiny_llama(6, tie=True), CFG()),
    tied_clip_norm=lambda: EQ(lambda: tiny_llama(6, tie=True), CFG(clip_grad_norm=0.5), clip_norm=0.5),
    persistent=lambda: EQ(lambda: tiny_llama(7), CFG(persist=100_000)),
    persistent_clip_norm=lambda: EQ(lambda: tiny_llama(7), CFG(persist=2_000, clip_grad_norm=0.5), clip_norm=0.5),
    tokens=lambda: EQ(lambda: tiny_llama(4), CFG(loss_normalization="tokens"), tokens=True),
    short_window=lambda: EQ(lambda: tiny_llama(5), CFG(), windows=[K, 2, 1, K]),
    adalomo=lambda: EQ(lambda: tiny_llama(0), A.adalomo_acc_cfg(), adalomo=True),
    adalomo_clip_norm=lambda: EQ(lambda: tiny_llama(1), A.adalomo_acc_cfg(clip_grad_norm=0.5), adalomo=True,
                                 clip_norm=0.5),
)
by_name = {str(c): c for c in EQUIVALENCE}
CLIPPED = [by_name[n] for n in ("clip_norm", "tied_clip_norm", "persistent_clip_norm", "adalomo_clip_norm")]
NONFINITE = multi_rank_checks(
    WORLDS,
    nonfinite_grad_fused=lambda: A.check_nonfinite(CFG(), poison_micro=1),
    nonfinite_grad_one_pass=lambda: A.check_nonfinite(CFG(clip_grad_norm=1e9), poison_micro=2),
)
# Bookkeeping that does not depend on the shard layout: on 2 ranks.
(nonfinite_loss, overflow_scale, loss_scale, tokens_clip_norm, accumulate_on_cpu, low_precision, resume,
 start_window_misuse, offload_host_thread, adalomo_host_thread, adalomo_clip_norm_host_thread,
 token_seed_single, token_seed_window) = multi_rank_checks(
    [2],
    nonfinite_loss=lambda: A.check_nonfinite(CFG(), poison_micro=1, when_loss=True),
    overflow_scale=lambda: A.check_nonfinite(CFG(loss_scale={"enabled": True, "initial_scale_power": 8}),
                                             poison_micro=0),
    loss_scale=lambda: EQ(lambda: tiny_llama(3), CFG(loss_scale={"enabled": True, "initial_scale_power": 8})),
    tokens_clip_norm=lambda: EQ(lambda: tiny_llama(4), CFG(loss_normalization="tokens", clip_grad_norm=0.5),
                                tokens=True, clip_norm=0.5),
    accumulate_on_cpu=lambda: EQ(lambda: tiny_llama(0), CFG(accumulate_on="cpu", clip_grad_norm=0.5), clip_norm=0.5),
    low_precision=A.check_low_precision_accumulator,
    resume=A.check_resume,
    start_window_misuse=A.check_start_window_misuse,
    # offload_param with the host-update thread: the K-1 adds and the fused K-th update on the worker.
    offload_host_thread=lambda: EQ(lambda: tiny_llama(7), offloaded(CFG(persist=2_000, host_update="thread"))),
    # AdaLomo with the host-update thread: the adds on the worker, then the update's host part,
    # fused into the K-th backward or (norm clipping) in the one pass after it.
    adalomo_host_thread=lambda: EQ(lambda: tiny_llama(0), A.adalomo_acc_cfg(host_update="thread"), adalomo=True),
    adalomo_clip_norm_host_thread=lambda: EQ(lambda: tiny_llama(1), A.adalomo_acc_cfg(clip_grad_norm=0.5,
                                                                                     host_update="thread"),
                                             adalomo=True, clip_norm=0.5),
    token_seed_single=lambda: A.check_token_seed(1),
    token_seed_window=lambda: A.check_token_seed(K),
)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("check", EQUIVALENCE, ids=str)
def test_accumulated_step_matches_the_concatenated_batch(rank_results, world, check):
    r = ok(rank_results(world), check)
    # The loss a step reports is the window's, as the reference computes it (mean or token mean).
    assert_matches_reference(r, TOL, f"{check} on {world} rank(s), K = {K}")
    # DeepSpeed's convention: a step every K-th call, announced by is_gradient_accumulation_boundary.
    for calls in r["calls"]:
        assert [c["stepped"] for c in calls] == [False] * (len(calls) - 1) + [True]
        assert [c["boundary_before"] for c in calls] == [c["stepped"] for c in calls]
    assert r["global_step"] == len(r["calls"])


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("check", CLIPPED, ids=str)
def test_norm_clipping_with_accumulation_uses_the_exact_global_norm(rank_results, world, check):
    """The norm of the accumulated gradient, from one all-reduce of per-rank sums of squares after
    the K-th backward (no second backward): torch's clip_grad_norm_ on the whole window's gradient."""
    r = ok(rank_results(world), check)
    assert r["grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-5)
    assert all(n > 0.5 for n in r["ref_grad_norm"])  # the clip was active
    assert not r["fused"]


@pytest.mark.parametrize("world", WORLDS)
def test_checks_cover_the_hard_cases(rank_results, world):
    r = {name: ok(rank_results(world), check) for name, check in by_name.items()}
    assert r["persistent"]["n_persistent"] == r["persistent"]["n_params"]  # every parameter persistent
    assert 0 < r["persistent_clip_norm"]["n_persistent"] < r["persistent_clip_norm"]["n_params"]
    assert r["sgd"]["fused"] and r["tokens"]["fused"]  # the update rides on the K-th backward
    # A window shortened by start_window (an epoch's end): 3, 2, 1, 3 micro-batches, each its own mean.
    assert [len(c) for c in r["short_window"]["calls"]] == [K, 2, 1, K]
    # The accumulator holds this rank's real shard elements only, in fp32: 1/N of the model.
    sgd = r["sgd"]
    assert sgd["accumulator_bytes"] == 4 * sgd["local_elements"]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", NONFINITE, ids=str)
def test_nonfinite_gradient_in_any_micro_batch_skips_the_whole_step(rank_results, world, case):
    """A non-finite gradient on the last rank in micro-batch 2 (fused) or 3 (one pass) of window 1:
    every rank skips the whole step, every shard bit-identical and finite, counted once; the run
    then equals SGD on the other windows alone."""
    r = ok(rank_results(world), case)
    clean, poisoned, after = r["steps"]
    assert poisoned["skipped"] == [True] * world and poisoned["unchanged"] == [True] * world
    assert clean["skipped"] == after["skipped"] == [False] * world
    assert all(all(s["finite"]) for s in r["steps"])
    assert r["skipped_steps"] == 1 and r["consecutive_skips"] == 0 and r["global_step"] == 3
    assert r["max_abs_diff"] <= TOL


def test_nonfinite_loss_and_fp16_overflow_span_the_window(rank_results):
    r = rank_results(2)
    loss = ok(r, nonfinite_loss)
    assert loss["steps"][1]["skipped"] == [True, True] and loss["steps"][1]["unchanged"] == [True, True]
    assert loss["skipped_steps"] == 1 and loss["max_abs_diff"] <= TOL
    # Loss scaling: one scale for the whole window; an overflow in its first micro-batch skips the
    # step and halves the scale once.
    scale = ok(r, overflow_scale)
    assert [s["loss_scale"] for s in scale["steps"]] == [256.0, 256.0, 128.0] and scale["scale_after"] == 128.0
    assert scale["steps"][1]["skipped"] == [True, True] and scale["max_abs_diff"] <= TOL
    assert ok(r, loss_scale)["max_abs_diff"] <= TOL
    tokens = ok(r, tokens_clip_norm)
    assert tokens["max_abs_diff"] <= TOL and tokens["grad_norm"] == pytest.approx(tokens["ref_grad_norm"], rel=1e-5)


def test_accumulator_placement_and_precision(rank_results):
    r = rank_results(2)
    on_cpu = ok(r, accumulate_on_cpu)
    assert on_cpu["max_abs_diff"] <= TOL and on_cpu["accumulator_device"] == "cpu"
    low = ok(r, low_precision)
    # bf16 sums round to 8 bits of mantissa: close to, not equal to, the fp32 accumulator's result.
    assert low["bf16"]["fused"] and low["bf16"]["max_abs_diff"] < 1e-4
    assert low["bf16"]["accumulator_bytes"] == 2 * low["bf16"]["local_elements"]
    # fp16 sums may overflow where no micro-batch did: the one-pass mode's norm sees it.
    assert not low["fp16"]["fused"] and low["fp16"]["max_abs_diff"] < 1e-4
    # Offloaded shards with the host-update thread (mixed persistence): the worker adds the K-1
    # micro-batches and applies the fused K-th update; the result is SGD's on the window.
    offload = ok(r, offload_host_thread)
    assert offload["max_abs_diff"] <= TOL and offload["fused"] and offload["host_updates"] > 0
    assert 0 < offload["n_persistent"] < offload["n_params"]
    # AdaLomo: every slice of every micro-batch through the worker, the update's host part too (the
    # fused K-th backward's fold, or one pass after K adding backwards).
    for check, fused in ((adalomo_host_thread, True), (adalomo_clip_norm_host_thread, False)):
        ada = ok(r, check)
        assert ada["max_abs_diff"] <= TOL and ada["fused"] is fused
        assert ada["host_updates"] == A.STEPS * (K if fused else K + 1) * ada["slices"], (check, ada["host_updates"])


def test_checkpoints_only_at_step_boundaries_and_resume_exactly(rank_results):
    r = ok(rank_results(2), resume)
    assert "checkpoint at a step boundary" in r["refused"]
    assert r["resumed_matches"] is True and r["global_step"] == [3, 3]
    misuse = ok(rank_results(2), start_window_misuse)
    assert "expected 1..3 micro-batches, got 4" in misuse["too_long"]
    assert "before a window's first micro-batch" in misuse["mid_window"]


class _LateCopy:
    """A device copy that reads its host source only when the device gets to it: when waited for,
    or when the test lets the device run on (complete); what an asynchronous host-to-device copy
    queued behind other work does."""

    def __init__(self, src, out):
        self.src, self.out, self.done = src, out, False

    def query(self):
        return self.done

    def synchronize(self):
        self.complete()

    def complete(self):
        if not self.done:
            self.out.copy_(self.src)
            self.done = True


def test_host_accumulator_is_zeroed_only_after_the_device_has_read_it(monkeypatch):
    """accumulate_on cpu without fusion (norm clipping, fp16): the step reads the pinned sums with
    copies the device runs later, then the window ends with zero(). zero() must wait for those
    copies, or the device reads zeros or a partial sum. Here the copies read their source only when
    waited for or when the test lets them run after zero() has returned; without the wait in zero()
    the step sees zeros."""
    import torch

    from lomo_ds.engine import accumulation
    from lomo_ds.runtime import ds_compat

    params = [torch.nn.Parameter(torch.zeros(6)), torch.nn.Parameter(torch.zeros(4))]
    monkeypatch.setattr(ds_compat, "shard", lambda p: p.data)
    monkeypatch.setattr(ds_compat, "param_id", id)
    copies = []

    def late_read(buf, device):
        out = torch.empty(buf.shape, dtype=torch.float32)
        copies.append(_LateCopy(buf, out))
        return out, copies[-1]

    monkeypatch.setattr(accumulation, "read_async", late_read)
    acc = accumulation.ShardAccumulator(params, lambda p: p.numel(), torch.float32, on_host=True)
    for i, p in enumerate(params):
        acc.add(p, torch.arange(p.numel(), dtype=torch.float32) + i)
    device = torch.device("meta")  # anything but the buffers' device: the copy path
    totals = [acc.lazy_total(p, device).chunk(0, p.numel(), device) for p in params]  # as the update reads them
    acc.zero()
    for c in copies:
        c.complete()  # the device runs the copies now, if nobody waited for them
    for i, (p, t) in enumerate(zip(params, totals, strict=True)):
        assert torch.equal(t, torch.arange(p.numel(), dtype=torch.float32) + i), "the step read a zeroed buffer"
    assert all(not b.any() for b in acc.buffers.values())


def test_host_accumulator_adds_finished_copies_without_waiting(monkeypatch):
    """Slices copied to the host are added once their copies are done, polled at later buckets
    (event.query), never waited for inside the backward unless too many bytes are in flight."""
    import torch

    from lomo_ds.engine import accumulation
    from lomo_ds.runtime import ds_compat

    class Copy:
        def __init__(self):
            self.done, self.waited = False, 0

        def query(self):
            return self.done

        def synchronize(self):
            self.waited += 1
            self.done = True

    events = []
    monkeypatch.setattr(accumulation, "record_event", lambda device: events.append(Copy()) or events[-1])
    monkeypatch.setattr(ds_compat, "shard", lambda p: p.data)
    monkeypatch.setattr(ds_compat, "param_id", id)
    params = [torch.nn.Parameter(torch.zeros(8)) for _ in range(3)]
    acc = accumulation.ShardAccumulator(params, lambda p: p.numel(), torch.float32, on_host=True)
    # Device slices: a "meta" slice is not on the buffer's device, so add() stages a copy.
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: torch.ones(self.shape))
    for p in params:
        acc.add(p, torch.empty(8, device="meta"))
    assert len(acc._pending) == 3 and not any(e.waited for e in events)
    events[0].done = True
    acc.add(params[0], torch.empty(8, device="meta"))
    assert len(acc._pending) == 3 and not any(e.waited for e in events), "a finished copy is added, none waited"
    monkeypatch.setattr(accumulation, "MAX_PENDING_BYTES", 8 * 4)
    acc.add(params[1], torch.empty(8, device="meta"))
    assert sum(e.waited for e in events) >= 1, "past the in-flight bound the oldest copy is waited for"
    acc.settle()
    assert not acc._pending and acc.buffer(params[0]).tolist() == [2.0] * 8


@pytest.mark.parametrize("check", [token_seed_single, token_seed_window], ids=str)
def test_token_normalised_backward_is_seeded_near_the_loss_scale(rank_results, check):
    """loss_normalization tokens under loss scaling: SGD's result on the token mean (clipping on),
    and no backward seeded with more than a few times the loss scale, however many label tokens a
    micro-batch has (each rank's token sum is weighted by a power of two near 1 / the mean)."""
    r = ok(rank_results(2), check)
    assert r["max_abs_diff"] <= TOL and not r["skipped"]
    for got, want in r["norms"]:
        assert got == pytest.approx(want, rel=1e-5)
    assert r["min_tokens"] >= 8, "the check needs micro-batches of many label tokens"
    assert r["max_seed_over_scale"] <= 2 * 2, r  # tokens / mean tokens per rank, times < 2 for the power of two
