"""Per-GPU memory of a run's evaluation and generation, beside the training plan (planner.py).

The recipe evaluates in the training process: the shards, the gathered working set and AdaLomo's
state stay; the training step's gradients and buckets are gone. Two phases, one after the other:

  eval loss     weights + one layer's transients + the logits of the eval batch:
                T V (b + 8): the logits in the model dtype, their fp32 copy and fp32 log-softmax
                (T = eval.batch_size x tokenizer.max_length, an upper bound: the recipe computes
                logits from the first labelled position on); without activation checkpointing
                transformers also keeps the batch's KV cache (model.config.use_cache stays on)
  generation    weights + one layer's transients + the KV cache of eval.batch_size sequences of
                prompt + eval.max_new_tokens tokens: 2 L K d b per token (only with
                eval.generate_samples > 0)

"One layer's transients" are what a no-grad forward of one layer holds at once, with transformers'
default attention (sdpa: no S x S score matrix): T (3 f + 2 (H + K) d + h) b, its MLP's gate, up
and product beside q, k, v and the attention output (for MoE, f is the k routed experts' width plus
a shared expert's). The peak is the larger phase.
"""
from __future__ import annotations

from dataclasses import dataclass

from lomo_ds.planning import planner as P


@dataclass(frozen=True)
class EvalSpec:
    batch: int  # eval.batch_size: sequences per forward (per rank)
    seq: int  # tokenizer.max_length: the longest prompt (+ answer) of the eval set
    new_tokens: int = 0  # eval.max_new_tokens when generating
    generate: bool = False  # eval.generate_samples > 0


@dataclass(frozen=True)
class EvalEstimate:
    weights: float  # shards + gathered working set (+ AdaLomo's state), as in training
    layer: float  # one layer's transients
    loss: float  # the eval batch's logits, fp32 copy and log-softmax
    loss_kv: float  # the KV cache the loss forward keeps (use_cache on: no checkpointing)
    kv_cache: float  # generation's KV cache for prompt + new tokens
    loss_phase: float
    generation_phase: float

    @property
    def total(self) -> float:
        return max(self.loss_phase, self.generation_phase)


def eval_spec_for(cfg) -> EvalSpec:
    """The evaluation of a validated run config (lomo_ds.config.run.RunConfig)."""
    return EvalSpec(batch=cfg.eval.batch_size, seq=cfg.tokenizer.max_length, new_tokens=cfg.eval.max_new_tokens,
                    generate=cfg.eval.generate_samples > 0)


def kv_cache_bytes(m: P.ModelSpec, run: P.RunSpec, sequences: int, tokens: int) -> int:
    """Keys and values of every layer: 2 L K d b per token."""
    return 2 * m.layers * m.k * m.d * run.b * sequences * tokens


def eval_layer_bytes(m: P.ModelSpec, run: P.RunSpec, tokens: int) -> int:
    """One layer's transients in a no-grad forward of `tokens` tokens (module docstring)."""
    f = m.experts_per_tok * m.expert_intermediate + m.shared_intermediate if m.experts else m.intermediate
    return tokens * (3 * f + 2 * (m.heads + m.k) * m.d + m.hidden) * run.b


def eval_estimate(m: P.ModelSpec, run: P.RunSpec, gpus: int, ev: EvalSpec, method: str = "lomo") -> EvalEstimate:
    train = P.estimate(m, method, gpus, run)
    weights = train.params + train.optimizer_states
    tokens = ev.batch * ev.seq
    layer = eval_layer_bytes(m, run, tokens)
    loss = tokens * m.vocab * (run.b + 8)
    loss_kv = 0 if run.checkpointing else kv_cache_bytes(m, run, ev.batch, ev.seq)
    kv = kv_cache_bytes(m, run, ev.batch, ev.seq + ev.new_tokens) if ev.generate else 0
    return EvalEstimate(float(weights), float(layer), float(loss), float(loss_kv), float(kv),
                        float(weights + layer + loss + loss_kv), float(weights + layer + kv) if ev.generate else 0.0)


def format_eval(p: P.Plan, ev: EvalSpec, gpus: int, method: str = "lomo") -> str:
    e = eval_estimate(p.model, p.run, gpus, ev, method)
    g = P.GIB
    lines = [f"evaluation on {gpus} GPU(s) ({P.METHOD_LABELS[method]}'s weights and state), eval batch {ev.batch} x "
             f"{ev.seq} tokens" + (f", generating {ev.new_tokens} new tokens" if ev.generate else ", no generation"),
             f"  eval loss:  {e.loss_phase / g:.2f} GiB/GPU = weights {e.weights / g:.2f} + layer {e.layer / g:.2f} "
             f"+ logits/log-softmax {e.loss / g:.2f}" + (f" + KV cache {e.loss_kv / g:.2f} (use_cache on)"
                                                          if e.loss_kv else "")]
    if ev.generate:
        lines.append(f"  generation: {e.generation_phase / g:.2f} GiB/GPU = weights {e.weights / g:.2f} + layer "
                     f"{e.layer / g:.2f} + KV cache {e.kv_cache / g:.2f} ({ev.batch} x {ev.seq + ev.new_tokens} "
                     "tokens)")
    fits = e.total <= p.gpu_mem_gib * g
    lines.append(f"  evaluation peak {e.total / g:.2f} GiB/GPU: {'fits' if fits else 'OUT OF MEMORY'} in "
                 f"{p.gpu_mem_gib:g} GiB" + ("" if fits else " (lower eval.batch_size)"))
    return "\n".join(lines)
