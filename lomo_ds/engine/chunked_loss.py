"""A causal LM's loss as one linear + cross-entropy over chunks of positions (memory.chunked_loss).

transformers' causal-LM loss takes the logits of every position, upcasts them to fp32 and takes a
log-softmax and its gradient: 4 T V bytes and more (2 GiB at 4096 positions and a 128k vocabulary,
where the whole model update is bounded by a chunk). Here the output head and the loss are one
autograd function over the labelled positions only, `chunk` of them at a time (chunk_positions:
memory.loss_chunk_logits over the vocabulary, so a chunk's memory does not grow with it):

  forward   per chunk: logits = h W^T (the model's dtype, as nn.Linear), fp32, the family's
            final soft-capping, log-sum-exp (in place of the logits) and the target's logit;
            only the per-position log-sum-exp (4 bytes a position) is kept.
  backward  by blocks of the vocabulary over every position, about as many logits a block as a
            chunk: the logits recomputed, softmax - one-hot, scaled by the upstream gradient over
            the labelled count, through the soft-capping; the block's rows of dW written by one
            product (rounded to W's dtype once, whatever the count of blocks), dh summed over the
            blocks in fp32 (_backward_by_vocabulary_blocks says why).

So neither the fp32 logits nor their gradient exist for more than a chunk's worth at once; the
head's weight gradient (b V h) is the same tensor the plain loss makes. Where every labelled
position fits in one chunk, the forward keeps that chunk's gradient of the logits (softmax -
one-hot, through the soft-capping: 4 bytes a logit, no more than the recompute would make) and the
backward only multiplies by it: recomputing would buy no memory there, and would cost one more
matmul of the head (a few percent of a small model's step).

Why this and not a maintained function: torch's `F.linear_cross_entropy` (chunked, CPU and CUDA)
computes the weight's gradient in the forward, which under ZeRO-3 holds a whole fp32/bf16 head
gradient from the forward on and gives it to autograd in a second backward only with
`allow_retain_graph`, and it has no soft-capping; TRL's chunked log-prob function serves its own
trainers' log-probabilities (no ignore-index mean); cut-cross-entropy and liger-kernel are Triton,
GPU only. This function is plain torch: the same on CPU and GPU, the clipping's second backward
over the retained graph reads only what it saved, and it recomputes per chunk.

ZeRO-3: the function runs inside the head module's own call (its forward replaced for that call),
so DeepSpeed's hooks gather the head's weight before it and release it after, and gather it again
in the backward before the function's backward reads it (the loss is the module's output). The
weight's gradient is returned once, so its post-accumulate hook fires once (a tied embedding's
gradient is summed by autograd into the same one call).

The whole model's forward runs through the model's own call too (its forward replaced for that
call): ZeRO-3's start-of-forward hook on the top module still runs. Supported: the transformers
causal LMs whose head is a bias-free Linear applied to the decoder's last hidden states, with
Gemma-2's final logit soft-capping (HEADS). Any other model is refused by name ("on"), or keeps its
own loss ("auto").
"""
from __future__ import annotations

import logging
import math
from typing import Any, NamedTuple

import torch

from lomo_ds.data.sequence_split import IGNORE, shift_labels

log = logging.getLogger(__name__)

# transformers' causal LMs whose forward is: hidden = self.model(...); logits = self.lm_head(hidden
# [:, -logits_to_keep:]) (then, where the config sets it, final_logit_softcapping); the loss is
# the mean cross-entropy of the labels shifted by one, -100 ignored.
HEADS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GemmaForCausalLM",
         "Gemma2ForCausalLM", "Phi3ForCausalLM")


class Head(NamedTuple):
    """What the chunked loss needs to know of a model's output head."""

    softcap: float | None  # config.final_logit_softcapping


def head_of(model: torch.nn.Module, mode: str) -> Head | None:
    """The model's head for the chunked loss, or None (its own loss). `mode`: memory.chunked_loss."""
    if mode == "off":
        return None
    name = type(model).__name__
    lm_head = getattr(model, "lm_head", None)
    known = (name in HEADS and isinstance(lm_head, torch.nn.Linear) and lm_head.bias is None
             and isinstance(getattr(model, "model", None), torch.nn.Module))
    if not known:
        if mode == "on":
            raise ValueError(f"memory.chunked_loss: 'on' needs a causal LM whose output head it knows "
                             f"({', '.join(HEADS)}); {name} is not one: set 'auto' (its own loss) or 'off'")
        log.info("lomo_ds: %s keeps its own loss (memory.chunked_loss knows %s)", name, ", ".join(HEADS))
        return None
    softcap = getattr(model.config, "final_logit_softcapping", None)
    return Head(float(softcap) if softcap else None)


class ChunkedLossOutput(dict):
    """The model's outputs as far as the engines read them: `loss` (as transformers' ModelOutput,
    by key and attribute), no logits."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError as e:
            raise AttributeError(key) from e


def chunk_positions(chunk_logits: int, vocab: int) -> int:
    """Positions a chunk of `chunk_logits` logits holds (memory.loss_chunk_logits): at least one."""
    return max(1, chunk_logits // vocab)


def causal_lm_loss(model: torch.nn.Module, head: Head, batch: dict[str, Any], chunk_logits: int,
                   reduction: str = "mean") -> ChunkedLossOutput:
    """transformers' causal-LM loss of `batch` (labels shifted by one, -100 ignored, the token
    mean; `reduction` "sum": the token sum), through the chunked head, about `chunk_logits`
    logits at a time. `logits_to_keep` (an int) keeps the last positions only, as the model's own
    forward does."""
    chunk = chunk_positions(chunk_logits, model.lm_head.out_features)
    inputs = dict(batch)
    # A sequence-parallel slice carries its targets already shifted (data/sequence_split.py).
    shifted = inputs.pop("shift_labels", None)
    labels = inputs.pop("labels") if shifted is None else shifted
    keep = inputs.pop("logits_to_keep", 0)
    if not isinstance(keep, int):
        raise ValueError(f"logits_to_keep: the chunked loss takes an int, got {type(keep).__name__}")

    def forward(**kw):
        out = model.model(**{"use_cache": False, **kw})
        hidden = out[0]
        if keep:
            hidden = hidden[:, -keep:]
        return _head_loss(model.lm_head, head, hidden, labels, chunk, reduction, shifted is not None)

    return ChunkedLossOutput(loss=_call_as(model, forward, **inputs))


def _call_as(module: torch.nn.Module, forward, *args, **kwargs) -> Any:
    """module(*args, **kwargs) with `forward` in place of its own for this call: the module's hooks
    (ZeRO-3's gathers and releases) run around it as around its own forward. ZeRO-3 arms the
    release after the module's backward on its positional inputs: the head's input goes by position."""
    module.forward = forward
    try:
        return module(*args, **kwargs)
    finally:
        del module.forward


def _head_loss(lm_head: torch.nn.Linear, head: Head, hidden: torch.Tensor, labels: torch.Tensor, chunk: int,
               reduction: str, shifted: bool = False) -> torch.Tensor:
    # Position t predicts labels[t + 1]; the last position predicts nothing (transformers pads it).
    targets = labels if shifted else shift_labels(labels)
    targets = targets.to(hidden.device).reshape(-1)
    picked = (targets != IGNORE).nonzero().squeeze(1)
    h = hidden.reshape(-1, hidden.size(-1)).index_select(0, picked)  # the labelled positions only
    t = targets.index_select(0, picked)

    # Under no_grad (evaluation) there is no backward to keep the one chunk's gradient for.
    keep = torch.is_grad_enabled()

    def forward(x):
        return LinearCrossEntropy.apply(x, lm_head.weight, t, chunk, head.softcap, reduction, keep)

    return _call_as(lm_head, forward, h)


class LinearCrossEntropy(torch.autograd.Function):
    """Cross-entropy of (h W^T, soft-capped) against targets, per chunk of rows (module docstring)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                softcap: float | None, reduction: str, keep_one_chunk: bool = False) -> torch.Tensor:
        n = h.size(0)
        lse = torch.empty(n, dtype=torch.float32, device=h.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        kept = None
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            z, tanh = _logits(h[a:b], weight, softcap)
            picked = z.gather(1, targets[a:b, None]).squeeze(1)
            part, sums = _log_sum_exp_in_place(z)
            lse[a:b] = part
            total += (part - picked).sum()
            if keep_one_chunk and n <= chunk:  # the only chunk: its gradient kept (module docstring)
                kept = _minus_one_hot(z.div_(sums[:, None]), tanh, targets[a:b])  # softmax, in place
            del z, tanh
        ctx.save_for_backward(h, weight, targets, lse, kept)
        ctx.chunk, ctx.softcap, ctx.reduction = chunk, softcap, reduction
        # The token mean, as cross_entropy's: 0/0 (nan) for no labelled position.
        return total / n if reduction == "mean" else total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        h, weight, targets, lse, kept = ctx.saved_tensors
        n = h.size(0)
        # With no labelled position the gradient is zero (as cross_entropy's), not 0 * inf.
        scale = grad_out.float() / max(n, 1) if ctx.reduction == "mean" else grad_out.float()
        if kept is not None and kept.dtype == h.dtype == weight.dtype:
            # The kept gradient as it is, one product each, scaled after: the kept tensor is not
            # touched (a retained graph, norm clipping's second backward, reads it again) and no
            # copy of it is made. Row slices here would rewrite the whole head gradient once per
            # slice (a memory-bound pass over b V h for each).
            dh = torch.mm(kept, weight).mul_(scale) if ctx.needs_input_grad[0] else None
            dw = torch.mm(kept.t(), h).mul_(scale) if ctx.needs_input_grad[1] else None
            return dh, dw, None, None, None, None, None
        if kept is not None:
            # In the model's lower dtype for its matmuls, as nn.Linear's backward: scaled and cast
            # into one buffer a slice of rows at a time (not in place, as above; 2 bytes a logit
            # and an eighth of the fp32 gradient at once), then one product each.
            low = torch.empty(kept.shape, dtype=h.dtype, device=h.device)
            rows = max(1, -(-n // KEPT_SLICES))
            for a in range(0, n, rows):
                b = min(n, a + rows)
                low[a:b].copy_(kept[a:b] * scale)
            dh = torch.mm(low, weight) if ctx.needs_input_grad[0] else None
            dw = torch.mm(low.t(), h) if ctx.needs_input_grad[1] else None
            return dh, dw, None, None, None, None, None
        return _backward_by_vocabulary_blocks(ctx, h, weight, targets, lse, scale)


# In a lower dtype, the kept gradient is scaled and cast, and the blocks' products are added into the
# fp32 input gradient, this many slices of rows at a time.
KEPT_SLICES = 8


def _backward_by_vocabulary_blocks(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                   lse: torch.Tensor, scale: torch.Tensor):
    """Several chunks: the gradients by blocks of the vocabulary over every position, about as many
    logits a block as a chunk of positions has (the same memory bound and the same products).

    Why by the vocabulary and not by chunks of positions: each block of the head's gradient dW is
    then written by one product over every position, rounded to W's dtype once, as nn.Linear's.
    Summed over chunks of positions in bf16, dW is rounded once per chunk: an error that grows with
    the chunks' count (TRL's chunked log-prob kernel sums in fp32 for this reason). Summing in fp32
    instead would hold an fp32 V x h buffer, twice the bf16 head (2 GiB for a 128k x 4096 head).
    Here the sum over blocks is the input's gradient's, T x h: an fp32 buffer of 4 T h bytes, and
    in a lower dtype one block's product beside it (2 T h), 48 MiB at 2,048 positions and h 4096:
    less than the fp32 dW wherever a micro-batch has fewer than 2V/3 positions (V is 32k-256k
    today). The planner counts it (planning/estimate.py loss_backward_bytes)."""
    n, vocab = h.size(0), weight.size(0)
    block = max(1, ctx.chunk * vocab // max(n, 1))
    dh = torch.zeros(h.shape, dtype=torch.float32, device=h.device) if ctx.needs_input_grad[0] else None
    dw = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device) if ctx.needs_input_grad[1] else None
    for v in range(0, vocab, block):
        w = weight[v:v + block]
        z, tanh = _logits(h, w, ctx.softcap)
        dz = _dlogits(z, tanh, lse, targets, first=v).mul_(scale)
        del z, tanh
        low = dz.to(h.dtype)
        del dz
        if dh is not None:
            if dh.dtype == low.dtype:
                dh.addmm_(low, w)
            else:  # mixed-dtype addmm is not a kernel: this block's product, then the fp32 sum
                _add_by_rows(dh, torch.mm(low, w))
        if dw is not None:
            torch.mm(low.t(), h, out=dw[v:v + block])
        del low
    if dh is not None and dh.dtype != h.dtype:
        dh = dh.to(h.dtype)
    return dh, dw, None, None, None, None, None


def _add_by_rows(total: torch.Tensor, part: torch.Tensor) -> None:
    """total += part (another dtype), KEPT_SLICES slices of rows at a time: on a CPU the add converts
    its operand into a temporary of total's dtype first (a GPU converts in the kernel), a slice's
    here (4 T h / KEPT_SLICES bytes for fp32), not the whole input gradient's."""
    rows = max(1, -(-part.size(0) // KEPT_SLICES))
    for a in range(0, part.size(0), rows):
        total[a:a + rows].add_(part[a:a + rows])


def _dlogits(z: torch.Tensor, tanh: torch.Tensor | None, lse: torch.Tensor, targets: torch.Tensor,
             first: int = 0) -> torch.Tensor:
    """The gradient of a chunk's summed cross-entropy by its logits before soft-capping: softmax -
    one-hot, in place of the fp32 logits `z` (the vocabulary's columns first, first + 1, ...),
    times the soft-capping's derivative."""
    return _minus_one_hot(z.sub_(lse[:, None]).exp_(), tanh, targets, first)  # softmax, in place of the logits


def _minus_one_hot(dz: torch.Tensor, tanh: torch.Tensor | None, targets: torch.Tensor,
                   first: int = 0) -> torch.Tensor:
    """The softmax `dz` less the one-hot of the targets, times the soft-capping's derivative, in place."""
    cols = targets - first
    hit = (cols >= 0) & (cols < dz.size(1))  # the rows whose target is one of these columns
    # Every row subtracts its hit (1 or 0, exact) at its target's column (any column where it has
    # none): no host sync to find the rows.
    dz[torch.arange(dz.size(0), device=dz.device), cols.clamp(0, dz.size(1) - 1)] -= hit.to(dz.dtype)
    if tanh is not None:
        dz.mul_(1.0 - tanh.square_())  # d(c tanh(z / c)) / dz
    return dz


def _log_sum_exp_in_place(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.logsumexp of each row of the fp32 logits `z`, by its arithmetic (the row's max, the
    sum of exp(z - max), its log plus the max), and that sum; exp(z - max) is written over `z`.
    torch.logsumexp makes exp(z - max) as a new tensor: 4 bytes a logit beside the logits, the
    chunk's largest term (planning/estimate.py loss_chunk_bytes counts the logits alone)."""
    top = z.amax(dim=1)
    top.masked_fill_(top.abs() == math.inf, 0.0)  # as torch.logsumexp: an infinite max is not subtracted
    sums = z.sub_(top[:, None]).exp_().sum(dim=1)
    return sums.log().add_(top), sums


def _logits(h: torch.Tensor, weight: torch.Tensor, softcap: float | None):
    """fp32 logits of a chunk (the matmul in the model's dtype, as nn.Linear), soft-capped, and
    tanh(z / c) for the backward (None without soft-capping)."""
    z = torch.nn.functional.linear(h, weight).float()
    if softcap is None:
        return z, None
    tanh = z.div_(softcap).tanh_()
    return tanh * softcap, tanh
