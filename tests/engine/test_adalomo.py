"""AdaLomo on ZeRO-3 shards (lomo.optimizer "adalomo") against a single-process reference.

The reference (tests/adalomo_reference.py) is written from the paper and checked against the
public lomo-optim AdaLomo here; the sharded rule is checked against the reference on 1, 2 and 3
ranks (3 = uneven shards, slices starting and ending mid-row), also with memory.host_update "thread"
(offload_param cpu's path on an accelerator, run on CPU ranks: the statistics and collectives in the
hook, each shard's update on the host-update worker). Multi-rank figures come from
tests/engine/dist_adalomo_checks.py, declared as multi-rank checks here (tests/ranks.py).

Reverts checked (the engine's AdaLomo back in the hook, its state beside the shard): every "thread"
check reports 0 slices applied by the worker; the load not forgetting the worker's sums of squares:
resume_bf16_thread differs by 4e-3..8e-3; the staged u of a dropped bucket left unmasked:
thread_nonfinite writes non-finite weights.
"""
import copy
import math
from unittest import mock

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lomo_ds.config.engine_config import load_config
from lomo_ds.config.errors import ConfigError
from lomo_ds.engine.update.adalomo_math import row_pieces
from lomo_ds.planning.planner import LLAMA
from tests.adalomo_reference import ReferenceAdaLomo
from tests.engine import dist_adalomo_checks as A
from tests.engine.dist_engine_checks import PER_LAYER, nonfinite_grad_steps, offloaded, scaled_forward
from tests.ranks import assert_matches_reference, multi_rank_checks, ok
from tests.tiny import ScaledLlama, global_batch, tiny_llama

TOL = 1e-6  # fp32, 3 steps
LR = 0.05
WORLDS = [1, 2, 3]
CFG, EQ = A.adalomo_cfg, A.equivalence
EQUIVALENCE = multi_rank_checks(
    WORLDS,
    plain=lambda: EQ(lambda: tiny_llama(0), CFG()),
    plain_per_layer=lambda: EQ(lambda: tiny_llama(0), CFG(fetch=PER_LAYER)),
    clip_norm=lambda: EQ(lambda: tiny_llama(1), CFG(clip_grad_norm=0.5), clip_norm=0.5),
    clip_value=lambda: EQ(lambda: tiny_llama(2), CFG(clip_grad_value=0.002), clip_value=0.002),
    weight_decay=lambda: EQ(lambda: tiny_llama(2), CFG(weight_decay=0.3), wd=0.3),
    loss_scale=lambda: EQ(lambda: tiny_llama(3), CFG(loss_scale={"enabled": True, "initial_scale_power": 8})),
    tied=lambda: EQ(lambda: tiny_llama(6, tie=True), CFG()),
    persistent=lambda: EQ(lambda: tiny_llama(7), CFG(persist=100_000)),
    persistent_mixed=lambda: EQ(lambda: tiny_llama(7), CFG(persist=2_000, clip_grad_norm=0.5), clip_norm=0.5),
    small_param=lambda: EQ(lambda: ScaledLlama(8), CFG(), forward=scaled_forward),
    # memory.host_update "thread": what offload_param cpu runs on an accelerator, on CPU ranks. The
    # statistics, collectives and coefficients in the hook, each shard's update on the worker.
    thread=lambda: EQ(lambda: tiny_llama(0), CFG(host_update="thread")),
    thread_clip_norm_decay=lambda: EQ(lambda: tiny_llama(1), CFG(clip_grad_norm=0.5, weight_decay=0.3,
                                                                  host_update="thread"), clip_norm=0.5, wd=0.3),
    thread_offload=lambda: EQ(lambda: tiny_llama(7), offloaded(CFG(persist=2_000, host_update="thread"))),
)
by_name = {str(c): c for c in EQUIVALENCE}
THREAD = [c for c in EQUIVALENCE if str(c).startswith("thread")]
RESUME = multi_rank_checks(WORLDS, resume=lambda: A.check_resume(bf16=False),
                           resume_bf16=lambda: A.check_resume(bf16=True),
                           # Through the host-update worker (its write-back rounds into bf16), loaded
                           # into an engine that has trained and recorded sums of squares of its own.
                           resume_bf16_thread=lambda: A.check_resume(bf16=True, warm=True, host_update="thread"))
memory, = multi_rank_checks(WORLDS, memory=A.check_memory)
# Inline against the worker, bit for bit, on uneven slices that start and end mid-row.
thread_bitwise, = multi_rank_checks([3], thread_bitwise=A.check_thread_bitwise)
# The precision and traffic figures need one world size; so does the skip through the worker.
bf16, traffic, thread_nonfinite = multi_rank_checks(
    [2], bf16=A.check_bf16, traffic=A.check_traffic,
    thread_nonfinite=lambda: nonfinite_grad_steps(CFG(host_update="thread"), poison_pass=1))


def stat_floats(shapes) -> int:
    """Floats AdaLomo all-reduces per step: rows + columns of each matrix, then 2 per parameter."""
    return sum(s[0] + s[1] for s in shapes if len(s) == 2) + 2 * len(shapes)


def state_bytes(shapes, world: int, rank: int = 0) -> int:
    """State one rank holds: fp32 full rows + columns of each matrix, its slice of each vector,
    and an fp64 step count per parameter (8 bytes: 2 floats)."""
    total = 2 * len(shapes)
    for s in shapes:
        if len(s) == 2:
            total += s[0] + s[1]
        else:
            numel = math.prod(s)
            part = math.ceil(numel / world)
            total += max(0, min(part, numel - rank * part))
    return 4 * total


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize("section, key", [({"optimizer": "adam"}, "lomo.optimizer"),
                                          ({"adalomo": {"clip_threshold": 0}}, "lomo.adalomo.clip_threshold"),
                                          ({"adalomo": {"decay_rate": 0.8}}, "lomo.adalomo.decay_rate"),
                                          ({"adalomo": {"eps3": 1e-3}}, "lomo.adalomo.eps3")])
def test_bad_adalomo_config_names_the_key(section, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config({"lomo": section})


def test_adalomo_config_defaults_are_the_papers():
    lomo = load_config({"lomo": {"optimizer": "adalomo"}})[1].lomo
    a = lomo.adalomo
    assert (lomo.optimizer, a.clip_threshold, a.eps1, a.eps2, a.decay_rate) == ("adalomo", 1.0, 1e-30, 1e-3, -0.8)


# ----------------------------------------------------------------------------- pieces of a slice
@pytest.mark.parametrize("cols", [1, 7, 40])
def test_row_pieces_tile_the_slice(cols):
    rows = 9
    for start in range(0, rows * cols, 5):
        for n in (0, 1, cols - 1, cols, cols + 3, 3 * cols + 2, rows * cols - start):
            n = max(0, min(n, rows * cols - start))
            pieces = row_pieces(start, n, cols)
            assert len(pieces) <= 3
            flat = []
            for pos, row, col, k, width in pieces:
                assert pos == len(flat) and col + width <= cols and (k == 1 or (col == 0 and width == cols))
                flat += [(row + i) * cols + col + j for i in range(k) for j in range(width)]
            assert flat == list(range(start, start + n))


# ----------------------------------------------------------------------------- reference vs public code
def run_public(model, steps, **kw):
    """lomo-optim's AdaLomo as its trainer drives it: grad_norm (the measuring backward) when
    clipping by norm, then fused_backward, which updates inside the backward hooks."""
    from lomo_optim import AdaLomo

    # It puts its state on .cuda() unconditionally; this CPU has none, so that call is a no-op here.
    with mock.patch.object(torch.Tensor, "cuda", lambda self, *a, **k: self):
        opt = AdaLomo(model, lr=LR, **kw)
    for step in range(steps):
        loss = model(**global_batch(step, 1)[0]).loss
        if kw.get("clip_grad_norm"):
            opt.grad_norm(loss)
        opt.fused_backward(loss, LR)
    return model


def run_reference(model, steps, clip_grad_norm=None, clip_grad_value=None, weight_decay=0.0):
    opt = ReferenceAdaLomo(model.parameters(), LR, weight_decay=weight_decay)
    for step in range(steps):
        model.zero_grad()
        model(**global_batch(step, 1)[0]).loss.backward()
        if clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
        if clip_grad_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_grad_value)
        opt.step()
    return model


@pytest.mark.parametrize("tie, kw", [(False, {}), (False, {"clip_grad_norm": 0.5}), (False, {"weight_decay": 0.3}),
                                     (False, {"clip_grad_value": 0.002}), (True, {})],
                         ids=["plain", "clip_norm", "weight_decay", "clip_value", "tied"])
def test_reference_matches_public_adalomo(tie, kw):
    start = tiny_llama(0, tie=tie)
    public = run_public(copy.deepcopy(start), 3, **kw)
    ref = run_reference(copy.deepcopy(start), 3, **kw)
    diff = max((a - b).abs().max().item() for a, b in zip(public.parameters(), ref.parameters(), strict=True))
    moved = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), start.parameters(), strict=True))
    print(f"{kw}{' tied' if tie else ''}: max |reference - lomo_optim.AdaLomo| = {diff:.2e} after 3 steps "
          f"(largest move {moved:.2e})")
    assert diff <= TOL
    assert moved > 1000 * TOL


# ----------------------------------------------------------------------------- sharded vs reference
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("check", EQUIVALENCE, ids=str)
def test_sharded_adalomo_matches_reference(rank_results, world, check):
    r = ok(rank_results(world), check)
    assert_matches_reference(r, TOL, f"{check} on {world} rank(s), AdaLomo on ZeRO-3 (largest move "
                                     f"{r['moved']:.2e}, {r['crosses_rows']} matrices sliced mid-row)")
    assert r["moved"] > 1000 * TOL
    if world > 1:
        assert r["crosses_rows"] > 0


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("check", EQUIVALENCE, ids=str)
def test_host_update_thread_applies_every_slice_on_the_worker(rank_results, world, check):
    """With memory.host_update "thread" every update of a slice (each step, each parameter with real
    elements on the rank) is applied by the host-update worker; inline, none."""
    r = ok(rank_results(world), check)
    assert r["host_updates"] == (r["slice_updates"] if check in THREAD else 0)


@pytest.mark.parametrize("world", [3])  # the 3-rank launch's group (tests/conftest.py)
def test_host_update_thread_is_the_inline_update_bit_for_bit(rank_results, world):
    r = ok(rank_results(world), thread_bitwise)
    assert r["bitwise_equal"] is True and r["moved"] == len(list(tiny_llama(11).parameters()))
    assert r["thread_applied"] > 0


def test_host_update_thread_skips_a_nonfinite_gradient_everywhere(rank_results):
    """A gradient infinite on the last rank only, in a step whose updates the worker finishes: the
    bucket's statistics make every rank drop it (u zeroed, coefficient 0 on the device before the
    hand-over), the poisoned shard stays bit-identical, no non-finite value reaches a shard, and
    the next step trains again."""
    s0, s1, s2 = ok(rank_results(2), thread_nonfinite)["steps"]
    assert all(s1["skipped"]) and all(s1["target_unchanged"]) and all(s1["finite"])
    assert not any(s0["skipped"]) and not any(s2["skipped"]) and all(s2["finite"]) and not any(s2["target_unchanged"])


@pytest.mark.parametrize("world", WORLDS)
def test_checks_cover_persistent_parameters(rank_results, world):
    persistent, mixed = (ok(rank_results(world), by_name[n]) for n in ("persistent", "persistent_mixed"))
    assert persistent["n_persistent"] == persistent["n_params"]
    assert 0 < mixed["n_persistent"] < mixed["n_params"]
    # and both fetch granularities: per module, and each decoder layer gathered whole
    plain, per_layer = (ok(rank_results(world), by_name[n]) for n in ("plain", "plain_per_layer"))
    assert plain["leaf_modules"] == [] and per_layer["leaf_modules"] == ["LlamaDecoderLayer"]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("check", RESUME, ids=str)
def test_resume_from_shard_state_is_exact(rank_results, world, check):
    r = ok(rank_results(world), check)
    assert r["max_abs_diff"] == 0.0, "2 steps + save/load + 1 step must equal 3 uninterrupted steps bit for bit"
    assert "lm_head.weight" in r["state_keys"]
    assert (r["host_updates"] > 0) == str(check).endswith("_thread"), r["host_updates"]


@pytest.mark.parametrize("world", WORLDS)
def test_memory_tracker_counts_state(rank_results, world):
    r = ok(rank_results(world), memory)
    shapes = [tuple(p.shape) for p in tiny_llama(4).parameters()]
    print(f"{world} rank(s): AdaLomo state {r['state_bytes']} B on rank 0, parameters {r['param_bytes']} B "
          f"({r['state_bytes'] / r['param_bytes']:.2%}; rank 0's shard {r['shard_bytes']} B)")
    assert r["state_bytes"] == state_bytes(shapes, world)
    assert r["peak_state_bytes"] == r["state_bytes"]


def test_bf16_stochastic_rounding_keeps_small_updates(rank_results):
    r = ok(rank_results(2), bf16)
    print({k: (round(v["realized"], 3), round(v["rel_error"], 3)) for k, v in r.items()})
    assert all(v["dtype"] == "torch.bfloat16" for v in r.values())
    assert 0.8 <= r["fp32_master"]["realized"] <= 1.2
    assert 0.8 <= r["stochastic"]["realized"] <= 1.25
    assert r["nearest"]["realized"] < 0.5, "round-to-nearest should lose the updates below half an ulp"


def test_traffic_extra_over_lomo_is_under_one_percent(rank_results):
    r = ok(rank_results(2), traffic)
    lomo, ada = r["lomo"], r["adalomo"]
    extra = ada["total"] - lomo["total"]
    print(f"bytes sent per rank per step, 2 ranks, {r['n_params']} parameters of a LLaMA-shaped model: "
          f"LOMO {lomo['total']}, AdaLomo {ada['total']}, extra {extra} = {extra / lomo['total']:.3%} of the step, "
          f"{extra / lomo['counts']['reduce_scatter']['bytes']:.3%} of the gradient reduce-scatter")
    for op in ("all_gather_into_tensor", "reduce_scatter"):
        assert ada["counts"][op] == lomo["counts"][op]
    # Two all-reduces per bucket (one per reduce-scatter), nothing else.
    buckets = lomo["counts"]["reduce_scatter"]["calls"]
    assert ada["counts"]["all_reduce"]["calls"] == lomo["counts"]["all_reduce"]["calls"] + 2 * buckets
    shapes = [tuple(p.shape) for p in A.llama_shaped().parameters()]
    assert extra == 4 * stat_floats(shapes)  # fp32 all-reduce on 2 ranks: 2 (w-1)/w = 1 x the bytes
    assert extra / lomo["total"] < 0.01
    print(f"AdaLomo state on rank 0: {r['adalomo_state_bytes']} B = {r['adalomo_state_bytes'] / r['param_bytes']:.3%} "
          f"of the fp32 parameters, {r['adalomo_state_bytes'] / r['shard_bytes']:.3%} of the rank's shard")
    assert r["adalomo_state_bytes"] == state_bytes(shapes, 2)


# ----------------------------------------------------------------------------- LLaMA-7B..65B shapes
@pytest.mark.parametrize("size", ["7b", "13b", "30b", "65b"])
def test_state_and_traffic_for_llama_shapes(size):
    spec, gpus = LLAMA[size], {"7b": 1, "13b": 2, "30b": 4, "65b": 8}[size]
    config = LlamaConfig(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                         num_hidden_layers=spec.layers, num_attention_heads=spec.heads)
    with torch.device("meta"):
        shapes = [tuple(p.shape) for p in LlamaForCausalLM(config).parameters()]
    numel = sum(math.prod(s) for s in shapes)
    param_bytes = 2 * numel  # fp16, as the paper trains
    state = state_bytes(shapes, gpus)
    # Per step on 8 ranks: LOMO reduce-scatters every fp16 gradient once and all-gathers every
    # parameter twice (forward, backward); AdaLomo adds its fp32 all-reduces.
    w = 8
    lomo_step = 3 * (w - 1) / w * param_bytes
    extra = 2 * (w - 1) / w * 4 * stat_floats(shapes)
    print(f"LLaMA-{size}: {numel / 1e9:.2f}B parameters; AdaLomo state {state / 2**20:.1f} MiB per rank = "
          f"{state / param_bytes:.4%} of the fp16 parameters ({state / (param_bytes / gpus):.3%} of a rank's shard "
          f"on {gpus} GPU(s)); all-reduce extra {extra / lomo_step:.4%} of a LOMO step's bytes on {w} ranks")
    assert state / param_bytes < 0.001
    assert extra / lomo_step < 0.01
