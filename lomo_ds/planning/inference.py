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

And after the run, with eval.harness_tasks, a third phase on rank 0's GPU alone, once the engine's memory
is freed (lomo_ds/methods/release.py):

  harness       lm-evaluation-harness on the export: the whole model in the training dtype (N b) + one
                layer's transients + the batch's logits and their log-softmax, both in the model dtype
                (2 T V b: lm-eval takes no fp32 copy) + the KV cache transformers keeps (use_cache);
                T = eval.batch_size x tokenizer.max_length, lm-eval's batch (the recipe passes
                eval.batch_size) over contexts as long as the run's; another task's may be longer

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
    harness: bool = False  # eval.harness_tasks: lm-eval on the export, rank 0 alone


@dataclass(frozen=True)
class EvalEstimate:
    weights: float  # shards + gathered working set (+ AdaLomo's state), as in training
    layer: float  # one layer's transients
    loss: float  # the eval batch's logits, fp32 copy and log-softmax
    loss_kv: float  # the KV cache the loss forward keeps (use_cache on: no checkpointing)
    kv_cache: float  # generation's KV cache for prompt + new tokens
    loss_phase: float
    generation_phase: float
    harness: "HarnessEstimate | None" = None

    @property
    def total(self) -> float:
        return max(self.loss_phase, self.generation_phase, self.harness.total if self.harness else 0.0)


@dataclass(frozen=True)
class HarnessEstimate:
    """lm-evaluation-harness on the export, on rank 0's GPU after the engine is freed (module docstring)."""
    weights: float  # the whole model in the training dtype
    layer: float  # one layer's transients
    logits: float  # the batch's logits and log-softmax, in the model dtype
    kv_cache: float  # what the forward keeps with use_cache on

    @property
    def total(self) -> float:
        return self.weights + self.layer + self.logits + self.kv_cache


def eval_spec_for(cfg) -> EvalSpec:
    """The evaluation of a validated run config (lomo_ds.config.run.RunConfig)."""
    return EvalSpec(batch=cfg.eval.batch_size, seq=cfg.tokenizer.max_length, new_tokens=cfg.eval.max_new_tokens,
                    generate=cfg.eval.generate_samples > 0, harness=bool(cfg.eval.harness_tasks))


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
                        float(weights + layer + loss + loss_kv), float(weights + layer + kv) if ev.generate else 0.0,
                        harness_estimate(m, run, ev) if ev.harness else None)


def harness_estimate(m: P.ModelSpec, run: P.RunSpec, ev: EvalSpec) -> HarnessEstimate:
    """The harness phase (module docstring): the same on any GPU count, rank 0 holding it alone."""
    tokens = ev.batch * ev.seq
    return HarnessEstimate(float(m.n_params * run.b), float(eval_layer_bytes(m, run, tokens)),
                           float(2 * tokens * m.vocab * run.b), float(kv_cache_bytes(m, run, ev.batch, ev.seq)))


def harness_refusal(m: P.ModelSpec, run: P.RunSpec, ev: EvalSpec, gpu_bytes: float) -> str | None:
    """Why the harness cannot run on a GPU of `gpu_bytes` (None where it fits): said before training."""
    h, g = harness_estimate(m, run, ev), P.GIB
    if h.total <= gpu_bytes:
        return None
    elsewhere = "drop eval.harness_tasks and run `lomo-ds eval --model <output.dir>/hf_model` where it fits"
    fix = (f"lower eval.batch_size, or {elsewhere}" if h.weights < gpu_bytes else
           f"the model alone is more than the GPU holds: {elsewhere}")
    return (f"lm-evaluation-harness loads the whole exported model on rank 0's GPU (after the engine's memory is "
            f"freed): {h.total / g:.2f} GiB = the model in {run.dtype} {h.weights / g:.2f} + lm-eval's batch "
            f"{(h.total - h.weights) / g:.2f} ({ev.batch} x {ev.seq} tokens), more than the GPU's "
            f"{gpu_bytes / g:.2f} GiB; {fix}")


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
    if e.harness:
        h = e.harness
        lines.append(f"  harness:    {h.total / g:.2f} GiB on rank 0's GPU after the engine is freed = the model in "
                     f"{p.run.dtype} {h.weights / g:.2f} + layer {h.layer / g:.2f} + logits/log-softmax "
                     f"{h.logits / g:.2f} + KV cache {h.kv_cache / g:.2f} (eval.harness_tasks)")
    fits = e.total <= p.gpu_mem_gib * g
    refusal = harness_refusal(p.model, p.run, ev, p.gpu_mem_gib * g) if ev.harness else None
    lines.append(f"  evaluation peak {e.total / g:.2f} GiB/GPU: {'fits' if fits else 'OUT OF MEMORY'} in "
                 f"{p.gpu_mem_gib:g} GiB" + ("" if fits else f" (eval.harness_tasks: {refusal})" if refusal else
                                             " (lower eval.batch_size)"))
    return "\n".join(lines)
