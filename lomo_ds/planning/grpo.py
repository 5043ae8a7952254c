"""Per-GPU memory of GRPO through TRL's GRPOTrainer: training, generation and the reference, for the
fused update (LOMO, AdaLomo) and, beside it, DeepSpeed ZeRO-3 AdamW.

    est = grpo_estimate(spec, "lomo", gpus=1, g=GrpoSpec(prompt=512, completion=1024, generations=8))
    est.peak                     # the larger phase, bytes per GPU
    print(format_grpo(spec, g, gpu_mem_gib=24))                     # `lomo-ds plan --grpo`

A step is two phases, one after the other, on each rank:

  generation   the resident states (this rank's shards; AdaLomo's state; AdamW's fp32 master,
               moments and gradient partition) + the model gathered for generation
               (TRL's ds3_gather_for_generation, its default: b P on N > 1 GPUs, nothing more on one,
               where the shard is the model), or layer-streamed (ds3_gather_for_generation false:
               the ZeRO-3 working set W, as in training) + the KV cache of the rank's generation batch,
               2 L K d b per token of prompt + completion for each of its sequences (per-device batch
               x steps_per_generation) + the prefill's one-layer transients (inference.eval_layer_bytes)
               and the sampled positions' fp32 logits.
  training     planner.estimate for micro-batches of `batch` sequences of prompt + completion
               tokens, with TRL's fused LM head (trl.kernels.chunked_logprob, the log-probs GRPO's
               loss reads: dpo.trl_head_bytes) in place of lomo_ds's chunked loss, as for DPO. An
               upper bound: the head is costed over every position, not the completion's only.
  reference    beta = 0 (TRL's default): none. beta > 0: "ref_model", a second ZeRO-3 model (b P / N
               + its working set on N > 1, dpo.reference_bytes), or "host" (integrations/grpo.py
               StartingWeights): each rank keeps its starting shards in host RAM and, for the
               reference's forward, copies them over its live shards in place, the live ones
               waiting in host RAM meanwhile: 2 b P / N per rank, 2 b P on the node. On the GPU
               nothing stays; the forward is the policy's own ZeRO-3 forward, its gathered
               layers (two fetch units: one computed, one arriving) counted beside training's
               peak, an upper bound (it runs when the generation batch is scored).

The default micro-batch is one completion and one step per micro-batch (gradient_accumulation_steps
1, steps_per_generation = generations): each generation's group of completions is scored once and
trained on one completion a step, with no gradient accumulator (TRL needs the generation batch,
per-device batch x steps_per_generation x GPUs, to be a multiple of num_generations).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from lomo_ds.planning import planner
from lomo_ds.planning.dpo import reference_bytes, trl_head_bytes
from lomo_ds.planning.fetch_units import largest_fetch_unit, working_set
from lomo_ds.planning.inference import eval_layer_bytes, kv_cache_bytes


def grpo_methods() -> tuple[str, ...]:
    """The rows GRPO is planned for: every registered rule's (planning/specs.py FUSED), and DeepSpeed's AdamW."""
    return (*planner.FUSED, "adamw")


GRPO_METHODS = grpo_methods()  # the built-in rules' and AdamW's (a rule registered later: grpo_methods())
GRPO_REFERENCES = ("none", "ref_model", "host")


@dataclass(frozen=True)
class GrpoSpec:
    prompt: int = 512  # max_prompt_length
    completion: int = 1024  # max_completion_length
    generations: int = 8  # num_generations (completions per prompt)
    batch: int = 1  # per_device_train_batch_size: completions per micro-batch
    steps_per_generation: int = 8  # micro-batches each generation batch is split into
    beta: float = 0.0  # the KL coefficient: a reference only where > 0
    reference: str = "host"  # with beta > 0: "ref_model" or "host"
    gather_for_generation: bool = True  # TRL's ds3_gather_for_generation

    @property
    def seq(self) -> int:
        return self.prompt + self.completion

    @property
    def generated(self) -> int:
        """Sequences each rank generates at once (its generation batch)."""
        return self.batch * self.steps_per_generation


@dataclass
class GrpoEstimate:
    method: str
    gpus: int
    resident: float  # the states that live through both phases
    gathered: float  # the model gathered for generation (or the streamed working set)
    kv_cache: float
    prefill: float  # one layer's transients of the prefill and the sampled logits
    training: float  # the training phase's peak
    reference: float  # the reference's cost on the GPU during training
    reference_host: float  # ... and in host RAM (node)

    @property
    def generation(self) -> float:
        return self.resident + self.gathered + self.kv_cache + self.prefill

    @property
    def peak(self) -> float:
        return max(self.generation, self.training + self.reference)


def check_grpo(g: GrpoSpec, gpus: int) -> None:
    """Refuse what TRL or the planner cannot do, naming the field (ValueError)."""
    if g.generations < 2:
        raise ValueError(f"num_generations: GRPO compares at least 2 completions per prompt, got {g.generations}")
    if (g.batch * g.steps_per_generation * gpus) % g.generations:
        raise ValueError(f"num_generations: {g.generations} does not divide the generation batch, "
                         f"per_device_train_batch_size {g.batch} x steps_per_generation {g.steps_per_generation} "
                         f"x {gpus} GPU(s)")
    if g.beta > 0 and g.reference not in GRPO_REFERENCES[1:]:
        raise ValueError(f"reference: with beta > 0 expected one of {GRPO_REFERENCES[1:]}, got {g.reference!r}")


def _resident(m: planner.ModelSpec, method: str, gpus: int, run: planner.RunSpec, e: planner.Estimate) -> float:
    """What lives through generation: the shards (not the gathered working set), and the optimizer's."""
    shard = run.b * sum(math.ceil(x / gpus) for x in m.param_numels())
    persist, _ = working_set(m, planner.resolve_auto(m, run))
    states = e.optimizer_states
    if method == "adamw":  # DeepSpeed's gradient partition and reduce bucket stay allocated
        states += run.b * sum(math.ceil(x / gpus) for x in m.param_numels()) + run.b * run.reduce_bucket
    return float(shard + (run.b * persist if gpus > 1 else 0) + states)


def _training(m: planner.ModelSpec, method: str, gpus: int, run: planner.RunSpec) -> tuple[planner.Estimate, float]:
    """The training phase's peak with TRL's fused head in place of the chunked loss (module docstring)."""
    e = planner.estimate(m, method, gpus, run)
    saved, transient = trl_head_bytes(m, run, gpus)
    chunked_saved = float(planner.loss_saved_bytes(m, run))
    if method in planner.FUSED:
        states = e.params + e.grads + e.optimizer_states
        last = e.total - states - e.activations
        return e, states + e.activations - chunked_saved + saved + max(last, transient)
    # DeepSpeed's: its backward with TRL's head (the step phase's total is unchanged)
    return e, max(e.total, e.params + e.grads + e.optimizer_states + e.activations - chunked_saved + saved
                  + max(e.recompute, transient))


def grpo_estimate(m: planner.ModelSpec, method: str, gpus: int, g: GrpoSpec = GrpoSpec(),
                  run: planner.RunSpec | None = None) -> GrpoEstimate:
    if method not in grpo_methods():
        raise ValueError(f"method: GRPO is planned for {grpo_methods()}, got {method!r}")
    check_grpo(g, gpus)
    run = replace(run or planner.RunSpec(), seq=g.seq, batch=g.batch, chunked_loss=True)
    e, training = _training(m, method, gpus, run)
    resident = _resident(m, method, gpus, run, e)
    b, P = run.b, m.n_params
    if gpus == 1:
        gathered = 0.0  # the shard is the whole model
    elif g.gather_for_generation:
        gathered = float(b * P)
    else:
        gathered = float(b * working_set(m, planner.resolve_auto(m, run))[1])
    kv = float(kv_cache_bytes(m, run, g.generated, g.seq))
    prefill = float(eval_layer_bytes(m, run, g.generated * g.prompt) + g.generated * m.vocab * (b + 4))
    ref, ref_host = 0.0, 0.0
    if g.beta > 0:
        if g.reference == "ref_model":
            ref = reference_bytes(m, run, gpus, "ref_model")
        else:
            ref = float(2 * b * largest_fetch_unit(m, planner.resolve_auto(m, run))[1])
            ref_host = float(2 * b * P)  # the starting shards, and the live ones during the swap
    return GrpoEstimate(method, gpus, resident, gathered, kv, prefill, float(training), ref, ref_host)


def format_grpo(m: planner.ModelSpec, g: GrpoSpec = GrpoSpec(), gpu_mem_gib: float = 24.0,
                gpu_counts=planner.GPU_COUNTS, run: planner.RunSpec | None = None) -> str:
    """`lomo-ds plan --grpo`: GiB per GPU of each phase for LOMO, AdaLomo and AdamW on each GPU count."""
    gib, budget = planner.GIB, gpu_mem_gib * planner.GIB
    run = run or planner.RunSpec()
    ref = f"beta {g.beta:g}" + (f", reference {g.reference}" if g.beta > 0 else " (no reference)")
    lines = [f"# GRPO (TRL's GRPOTrainer): {m.name}, {g.generations} generations per prompt, prompt {g.prompt} + "
             f"completion {g.completion} tokens, {g.batch} completion(s) per micro-batch, {g.generated} generated "
             f"per rank at once (steps_per_generation {g.steps_per_generation}), {ref}; "
             f"{run.assumptions(batch=False).replace(f'seq {run.seq}, ', '')}; GiB per GPU ({gpu_mem_gib:g} GiB)", "",
             "| method | GPUs | training | generation (gathered model) | generation (layer-streamed) | KV cache | "
             "reference (during training) | peak | fits | generation fits beside training |", "|---" * 10 + "|"]
    counts = [n for n in gpu_counts if (g.batch * g.steps_per_generation * n) % g.generations == 0]
    if not counts:
        check_grpo(g, min(gpu_counts))  # raises: no GPU count takes whole groups
    for method in grpo_methods():
        for n in counts:
            e = grpo_estimate(m, method, n, g, run)
            streamed = grpo_estimate(m, method, n, replace(g, gather_for_generation=False), run)
            fits = e.peak <= budget
            beside = ("yes" if e.generation <= budget else
                      "layer-streamed only" if streamed.generation <= budget else "no")
            host = f" (+{e.reference_host / gib:.1f} host)" if e.reference_host else ""
            ref_cell = f"{e.reference / gib:.2f}{host}"
            lines.append(f"| {planner.METHOD_LABELS[method]} | {n} | {e.training / gib:.2f} | "
                         f"{e.generation / gib:.2f} | {streamed.generation / gib:.2f} | {e.kv_cache / gib:.2f} | "
                         f"{ref_cell} | {e.peak / gib:.2f} | {'yes' if fits else 'OOM'} | {beside} |")
    return "\n".join(lines)


def format_grpo_for_args(model: str | None, g: GrpoSpec, gpu_mem_gib: float, overrides: dict) -> str:
    """`lomo-ds plan --model M --grpo [--completion C --generations G ...]`."""
    if model is None:
        raise ValueError("--grpo: name the model with --model (a LLaMA size or an HF config.json)")
    for flag, key in (("--offload", "offload"), ("--batch", "batch"), ("--seq", "seq")):
        if overrides.get(key):
            raise ValueError(f"{flag}: with --grpo the sequences are --prompt + --completion tokens, "
                             "--grpo-batch per micro-batch; offload_param is not planned for GRPO")
    return format_grpo(planner.resolve_model(model), g, gpu_mem_gib, run=replace(planner.RunSpec(), **overrides))
