"""The gradient buckets on 1, 2 and 3 ranks, under both transports (the overlapped reduce-scatter of
the process group, and lomo's own reduce-scatter through /dev/shm for CPU ranks on one node):
equivalence with SGD, non-finite verdicts every rank agrees on, parameters without a gradient on
some ranks (experts), and the overlap itself. The multi-rank checks are declared here (tests/ranks.py);
what they build and measure is tests/comm/dist_bucket_checks.py."""
import contextlib
import functools
import io
import math

import pytest
import torch

from tests.comm import dist_bucket_checks as B
from tests.ranks import LONG_TESTS, multi_rank_checks, ok

WORLDS = [1, 2, 3]
TOL = 1e-6  # fp32, as the engine's equivalence tests
TRANSPORTS = list(B.TRANSPORTS)


def by_transport(name: str, check, worlds=WORLDS):
    """world -> the checks `check(transport=...)` runs as: under each transport on several ranks
    (name@transport), once as `name` on one rank (nothing to reduce)."""
    one = multi_rank_checks([1], **{name: check}) if 1 in worlds else []
    many = multi_rank_checks([w for w in worlds if w > 1],
                             **{f"{name}@{t}": functools.partial(check, transport=t) for t in TRANSPORTS})
    return lambda world: one if world == 1 else many


SGD = by_transport("sgd", B.check_sgd)
CLIP_NORM = by_transport("clip_norm", functools.partial(B.check_sgd, clip_norm=0.5))
NONFINITE_FP32 = by_transport("nonfinite_fp32", functools.partial(B.check_nonfinite, False))
EXPERTS = by_transport("experts", B.check_experts)
EXPERT_SEND_ORDER = by_transport("expert_send_order", B.check_expert_send_order, worlds=[2, 3])
OVERFLOW = by_transport("overflow", functools.partial(B.check_nonfinite, False, overflow=True), worlds=[2, 3])
APPLY_POINTS = by_transport("apply_points", B.check_apply_points, worlds=[2, 3])
STEP_SUMS = by_transport("step_sums", B.check_step_sums, worlds=[2, 3])
nonfinite_bf16, two_groups, transport = multi_rank_checks(
    WORLDS, nonfinite_bf16=lambda: B.check_nonfinite(True), two_groups=B.check_two_groups, transport=B.check_transport)
overlap, other_partitioning = multi_rank_checks(
    [2, 3], overlap=B.check_overlap, other_partitioning=B.check_other_partitioning_refused)

BENCH_ARGS = ["--preset", "tiny"]


def bench_step_report(extra: tuple = ()) -> dict:
    """The benchmark's printed report on a 1-layer model (rank 0's; the other ranks print nothing)."""
    from benchmarks import bench_step

    args = bench_step.parse_args(BENCH_ARGS + list(extra))
    base, times, parts, transports = bench_step.bench(args)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        if torch.distributed.get_rank() == 0:
            bench_step.report(args, base, torch.distributed.get_world_size(), times, parts, transports)
    return {"stdout": out.getvalue()}


# The benchmark with offload runs ten engines: a long check (CI).
bench_step = multi_rank_checks([2], bench_step=lambda: bench_step_report(("--offload",)))[0] if LONG_TESTS else None
(bench_step_accumulation,) = multi_rank_checks([2], bench_step_accumulation=lambda: bench_step_report(
    ("--accumulation", "2", "--engines", "floor,lomo,lomo clipped")))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("check", ["sgd", "clip_norm"])
def test_each_transport_matches_sgd(rank_results, world, check):
    for name in {"sgd": SGD, "clip_norm": CLIP_NORM}[check](world):
        r = ok(rank_results(world), name)
        print(f"{name} on {world} rank(s): max |LOMO - SGD| = {r['max_abs_diff']:.2e}")
        assert r["max_abs_diff"] <= TOL
        assert r["loss"] == pytest.approx(r["ref_loss"], abs=1e-5)
        if check == "clip_norm":
            assert r["grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-5)


@pytest.mark.parametrize("world", WORLDS)
def test_auto_transport_and_refusal(rank_results, world):
    r = ok(rank_results(world), transport)
    print(f"{world} rank(s), LOCAL_SIZE {r['local_size']}: auto -> {r['auto']}, {r['shm_bytes']} bytes shared")
    # The buffers' names are removed once every rank has them mapped, and DeepSpeed's own all-reduce
    # op (inference only) is neither built nor mapped (ds_compat.skip_shm_allreduce_op): nothing is
    # left in /dev/shm.
    assert r["shm_files_left"] == [] and not r["ds_shm_op"]
    assert r["rng_untouched"], "building the engine drew from torch's random generator"
    if world == 1:
        return
    # Here (gloo, every rank on this x86-64 node, LOCAL_SIZE set as DeepSpeed's launcher does).
    assert r["auto"] == "shared_memory" and r["shm_bytes"] > 0
    assert r["refused"] is not None and "comm.grad_reduction" in r["refused"] and "LOCAL_SIZE" in r["refused"]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_nonfinite_gradient_on_one_rank_stops_every_rank_at_that_bucket(rank_results, world, dtype):
    for name in NONFINITE_FP32(world) if dtype == "fp32" else [nonfinite_bf16]:
        check_nonfinite_verdict(ok(rank_results(world), name), world, dtype)


@pytest.mark.parametrize("world", [2, 3])
def test_a_sum_that_overflows_in_the_reduction_is_dropped(rank_results, world):
    """Finite gradients on every rank whose sum is not: rank 0, the one rank that receives it,
    drops that bucket at once, and its next flag stops every rank at the next bucket: no rank
    applies anything from it on."""
    for name in OVERFLOW(world):
        r = ok(rank_results(world), name)
        bad, every = r["bad_bucket"], r["changed_by_bucket"]
        print(f"{name}, {world} ranks: overflow in bucket {bad}; changed per bucket, rank by rank {every}")
        assert all(r["found_all_ranks"]) and all(r["finite_all_ranks"]) and not any(r["found_next_step"])
        assert all(c != 1.0 for bucket in every[0][bad:] for c in bucket), "rank 0 applies none of it"
        for rank, changed in enumerate(every):
            assert all(c != 0.0 for bucket in changed[:bad] for c in bucket), f"rank {rank}: buckets before it"
            assert all(c != 1.0 for bucket in changed[bad + 1:] for c in bucket), f"rank {rank}: buckets after it"


def check_nonfinite_verdict(r: dict, world: int, dtype: str) -> None:
    bad, every = r["bad_bucket"], r["changed_by_bucket"]
    print(f"{world} rank(s), {dtype}: inf in bucket {bad} of {r['n_buckets']}; changed per bucket, "
          f"rank by rank {every}")
    assert 0 < bad < r["n_buckets"] - 1, "the poisoned bucket should have buckets before and after it"
    assert all(r["found_all_ranks"]), "every rank must see the non-finite gradient of the last rank"
    for rank, changed in enumerate(every):
        assert all(c != 1.0 for bucket in changed[bad:] for c in bucket), \
            f"rank {rank}: that bucket and later ones are not applied"
        if dtype == "fp32":  # every fp32 update moves the weights; a small bf16 one may round away
            assert all(c != 0.0 for bucket in changed[:bad] for c in bucket), \
                f"rank {rank}: buckets before it are applied"
    assert all(r["finite_all_ranks"])
    assert not any(r["found_next_step"]), "the next backward starts clean"
    if dtype == "fp32":
        assert all(r["next_step_updates_all"])
    else:
        assert any(c == 1.0 for bucket in changed[:bad] for c in bucket), "buckets before it are applied"


@pytest.mark.parametrize("world", [2, 3])
def test_experts_buckets_go_at_the_same_point_among_the_gathers_on_every_rank(rank_results, world):
    """A parameter without a gradient on one rank must not move its bucket behind the other ranks'
    collectives (with the arrival mask reverted, the 2-rank reduce_scatter launch hangs)."""
    for name in EXPERT_SEND_ORDER(world):
        r = ok(rank_results(world), name)
        sends = r["gathers_at_send"]
        print(f"{name} on {world} rank(s): all-gathers before each send, per rank: {sends}")
        assert all(s == sends[0] for s in sends), "ranks interleave bucket sends and all-gathers differently"
        assert r["experts_flush_only"], "the experts' buckets are the last, sent at the end of the backward"


@pytest.mark.parametrize("world", WORLDS)
def test_experts_used_on_some_ranks_match_sgd(rank_results, world):
    for name in EXPERTS(world):
        r = ok(rank_results(world), name)
        print(f"{name} on {world} rank(s): max |LOMO - SGD| = {r['max_abs_diff']:.2e}")
        assert r["max_abs_diff"] <= TOL
        assert r["loss"] == pytest.approx(r["ref_loss"], abs=1e-5)


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_overlaps_the_backward(rank_results, world):
    r = ok(rank_results(world), overlap)
    later = r["later_grads_before_apply"]
    print(f"{world} ranks: gradients arrived between each bucket's last gradient and its update: {later}")
    assert len(later) == r["n_buckets"] > 2
    # A bucket is applied after later gradients came in (the backward went on meanwhile), and no
    # later than the next bucket is sent; the last one at the end of the backward.
    assert all(n >= 1 for n in later[:-1])


@pytest.mark.parametrize("world", [2, 3])
def test_buckets_are_applied_at_the_same_point_on_every_rank(rank_results, world):
    for name in APPLY_POINTS(world):
        r = ok(rank_results(world), name)
        print(f"{name} on {world} ranks, last rank slowed: gradients in when each bucket was applied {r['applied_at']}")
        assert len(r["applied_at"][0]) == r["n_buckets"] > 2
        assert all(row == r["applied_at"][0] for row in r["applied_at"])


@pytest.mark.parametrize("world", WORLDS)
def test_each_process_group_has_its_own_buckets(rank_results, world):
    r = ok(rank_results(world), two_groups)
    print(f"two process groups on {world} rank(s): max |LOMO - SGD| = {r['max_abs_diff']:.2e}")
    assert r["max_abs_diff"] <= TOL
    assert r["one_group_per_bucket"] and r["head_reduced_in_second_group"] and r["head_bucket_only_head"]


@pytest.mark.parametrize("world", [2, 3])
def test_a_group_of_another_size_is_refused(rank_results, world):
    message = ok(rank_results(world), other_partitioning)["error_message"]
    assert message is not None and "process group of 1 ranks" in message and f"over {world}" in message


@pytest.mark.long
def test_bench_step_prints_ratios_and_breakdown(rank_results):
    """The step-time benchmark that ships with the project (benchmarks/bench_step.py) runs end to
    end: a tiny model on the 2-rank launch; it proves the code runs, not how fast it is."""
    out = ok(rank_results(2), bench_step)["stdout"]
    for row in ("floor", "lomo clipped", "lomo rs", "deepspeed sgd", "-> shared_memory", "-> reduce_scatter",
                "pack", "wait at end", "update", "bookkeeping", "floor offload", "lomo offload",
                "LOMO against its floor (limit 1.10x): lomo ", "lomo offload", "offload against none: "):
        assert row in out, out
    assert ("LOMO within 1.10x its floor: OK" in out) != ("!!! LOMO ABOVE 1.10x ITS FLOOR" in out), out


def test_bench_step_flags_lomo_above_its_floor_loudly():
    """The summary's verdict: each LOMO engine of one backward against its own floor (lomo offload
    against floor offload), per-round ratios; above 1.10x, a banner naming it."""
    from benchmarks import bench_step

    times = {"floor": [1.0, 2.0, 1.0], "lomo": [1.05, 2.1, 1.0], "lomo clipped": [1.8, 3.6, 1.8],
             "floor offload": [3.0, 3.0, 3.0], "lomo offload": [3.6, 3.3, 3.9]}
    text = "\n".join(bench_step.summary(times))
    assert "LOMO against its floor (limit 1.10x): lomo 1.050x floor, lomo offload 1.200x floor offload" in text
    assert "offload against none: lomo offload 3.429x lomo, floor offload 3.000x floor" in text
    assert "!!! LOMO ABOVE 1.10x ITS FLOOR: lomo offload 1.200x floor offload\n" in text + "\n"
    assert text.startswith("LOMO against") and text.count("!" * 100) == 2 and "OK" not in text
    times["lomo offload"] = [3.1, 3.2, 3.0]
    text = "\n".join(bench_step.summary(times))
    assert "LOMO within 1.10x its floor: OK" in text and "!!!" not in text
    assert bench_step.summary({"floor": [1.0], "lomo clipped": [2.0]}) == []


def test_bench_step_with_accumulation(rank_results):
    """--accumulation K: every engine's step is K micro-batches, the floor's K floor micro-steps, and
    the report gives clipped / unclipped per round."""
    out = ok(rank_results(2), bench_step_accumulation)["stdout"]
    for row in ("2 micro-batch(es) per step", "lomo clipped / lomo:", "lomo clipped"):
        assert row in out, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [None, math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("at", [0, 7, 12])
def test_finite_checks_agree_with_isfinite(dtype, bad, at):
    """all_finite and nonfinite_marker decide from a sum what torch.isfinite(t).all() decides."""
    from lomo_ds.comm.payload import all_finite, nonfinite_marker

    t = torch.randn(13, device="cpu").mul_(100).to(dtype)
    if bad is not None:
        t[at] = bad
    want = bool(torch.isfinite(t).all())
    assert bool(all_finite(t)) == want
    marker = nonfinite_marker(t.view(1, 13)[:, :12 if at == 12 else 13])  # a strided payload view, as packed
    assert bool(torch.isnan(marker)) == (not want and at != 12)
    assert bool(torch.isnan(nonfinite_marker(t, torch.tensor(False)))) and bool(all_finite(t[:0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_finite_checks_see_opposite_infinities_and_pass_the_largest_finite_values(dtype):
    """+inf and -inf together sum to NaN (still non-finite); fp16's largest values, and 1e30 in the
    wider dtypes, summed in fp32, stay finite."""
    from lomo_ds.comm.payload import all_finite, nonfinite_marker

    t = torch.zeros(13, dtype=dtype, device="cpu")
    t[2], t[9] = math.inf, -math.inf
    assert not bool(all_finite(t)) and bool(torch.isnan(nonfinite_marker(t)))
    big = torch.full((13,), torch.finfo(dtype).max if dtype == torch.float16 else 1e30, dtype=dtype, device="cpu")
    assert bool(all_finite(big)) and float(nonfinite_marker(big)) == 0.0


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_update_known_finite_on_the_host_skips_the_masking_and_equals_the_masked_one(weight_decay, monkeypatch):
    """A bucket known finite on the host (a flag in host memory: CPU ranks) is applied without
    the masking pass, to the same weights as with the device flag; a bucket whose device flag is
    false moves nothing, NaN gradients included."""
    from lomo_ds.engine.update import PassSettings, ShardUpdater

    def params():
        out = []
        for i in range(2):
            p = torch.nn.Parameter(torch.empty(0))
            p.ds_tensor, p.ds_numel, p.ds_id = torch.linspace(-1, 1, 6, device="cpu") * (i + 1), 6, i
            out.append(p)
        return out

    grads = [torch.arange(6, dtype=torch.float32, device="cpu") - 2.5, torch.ones(6, device="cpu")]
    masks = []
    fill = torch.Tensor.masked_fill_
    monkeypatch.setattr(torch.Tensor, "masked_fill_", lambda self, *a: (masks.append(1), fill(self, *a))[1])
    results = {}
    for on_host in (False, True):
        ps, updater = params(), ShardUpdater(False, 0, torch.device("cpu"))
        stats = updater.begin_pass(PassSettings(lr=0.1, grad_scale=0.5, weight_decay=weight_decay), step=0)
        masks.clear()
        if on_host:  # the flag lives in host memory here: the update reads it
            updater.apply_bucket([(p, g.clone()) for p, g in zip(ps, grads, strict=True)], stats)
        else:  # the device flag, as on an accelerator
            for p, g in zip(ps, grads, strict=True):
                updater.apply(p, g.clone(), stats.finite)
        results[on_host] = ([p.ds_tensor.clone() for p in ps], len(masks))
    assert results[False][1] == 2 and results[True][1] == 0
    for a, b, p0 in zip(results[False][0], results[True][0], params(), strict=True):
        assert torch.equal(a, b) and not torch.equal(a, p0.ds_tensor)
    # A non-finite verdict, known on the host or only on the device, moves nothing, NaNs included;
    # after a device verdict the update takes the device flag (never reads it) even where it is true.
    for verdict in (False, torch.tensor(False), torch.tensor(True)):
        ps, updater = params(), ShardUpdater(False, 0, torch.device("cpu"))
        stats = updater.begin_pass(PassSettings(lr=0.1, weight_decay=weight_decay), step=0)
        stats.fold(verdict)
        assert (stats.finite_now() is True) is False
        if torch.is_tensor(verdict) and verdict:
            continue
        updater.apply_bucket([(p, torch.full((6,), math.nan, device="cpu")) for p in ps], stats)
        for p, p0 in zip(ps, params(), strict=True):
            assert torch.equal(p.ds_tensor, p0.ds_tensor)


@pytest.mark.parametrize("world", [2, 3])
def test_step_agreements_go_where_the_buckets_go(rank_results, world):
    """The loss, norm and verdict sums: through shared memory where the buckets reduce there (no
    all-reduce of the process group in a step: about 1 ms each through gloo), else through it;
    equal to gloo's sums, and the same bits on every rank. On CPU ranks the buckets' verdict is
    read on the host whatever the transport (its flag is host memory)."""
    for name in STEP_SUMS(world):
        r = ok(rank_results(world), name)
        shm = str(name).endswith("@shared_memory")
        assert r["step_sums"] == float(shm) and r["finite_on_host"] == float(shm)
        assert r["equal"] == 1.0 and r["same_on_every_rank"] == 1.0
        assert r["wide"] == pytest.approx(r["wide_expected"], rel=1e-15)
        # Two one-pass steps: the loss before each backward, the verdict after it.
        assert r["process_group_agreements"] == (0 if shm else 4), name


@pytest.mark.parametrize("world", [1, 2])
def test_shared_memory_named_where_ranks_cannot_use_it_is_refused_on_any_world(monkeypatch, world):
    """comm.grad_reduction "shared_memory" on ranks that cannot share memory (one GPU, NCCL) is the
    config's error, naming CPU (gloo) ranks, on one rank as on several: not a device error from the
    transport's first use."""
    from lomo_ds.comm import grad, shm_reduce_scatter

    monkeypatch.setattr(shm_reduce_scatter, "available", lambda group: False)  # NCCL ranks
    groups = [None]
    with pytest.raises(ValueError, match=r"comm.grad_reduction: 'shared_memory' needs CPU \(gloo\) ranks"):
        grad.resolve_grad_route("shared_memory", groups, world)
    assert grad.resolve_grad_route("auto", groups, world) == ("direct" if world == 1 else "reduce_scatter")
    assert grad.resolve_grad_route("reduce_scatter", groups, world) is grad.GradRoute.REDUCE_SCATTER
    monkeypatch.setattr(shm_reduce_scatter, "available", lambda group: True)  # CPU ranks of one node
    assert grad.resolve_grad_route("shared_memory", groups, world) is grad.GradRoute.SHARED_MEMORY
    with pytest.raises(ValueError, match="comm.grad_reduction: expected one of"):
        grad.resolve_grad_route("shm", groups, world)
