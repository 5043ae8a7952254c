"""What the sequence-parallel checks build and measure; tests/engine/test_sequence_parallel.py
declares them (one launch per world size) and asserts on their figures.

Every rank of an SP group gets its data-parallel group's whole batch; the engine splits it. The
reference is one process training on the same whole sequences: torch.optim.SGD, or the reference
AdaLomo, with torch's norm clipping, over the K x DP micro-batches of each step."""
from __future__ import annotations

import copy
import math
import traceback

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
                optimizer: str = "sgd", seed: int = 1, build=sdpa_llama, evaluate: bool = False) -> dict:
    """The engine's parameters after STEPS steps against the reference's; with `evaluate`, then the
    trained engine's evaluation (whole rows, the model's own attention) against the reference's."""
    ref = build(seed)
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
            "ref_grad_norm": ref_norms, "sp": engine.sp.size, "dp": dp, **(after_training(engine, ref) if evaluate
                                                                          else {})}


def after_training(engine, ref) -> dict:
    """Evaluation after SP training steps: the summed loss of a batch with a right-padded row (the
    padding makes transformers pass sdpa a mask, so its key/value heads are repeated by the module's
    num_key_value_groups rather than by sdpa itself), and greedy generation from left-padded prompts
    of two lengths, against the reference model's."""
    from lomo_ds.evaluation.generation import generate_ids

    g = torch.Generator().manual_seed(99)
    ids = torch.randint(3, VOCAB, (2, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[1, SEQ - 4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    got = engine.eval_token_loss(batch)  # None where the model keeps its own loss: then from its output
    got = (got if got is not None else engine.eval_forward(batch).loss * int((labels[:, 1:] != -100).sum())).item()
    ref.eval()
    with torch.no_grad():
        want = token_sum(ref, batch).item()
    prompts = [ids[0, :5].tolist(), ids[1, :3].tolist()]
    decode = {"stop_ids": [2], "pad_id": 0, "max_new_tokens": 4, "device": engine.device}
    replies = generate_ids(engine.module, prompts, synced=True, **decode)
    ref_replies = generate_ids(ref, prompts, **{**decode, "device": torch.device("cpu")})
    return {"eval_loss": got, "ref_eval_loss": want, "replies": replies, "ref_replies": ref_replies}


def _bf16_reference(model, optimizer: str, clip_norm: float | None):
    """tests/engine/bf16_checks.py's reference (sums and update in fp32) through the loss the engine
    takes by default (memory.chunked_loss "auto"): the chunked loss where it knows the model's head,
    else the model's own (Gemma 3, OLMo-2, Mixtral, Qwen2-MoE), whose gradient the engine's loss of
    the logits is."""
    from lomo_ds.engine.chunked_loss import head_of
    from tests.engine.bf16_checks import LR, Bf16Reference

    class Reference(Bf16Reference):
        def __init__(self):  # Bf16Reference's own asks for the chunked loss ("on") of every model
            self.model, self.head, self.params = model, head_of(model, "auto"), list(model.parameters())
            self.shadow = [torch.nn.Parameter(p.detach().float()) for p in self.params]
            self.opt = (ReferenceAdaLomo(self.shadow, LR[optimizer]) if optimizer == "adalomo"
                        else torch.optim.SGD(self.shadow, lr=LR[optimizer]))
            self.reduce_dtype = self.accumulate_dtype = torch.float32
            self.clip_norm, self.clip_value = clip_norm, None

        def grads(self, mb: dict) -> list[torch.Tensor]:
            if self.head is not None:
                return super().grads(mb)
            self.model.zero_grad()
            self.model(**mb).loss.backward()
            return [p.grad.detach().clone() for p in self.params]

    return Reference()


def bf16_steps(sp: int, optimizer: str, build, seed: int = 1, accumulation: int = 2,
               clip_norm: float | None = 0.5, engine_attn: str | None = None) -> dict:
    """bf16 shards (no fp32 masters) with round-to-nearest write-back, step by step against
    `_bf16_reference` on the same bf16 weights: each reference step starts from the engine's
    weights, so the figure is one step's difference, not a run's drift. The reference runs on rank 0
    alone: an error there is raised after the engine's steps, which every rank takes.
    `engine_attn`: the engine's model attends with this implementation (flash_attention_2 on a GPU),
    the reference with the one `build` gives."""
    from tests.engine.bf16_checks import bf16_cfg

    model = build(seed).to(torch.bfloat16)
    ref = _bf16_reference(copy.deepcopy(model), optimizer, clip_norm)
    if engine_attn is not None:
        model.config._attn_implementation = engine_attn
    engine = lomo_ds.initialize(model, bf16_cfg(optimizer, accumulation, "fp32", sequence_parallel_size=sp,
                                                clip_grad_norm=clip_norm, loss_normalization="mean"))
    dp, d = engine.sp.dp_size, engine.sp.dp_rank
    worst = abs_diff = moved = rel = 0.0
    error = None
    for step in range(STEPS):
        for k in range(accumulation):
            out = engine.train_step(micro_batch(step, k, d))
        assert out["stepped"], "the window's last micro-batch must step"
        full = engine.full_state_dict()
        if engine.rank != 0 or error:
            continue
        try:
            (result,) = ref.step([[micro_batch(step, k, g) for g in range(dp)] for k in range(accumulation)])
            for name in result:  # by parameter: a tied head is its embedding's
                mine, want, before = full[name].float(), result[name], ref.before[name]
                # In bf16 ulps of the tensor's largest weight (before or after: a bias starts at 0), the
                # rounding step its weights are written in
                big = max(before.abs().max().item(), want.abs().max().item(), torch.finfo(torch.bfloat16).tiny)
                ulp = 2.0 ** (math.floor(math.log2(big)) - 7)
                worst = max(worst, (mine - want).abs().max().item() / ulp)
                abs_diff = max(abs_diff, (mine - want).abs().max().item())
                moved = max(moved, (want - before).abs().max().item() / ulp)
                # The difference against the step as a whole (an element whose gradient bf16 rounding
                # dominates may move another way, the tensor's step may not)
                step = (want - before).norm().item()
                rel = max(rel, (mine - want).norm().item() / step if step else float((mine != want).any()) * 1e9)
            ref.load(full)
        except Exception:
            error = traceback.format_exc()
    if error:
        raise AssertionError(f"the reference failed:\n{error}")
    return {"max_ulps": worst, "max_abs_diff": abs_diff, "moved_ulps": moved, "step_rel": rel,
            "dtype": str(next(iter(full.values())).dtype) if full else None}


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


def other_model_unaffected(sp: int) -> dict:
    """Two models in one process, one trained with SP: the other (a reference or evaluation model,
    its own config) keeps its own attention. Its forward in training mode after the SP engine was
    built and stepped is its forward before (bit for bit), and transformers' registry still maps
    "sdpa" to transformers' own function: only the trained model's config names the routed one."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    own_sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    other = sdpa_llama(5).train()  # training mode: where the trained model attends through Ulysses
    batch = micro_batch(0, 0, 0)
    with torch.no_grad():
        before = other(**batch).logits
    engine = lomo_ds.initialize(sdpa_llama(1), ds_cfg(sequence_parallel_size=sp))
    for k in range(2):
        engine.train_step(micro_batch(0, k, engine.sp.dp_rank))
    with torch.no_grad():
        after = other(**batch).logits
    return {"equal": bool(torch.equal(before, after)), "max_abs_diff": (after - before).abs().max().item(),
            "registry_sdpa_kept": ALL_ATTENTION_FUNCTIONS["sdpa"] is own_sdpa,
            "other_attention": other.config._attn_implementation,
            "trained_attention": engine.module.config._attn_implementation}
