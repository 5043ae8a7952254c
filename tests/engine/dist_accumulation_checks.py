"""What the multi-rank gradient accumulation checks build and measure; tests/engine/test_accumulation.py
declares them (tests/ranks.py runs them in one launch per world size) and asserts on rank 0's
figures. The reference is single-process:
torch.optim.SGD (or the reference AdaLomo) stepping once on the whole window, the K micro-batches
of every rank concatenated, with the loss normalised as the engine's train.loss_normalization says.
"""
from __future__ import annotations

import copy
import io

import torch

import lomo_ds
from lomo_ds.runtime import ds_compat
from tests.adalomo_reference import ReferenceAdaLomo
from tests.engine.dist_engine_checks import (
    LR,
    ds_cfg,
    host_updates_applied,
    max_diff,
    on_every_rank,
    poison_grad_hook,
    raw_shards,
)
from tests.tiny import global_batch, tiny_llama

K = 3  # micro-batches per step
STEPS = 2  # optimizer steps (windows) per check
ADALOMO_LR = 0.01  # see tests/engine/dist_adalomo_checks.py


def window_batches(step: int, world: int, k: int = K, uneven: bool = False) -> list[list[dict]]:
    """Step `step`'s window: k global micro-batches of `world` micro-batches each. uneven: label
    masks of different lengths per micro-batch and rank (the case token normalisation is for)."""
    window = [global_batch(step * K + i, world) for i in range(k)]
    if uneven:
        for i, mbs in enumerate(window):
            for r, mb in enumerate(mbs):
                cut = (3 * i + 5 * r + step) % 9
                mb["labels"][0, :cut] = -100
                mb["labels"][1, :cut // 2] = -100
    return window


def label_count(mb: dict) -> int:
    return int((mb["labels"][..., 1:] != -100).sum())


def reference_loss(ref, window: list[list[dict]], tokens: bool) -> torch.Tensor:
    """The window's loss: the mean over its k x world micro-batches of each one's token mean, or
    (tokens) the sum of every label token's loss over all of them divided by their count."""
    mbs = [mb for step_mbs in window for mb in step_mbs]
    if tokens:
        return sum(ref(**mb).loss * label_count(mb) for mb in mbs) / sum(map(label_count, mbs))
    return sum(ref(**mb).loss for mb in mbs) / len(mbs)


def reference_window(ref, opt, window, tokens=False, clip_norm=None, clip_value=None) -> tuple[float, float | None]:
    opt.zero_grad() if hasattr(opt, "zero_grad") else ref.zero_grad()
    loss = reference_loss(ref, window, tokens)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip_norm).item() if clip_norm is not None else None
    if clip_value is not None:
        torch.nn.utils.clip_grad_value_(ref.parameters(), clip_value)
    opt.step()
    return loss.item(), norm


def run_window(engine, window) -> list[dict]:
    """Feed this rank's micro-batches of one window; each call's result, with the boundary flag
    the engine announced before it."""
    outs = []
    for mbs in window:
        before = engine.is_gradient_accumulation_boundary()
        out = engine.train_step(mbs[engine.rank])
        outs.append({"boundary_before": before, "stepped": out["stepped"], "loss": out["loss"],
                     "grad_norm": out["grad_norm"], "skipped": out["skipped"]})
    return outs


def equivalence(make_model, cfg, adalomo=False, tokens=False, clip_norm=None, clip_value=None, windows=None,
                steps=STEPS) -> dict:
    """LOMO with accumulation_steps K against one reference step per window. `windows`: the
    micro-batch count of each window (default K each); a shorter one goes through start_window."""
    ref = make_model()
    engine = lomo_ds.initialize(copy.deepcopy(ref), cfg)
    world = engine.world
    opt = ReferenceAdaLomo(ref.parameters(), ADALOMO_LR) if adalomo else torch.optim.SGD(ref.parameters(), lr=LR)
    windows = windows or [K] * steps
    record = {"loss": [], "ref_loss": [], "grad_norm": [], "ref_grad_norm": [], "calls": []}
    for step, k in enumerate(windows):
        window = window_batches(step, world, k, uneven=tokens)
        if k < engine.accumulation_steps:
            engine.start_window(k)
        calls = run_window(engine, window)
        rl, rn = reference_window(ref, opt, window, tokens, clip_norm, clip_value)
        record["calls"].append(calls)
        record["loss"].append(calls[-1]["loss"]), record["grad_norm"].append(calls[-1]["grad_norm"])
        record["ref_loss"].append(rl), record["ref_grad_norm"].append(rn)
    record.update(max_abs_diff=max_diff(engine, ref), global_step=engine.global_step,
                  host_updates=host_updates_applied(engine),
                  n_persistent=len(engine.offload.persistent_parameters), n_params=len(engine.params),
                  accumulator_bytes=engine.accumulator.nbytes(),
                  accumulator_device=str(next(iter(engine.accumulator.buffers.values())).device),
                  local_elements=sum(engine.updater.geometry(p).local for p in engine.params),
                  slices=sum(1 for p in engine.params if engine.updater.geometry(p).local),
                  fused=engine.fused_accumulation)
    return record


def acc_cfg(persist=0, **lomo):
    return ds_cfg(persist=persist, accumulation_steps=K, **lomo)


def adalomo_acc_cfg(**lomo):
    cfg = acc_cfg(optimizer="adalomo", **lomo)
    cfg["lomo"]["lr"] = ADALOMO_LR
    return cfg


def check_nonfinite(cfg, poison_micro: int, when_loss: bool = False) -> dict:
    """Window 1 has a non-finite gradient (or loss) on the last rank in micro-batch `poison_micro`
    only: the whole step is skipped on every rank with every shard bit-identical, counted once;
    windows 0 and 2 train, and the result equals SGD on windows 0 and 2 alone."""
    ref = tiny_llama(3)
    engine = lomo_ds.initialize(copy.deepcopy(ref), cfg)
    world, rank = engine.world, engine.rank
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    state = {"window": -1, "micro": -1}

    def poisoned():
        return state["window"] == 1 and state["micro"] == poison_micro

    if when_loss:
        engine.module.model.embed_tokens.register_forward_hook(
            lambda m, i, out: out * float("nan") if poisoned() and rank == world - 1 else out)
    else:
        poison_grad_hook(engine.module.model.layers[0].mlp.down_proj.weight, poisoned)
    record = []
    for step in range(3):
        window = window_batches(step, world)
        before = raw_shards(engine)
        outs = []
        for i, mbs in enumerate(window):
            state.update(window=step, micro=i)
            outs.append(engine.train_step(mbs[rank]))
        unchanged = all(torch.equal(a, b) for a, b in zip(before, raw_shards(engine), strict=True))
        finite = all(bool(torch.isfinite(ds_compat.shard(p)[:engine.updater.geometry(p).local]).all())
                     for p in engine.params)
        verdict = on_every_rank(outs[-1]["skipped"], unchanged, finite)
        record.append({"skipped": [bool(v[0]) for v in verdict], "unchanged": [bool(v[1]) for v in verdict],
                       "finite": [bool(v[2]) for v in verdict], "stepped": [o["stepped"] for o in outs],
                       "loss_scale": outs[-1]["loss_scale"]})
        if step != 1:
            reference_window(ref, opt, window)
    return {"steps": record, "skipped_steps": engine.skipped_steps, "consecutive_skips": engine.consecutive_skips,
            "global_step": engine.global_step, "max_abs_diff": max_diff(engine, ref),
            "scale_after": engine.loss_scaler.scale if engine.loss_scaler else None}


def check_resume() -> dict:
    """A checkpoint is refused mid-window; written at a boundary (the accumulator is then empty)
    and loaded into a fresh engine, the next window is bit-identical to the uninterrupted run's."""
    cfg = acc_cfg(clip_grad_norm=0.5)
    straight = lomo_ds.initialize(tiny_llama(11), cfg)
    world, rank = straight.world, straight.rank
    run_window(straight, window_batches(0, world))
    straight.train_step(window_batches(1, world)[0][rank])  # one micro-batch into window 1
    try:
        straight.shard_state_dict()
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    run_window(straight, window_batches(1, world)[1:])
    buf = io.BytesIO()
    torch.save(straight.shard_state_dict(), buf)
    run_window(straight, window_batches(2, world))
    buf.seek(0)
    resumed = lomo_ds.initialize(tiny_llama(11), copy.deepcopy(cfg))
    resumed.load_shard_state_dict(torch.load(buf, weights_only=False))
    run_window(resumed, window_batches(2, world))
    a, b = straight.full_state_dict(), resumed.full_state_dict()
    same = None if rank else all(torch.equal(a[k], b[k]) for k in a)
    return {"refused": refused, "resumed_matches": same, "global_step": [straight.global_step, resumed.global_step]}


def check_start_window_misuse() -> dict:
    engine = lomo_ds.initialize(tiny_llama(0), acc_cfg())
    errors = {}
    for name, call in {"too_long": lambda: engine.start_window(K + 1),
                       "mid_window": lambda: (engine.train_step(global_batch(0, engine.world)[engine.rank]),
                                              engine.start_window(1))}.items():
        try:
            call()
            errors[name] = ""
        except (ValueError, RuntimeError) as e:
            errors[name] = str(e)
    return errors


def check_low_precision_accumulator() -> dict:
    """A bf16 accumulator: within bf16's rounding of the fp32 one's result; an fp16 one runs the
    one-pass mode (its sum may overflow where no micro-batch did: the pass's norm sees it)."""
    out = {}
    for dtype in ("bf16", "fp16"):
        r = equivalence(lambda: tiny_llama(0), acc_cfg(accumulate_dtype=dtype))
        out[dtype] = {"max_abs_diff": r["max_abs_diff"], "fused": r["fused"],
                      "accumulator_bytes": r["accumulator_bytes"], "local_elements": r["local_elements"]}
    return out


def check_token_seed(k: int) -> dict:
    """loss_normalization "tokens" with loss scaling and norm clipping, windows of `k`: the result
    is SGD's on the token mean, and what each backward is seeded with stays near the loss scale
    (a token sum seeded as tokens x scale overflows fp16 for log2(tokens) halvings of the scale).
    Records the largest seed / (loss x loss scale) and the label tokens per micro-batch and rank."""
    cfg = ds_cfg(accumulation_steps=k, loss_normalization="tokens", clip_grad_norm=0.5,
                 loss_scale={"enabled": True, "initial_scale_power": 16})
    ref = tiny_llama(4)
    engine = lomo_ds.initialize(copy.deepcopy(ref), cfg)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    seeds, raw = [], []
    weigh, backward = engine.loss_weights.backward_loss, engine._backward

    def weighed(loss, labelled, tokens, loss_scale, per_token=1.0):
        raw.append(float(loss.detach()) if labelled else None)
        return weigh(loss, labelled, tokens, loss_scale, per_token)

    def seeded(seed, *args, **kwargs):  # what the backward starts from, loss scale included
        if raw[-1] is not None:
            seeds.append(float(seed.detach()) / (raw[-1] * engine.loss_scaler.scale))
        return backward(seed, *args, **kwargs)

    engine.loss_weights.backward_loss, engine._backward = weighed, seeded
    norms = []
    for step in range(STEPS):
        window = window_batches(step, engine.world, k, uneven=True)
        calls = run_window(engine, window)
        _, ref_norm = reference_window(ref, opt, window, tokens=True, clip_norm=0.5)
        norms.append((calls[-1]["grad_norm"], ref_norm))
    tokens = [label_count(mb) for step in range(STEPS) for mbs in window_batches(step, engine.world, k, uneven=True)
              for mb in mbs]
    return {"max_abs_diff": max_diff(engine, ref), "max_seed_over_scale": max(seeds), "min_tokens": min(tokens),
            "norms": norms, "skipped": engine.skipped_steps}
