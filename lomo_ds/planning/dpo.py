"""Per-GPU memory of preference tuning (DPO through TRL's DPOTrainer, lomo_ds.integrations.dpo).

    est = dpo_estimate(spec, "lomo", gpus=1, run=replace(RunSpec(), seq=1024), pairs=1)
    est.total                    # predicted peak bytes per GPU of a DPO step
    print(format_dpo(spec, run, pairs=1, gpu_mem_gib=24))     # `lomo-ds plan --dpo`

A DPO micro-batch of B pairs is one forward of 2B sequences (TRL concatenates chosen and rejected),
each prompt + completion, padded to the longest (at most max_length = seq). So the policy's part is
planner.estimate's at micro-batch 2B, with one change: the loss is TRL's fused LM head
(trl.kernels.chunked_logprob), not lomo_ds's chunked loss. Per sequence position (N = 2B (seq - 1)):
  saved       N h b                     the hidden states the head projects (a copy of the slice)
            + 24 N                      targets (int64), log Z and entropy, and the fp32 per-token
                                        outputs the metrics read (log-probs, mean logits, top-1)
  transient   in the backward, at once: the fp32 gradient of the whole LM-head weight (4 V h), the
              fp32 gradient of the hidden states (4 N h), one projection tile (min(N, 4096) x 32768
              in the compute dtype), and on N > 1 GPUs the LM-head weight gathered again (b V h:
              the head gathers it itself, in its forward and in its backward, and saves only the
              ZeRO-3 parameter).
  The transient is taken instead of the chunked loss's chunk, where it is larger than a recomputed
  layer with the update (planner.estimate's last term).

The reference:
  precompute (shipped)   0 during training: two fp32 log-probs per pair in the dataset (host). Its
                         pass before training is a no-grad forward of the policy, below the
                         training step's peak (no saved activations, no gradients).
  ref_model              a second ZeRO-3 model: b P / N shards + its persistent parameters and
                         gathered working set on N > 1 (planner's W), plus a no-grad forward each
                         step (transient, before the policy's forward). Refused by LomoDPOTrainer;
                         planned for comparison.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from lomo_ds.planning import planner
from lomo_ds.planning.fetch_units import working_set

TRL_TOKEN_TILE = 4096  # trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE
TRL_VOCAB_TILE = 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE
REFERENCES = ("precompute", "ref_model")


@dataclass
class DpoEstimate:
    method: str
    gpus: int
    pairs: int
    reference: str
    policy: planner.Estimate  # planner.estimate at micro-batch 2 x pairs
    head_saved: float  # TRL's fused head: what it saves for the backward
    head_transient: float  # its backward's fp32 LM-head and hidden-state gradients and tile
    reference_bytes: float  # the reference route's resident cost during training
    total: float

    @property
    def accounted(self) -> float:
        """What the engine's accounting measures (planner.Estimate.accounted) with TRL's head."""
        return self.policy.accounted - self._chunked_saved + self.head_saved + self.reference_bytes

    _chunked_saved: float = 0.0


def _sequences(run: planner.RunSpec, pairs: int) -> planner.RunSpec:
    return replace(run, batch=2 * pairs)


def trl_head_bytes(m: planner.ModelSpec, run: planner.RunSpec, gpus: int) -> tuple[float, float]:
    """(saved, backward transient) bytes of TRL's fused LM head on `run`'s sequences (module docstring)."""
    n = run.batch * max(run.seq - 1, 1)
    saved = n * m.hidden * run.b + 24 * n
    tile = min(n, TRL_TOKEN_TILE) * min(TRL_VOCAB_TILE, m.vocab) * run.b
    gathered = run.b * m.vocab * m.hidden if gpus > 1 else 0
    return float(saved), float(4 * m.vocab * m.hidden + 4 * n * m.hidden + tile + gathered)


def reference_bytes(m: planner.ModelSpec, run: planner.RunSpec, gpus: int, reference: str) -> float:
    if reference not in REFERENCES:
        raise ValueError(f"reference: expected one of {REFERENCES}, got {reference!r}")
    if reference == "precompute":
        return 0.0
    numels = m.param_numels()
    shard = run.b * sum(math.ceil(x / gpus) for x in numels)
    persist, work = working_set(m, planner.resolve_auto(m, run))
    return float(shard + (run.b * (persist + work) if gpus > 1 else 0))


def dpo_estimate(m: planner.ModelSpec, method: str, gpus: int, run: planner.RunSpec | None = None,
                 pairs: int = 1, reference: str = "precompute") -> DpoEstimate:
    """A DPO step's predicted peak per GPU: `pairs` preference pairs per micro-batch (module docstring)."""
    run = run if run is not None else planner.RunSpec()
    if method not in planner.FUSED:
        raise ValueError(f"method: DPO is planned for LOMO and AdaLomo (lomo_ds's engine), got {method!r}")
    if pairs < 1:
        raise ValueError(f"pairs: expected at least 1 pair per micro-batch, got {pairs}")
    seqs = planner.resolve_auto(m, _sequences(replace(run, chunked_loss=True), pairs))
    policy = planner.estimate(m, method, gpus, seqs)
    chunked_saved = float(planner.loss_saved_bytes(m, seqs))
    saved, transient = trl_head_bytes(m, seqs, gpus)
    ref = reference_bytes(m, seqs, gpus, reference)
    states = policy.params + policy.grads + policy.optimizer_states
    last = policy.total - states - policy.activations  # max(recomputed layer + update, loss chunk)
    acts = policy.activations - chunked_saved + saved
    total = states + acts + max(last, transient) + ref
    est = DpoEstimate(method, gpus, pairs, reference, policy, saved, transient, ref, float(total))
    est._chunked_saved = chunked_saved
    return est


def format_dpo(m: planner.ModelSpec, run: planner.RunSpec, pairs: int = 1, gpu_mem_gib: float = 24.0,
               gpu_counts=planner.GPU_COUNTS) -> str:
    """`lomo-ds plan --dpo`: GiB per GPU of a DPO step for LOMO and AdaLomo with each reference route."""
    gib = planner.GIB
    lines = [f"# DPO (TRL's DPOTrainer + lomo_ds): {m.name}, {pairs} pair(s) per micro-batch = {2 * pairs} "
             f"sequences of {run.seq} tokens; {run.assumptions(batch=False)}",
             "| method | reference | " + " | ".join(f"{n} GPU{'s' if n > 1 else ''}" for n in gpu_counts) + " |",
             "|---" * (2 + len(gpu_counts)) + "|"]
    for method in planner.FUSED:
        for reference in REFERENCES:
            cells = []
            for n in gpu_counts:
                e = dpo_estimate(m, method, n, run, pairs, reference)
                cell = f"{e.total / gib:.2f}"
                cells.append(cell if e.total <= gpu_mem_gib * gib else f"{cell} OOM")
            label = "precomputed (shipped)" if reference == "precompute" else "ref_model (refused)"
            lines.append(f"| {planner.METHOD_LABELS[method]} | {label} | " + " | ".join(cells) + " |")
    e = dpo_estimate(m, "lomo", 1, run, pairs)
    lines.append(f"policy forward on chosen and rejected (LOMO, 1 GPU): activations "
                 f"{(e.policy.activations - e._chunked_saved + e.head_saved) / gib:.2f} GiB, TRL's head saves "
                 f"{e.head_saved / gib:.2f} GiB and needs {e.head_transient / gib:.2f} GiB in its backward; "
                 f"a ref_model adds {reference_bytes(m, run, 1, 'ref_model') / gib:.2f} GiB on 1 GPU")
    return "\n".join(lines)


def format_dpo_for_args(model: str | None, pairs: int, gpu_mem_gib: float, overrides: dict) -> str:
    """`lomo-ds plan --model M --dpo-pairs B [--seq S ...]`: the DPO rows of a LLaMA size or a config.json."""
    if model is None:
        raise ValueError("--dpo-pairs: name the model with --model (a LLaMA size or an HF config.json)")
    if overrides.get("offload"):
        raise ValueError("--dpo-pairs: DPO with offload_param is not planned; drop --offload")
    if "batch" in overrides:
        raise ValueError("--batch: with --dpo-pairs the micro-batch is 2 x pairs sequences; give --dpo-pairs only")
    spec = planner.resolve_model(model)
    return format_dpo(spec, replace(planner.RunSpec(), **overrides), pairs, gpu_mem_gib)
