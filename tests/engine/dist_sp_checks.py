"""What the sequence-parallel checks build and measure; tests/engine/test_sequence_parallel.py
declares them (one launch per world size) and asserts on their figures.

Every rank of an SP group gets its data-parallel group's whole batch; the engine splits it. The
reference is one process training on the same whole sequences: torch.optim.SGD, or the reference
AdaLomo, with torch's norm clipping, over the K x DP micro-batches of each step."""
from __future__ import annotations

import copy

import torch

import lomo_ds
from tests.adalomo_reference import ReferenceAdaLomo
from tests.engine.dist_engine_checks import LR, ds_cfg, max_diff
from tests.tiny import VOCAB, tiny_llama

SEQ = 12  # divisible by SP = 2: 6 positions a slice
PROMPT = 7  # labels of a prompted row start here: an SP = 2 rank 0 then has no target at all
STEPS = 3
ADALOMO_LR = 0.01


def sdpa_llama(seed: int):
    """A tiny Llama (4 heads, 2 key/value heads) on sdpa attention, which Ulysses wraps."""
    model = tiny_llama(seed)
    model.config._attn_implementation = "sdpa"
    return model


def micro_batch(step: int, k: int, d: int, micro: int = 2) -> dict:
    """Data-parallel group d's micro-batch k of a step. Every other one is prompted (the first
    PROMPT labels -100): unequal token counts, so "mean" and "tokens" weigh differently."""
    g = torch.Generator().manual_seed(1000 * step + 10 * k + d)
    ids = torch.randint(0, VOCAB, (micro, SEQ), generator=g)
    labels = ids.clone()
    if (k + d) % 2:
        labels[:, :PROMPT] = -100
    return {"input_ids": ids, "labels": labels}


def token_sum(model, mb) -> torch.Tensor:
    return model(**mb).loss * int((mb["labels"][:, 1:] != -100).sum())


def reference_step(ref, opt, mbs: list[dict], normalization: str, clip_norm: float | None) -> tuple[float, float]:
    ref.zero_grad()
    if normalization == "tokens":
        loss = sum(token_sum(ref, mb) for mb in mbs) / sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in mbs)
    else:
        loss = sum(ref(**mb).loss for mb in mbs) / len(mbs)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip_norm or float("inf")).item()
    opt.step()
    return loss.item(), norm


def equivalence(sp: int, accumulation: int = 2, normalization: str = "mean", clip_norm: float | None = 0.5,
                optimizer: str = "sgd", seed: int = 1) -> dict:
    ref = sdpa_llama(seed)
    lr = ADALOMO_LR if optimizer == "adalomo" else LR
    cfg = ds_cfg(clip_grad_norm=clip_norm, sequence_parallel_size=sp, accumulation_steps=accumulation,
                 loss_normalization=normalization, optimizer=optimizer)
    cfg["lomo"]["lr"] = lr
    engine = lomo_ds.initialize(copy.deepcopy(ref), cfg)
    opt = ReferenceAdaLomo(ref.parameters(), lr) if optimizer == "adalomo" else torch.optim.SGD(ref.parameters(),
                                                                                                  lr=lr)
    dp, d = engine.sp.dp_size, engine.sp.dp_rank
    losses, ref_losses, norms, ref_norms = [], [], [], []
    for step in range(STEPS):
        for k in range(accumulation):
            out = engine.train_step(micro_batch(step, k, d))
        mbs = [micro_batch(step, k, g) for k in range(accumulation) for g in range(dp)]
        rl, rn = reference_step(ref, opt, mbs, normalization, clip_norm)
        losses.append(out["loss"]), ref_losses.append(rl), norms.append(out["grad_norm"]), ref_norms.append(rn)
    return {"max_abs_diff": max_diff(engine, ref), "loss": losses, "ref_loss": ref_losses, "grad_norm": norms,
            "ref_grad_norm": ref_norms, "sp": engine.sp.size, "dp": dp}


def unsplit_loss(sp: int) -> dict:
    """The loss an SP group reports for one batch, against the same model's loss of the whole rows
    in one process, in both normalisations (read before the step's update), for whole rows (a
    label crosses every slice boundary) and prompted ones (a rank without any target)."""
    ref = sdpa_llama(3)
    out = {}
    for normalization in ("mean", "tokens"):
        for k, rows in ((0, "whole"), (1, "prompted")):
            engine = lomo_ds.initialize(copy.deepcopy(ref), ds_cfg(sequence_parallel_size=sp,
                                                                   loss_normalization=normalization))
            mbs = [micro_batch(0, k, g) for g in range(engine.sp.dp_size)]
            got = engine.train_step(mbs[engine.sp.dp_rank])["loss"]
            with torch.no_grad():
                if normalization == "tokens":
                    want = (sum(token_sum(ref, mb) for mb in mbs)
                            / sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in mbs)).item()
                else:
                    want = (sum(ref(**mb).loss for mb in mbs) / len(mbs)).item()
            out[f"{normalization} {rows}"] = [got, want]
    return out
