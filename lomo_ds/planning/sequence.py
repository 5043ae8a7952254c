"""The planner's terms that grow with the sequence: attention by implementation, Ulysses sequence
parallelism, the tiled MLP and checkpointed activations offloaded to host RAM. The model behind
them: docs/memory.md ("Long sequences"); estimate.py adds them into the per-GPU total.

With T = micro-batch x seq / sp positions on each rank (RunSpec.tokens), per decoder layer:

  attention (sdpa, flash: no S x S matrix; transformers passes the causal flag, no mask, and
  grouped-query heads as they are)
      T (2 H + 2 K') d b        q and k after the rotation, v, the output (K' = K, or under Ulysses
                                with fewer key-value heads than ranks the heads replicated: max(K, sp))
    + 4 T H                     the kernel's fp32 log-sum-exp per head and position
    + T H d b     (sp > 1)      the output's all-to-all back to the local positions (o_proj's input)
  Ulysses all-to-all (sp > 1), transient while a layer runs: the q, k, v sent beside the ones
  received, T (H + 2 K') d b: each rank holds the whole sequence for H / sp heads inside attention,
  the same number of elements as its T positions for H heads.
  norms (sdpa/flash) 2 T (h (4 + 2 b) + 4): each RMSNorm's fp32 input, its inverse RMS, the normalised
      input in the model dtype and the weighted output.
  MLP  4 T f b saved (gate, silu(gate), up, their product), whose gradients in the backward take
      the place of what it frees. Tiled (deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP):
      nothing saved but the layer's input, which the norm keeps already; in the backward the
      input's gradient it fills, T h b, and one tile recomputed and back-propagated,
      (T / tiles) (6 f + h) b. tiles: memory.mlp_tiles, or ceil(seq / sp / h) as DeepSpeed's
      example picks.
  checkpointed inputs L T h b; offloaded (memory.offload_checkpoints) they are in host RAM (pinned,
      L T h b per rank) and the GPU holds two layers' inputs (one on its way out, one coming back).
"""
from __future__ import annotations

import math

from lomo_ds.planning.specs import ModelSpec, RunSpec


def check_sequence(m: ModelSpec, run: RunSpec) -> None:
    """Refuse what the sequence options cannot do, naming the field (ValueError)."""
    if run.sp < 1:
        raise ValueError(f"sp: expected a positive number of sequence-parallel ranks, got {run.sp}")
    if run.seq % run.sp:
        raise ValueError(f"seq: {run.seq} is not divisible by sp = {run.sp} (each rank holds seq / sp positions)")
    if m.heads % run.sp:
        raise ValueError(f"sp: {m.name}'s {m.heads} attention heads are not divisible by sp = {run.sp} "
                         "(Ulysses gives each rank heads / sp heads)")
    if run.offload_checkpoints and not run.checkpointing:
        raise ValueError("offload_checkpoints: needs activation checkpointing (model.gradient_checkpointing); "
                         "without it there are no checkpointed inputs to offload")
    if run.mlp_tiles < 0:
        raise ValueError(f"mlp_tiles: expected 0 (auto) or a positive number of tiles, got {run.mlp_tiles}")


def kv_heads_held(m: ModelSpec, run: RunSpec) -> int:
    """Key-value heads whose elements a rank holds: K, or under Ulysses with K < sp, sp (replicated)."""
    return max(m.k, run.sp) if run.sp > 1 else m.k


def mlp_tiles(m: ModelSpec, run: RunSpec) -> int:
    """Tiles of the tiled MLP: memory.mlp_tiles, or ceil(local positions / hidden); 1 when untiled."""
    if not run.tiled_mlp:
        return 1
    return max(1, min(run.mlp_tiles or math.ceil(run.local_seq / m.hidden), run.local_seq))


def mlp_width(m: ModelSpec) -> int:
    """The dense MLP's width (MoE layers are the family term's: estimate.family_layer_bytes)."""
    return 0 if m.experts else m.intermediate


def mlp_saved_bytes(m: ModelSpec, run: RunSpec) -> int:
    """What the MLP saves for the backward: gate, activation, up and product; nothing tiled."""
    return 0 if run.tiled_mlp else 4 * run.tokens * mlp_width(m) * run.b


def mlp_backward_bytes(m: ModelSpec, run: RunSpec) -> int:
    """What the MLP's backward holds beyond the layer's saved tensors (measured on CPU,
    tests/planning/test_sequence_memory.py). Untiled: nothing counted (the gradients of its
    intermediates take the place of the saved intermediates it frees: the planner's step peaks are
    checked so, tests/planning/test_planner.py). Tiled: nothing saved is freed, so all of it: the
    input's gradient it fills (T h b), and one tile recomputed with its graph and back-propagated:
    its four intermediates, their gradients and the tile's input gradient, (T / tiles) (6 f + h) b."""
    f = mlp_width(m)
    if not f or not run.tiled_mlp:
        return 0
    tile = math.ceil(run.local_seq / mlp_tiles(m, run)) * run.batch
    return run.tokens * m.hidden * run.b + tile * (6 * f + m.hidden) * run.b


def attention_saved_bytes(m: ModelSpec, run: RunSpec) -> int:
    """sdpa / flash attention's saved bytes in one layer (module docstring); eager: estimate.py's."""
    T, b, d = run.tokens, run.b, m.d
    out = T * (2 * m.heads + 2 * kv_heads_held(m, run)) * d * b + 4 * T * m.heads
    return out + (T * m.heads * d * b if run.sp > 1 else 0)


def norm_saved_bytes(m: ModelSpec, run: RunSpec) -> int:
    """Two RMSNorms under sdpa / flash (module docstring)."""
    return 2 * run.tokens * (m.hidden * (4 + 2 * run.b) + 4)


def eager_scores_bytes(m: ModelSpec, run: RunSpec) -> int:
    """Eager attention's fp32 S x S scores and their cast, for the heads a rank holds (H / sp, whole sequence)."""
    b = run.b
    return run.batch * (m.heads // run.sp) * run.seq**2 * (4 + (b if b != 4 else 0))


def ulysses_bytes(m: ModelSpec, run: RunSpec) -> int:
    """The all-to-all's q, k, v sent beside the ones received (sp > 1), while a layer runs."""
    if run.sp == 1:
        return 0
    return run.tokens * (m.heads + 2 * kv_heads_held(m, run)) * m.d * run.b


def layer_transient_bytes(m: ModelSpec, run: RunSpec) -> int:
    """What one layer holds beyond its saved tensors while its backward runs: the MLP's backward
    and the Ulysses buffers (not both at once: the MLP runs after the attention)."""
    return max(mlp_backward_bytes(m, run), ulysses_bytes(m, run))


def checkpoint_bytes(m: ModelSpec, run: RunSpec) -> tuple[int, int]:
    """(on the GPU, in host RAM per rank) of the checkpointed layers' inputs (L T h b)."""
    every = m.layers * run.tokens * m.hidden * run.b
    if not run.offload_checkpoints:
        return every, 0
    return min(every, 2 * run.tokens * m.hidden * run.b), every


def sequence_terms(m: ModelSpec, run: RunSpec) -> dict[str, int]:
    """Each term that grows with the sequence, bytes per GPU (and host RAM per rank), for the printout."""
    on_gpu, on_host = checkpoint_bytes(m, run)
    out = {"positions per rank": run.tokens,
           "attention saved per layer": attention_saved_bytes(m, run) if run.attn != "eager" else 0,
           "eager S x S scores per layer": eager_scores_bytes(m, run) if run.attn == "eager" else 0,
           "MLP saved per layer": mlp_saved_bytes(m, run),
           "MLP backward (tiled: one tile's)": mlp_backward_bytes(m, run),
           "Ulysses all-to-all buffers": ulysses_bytes(m, run),
           "checkpointed inputs on the GPU": on_gpu if run.checkpointing else 0,
           "checkpointed inputs in host RAM per rank": on_host}
    return out
