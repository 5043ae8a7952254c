"""The per-GPU memory estimate for LOMO, SGD and AdamW under DeepSpeed ZeRO-3, the smallest GPU
count that fits, and (with `offload_param: cpu`) the host RAM a LOMO run needs. The model behind
every term, its notation and the figures it gives: docs/memory.md ("The planner's model")."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from lomo_ds.config import rules
from lomo_ds.planning import int8_shards
from lomo_ds.planning.fetch_units import working_set
from lomo_ds.planning.sequence import (
    attention_saved_bytes,
    check_sequence,
    checkpoint_bytes,
    eager_scores_bytes,
    layer_transient_bytes,
    mlp_saved_bytes,
    norm_saved_bytes,
)
from lomo_ds.planning.specs import (
    DTYPE_BYTES,
    EXPORT_FILE_BYTES,
    FUSED,
    GIB,
    GPU_COUNTS,
    HOST_STAGED_BUCKETS,
    LOSS_ADD_SLICES,
    METHOD_LABELS,
    METHODS,
    ModelSpec,
    RunSpec,
    chunked_loss,
    resolve_auto,
    rule_of,
)


@dataclass
class Estimate:
    method: str
    gpus: int
    params: float
    grads: float
    optimizer_states: float
    activations: float
    recompute: float
    update: float  # the update's transient fp32 memory on the GPU (LOMO)
    total: float
    host: float = 0.0  # host RAM for the whole node (all `gpus` ranks) with offloaded parameters
    accumulator: float = 0.0  # LOMO's shard accumulator (K > 1) of one rank: in `grads`, or (x gpus) in `host`
    accumulator_on_host: bool = False
    # the measuring backward's peak, where it keeps its graph for the updating one (LOMO, AdaLomo; 0 with one
    # backward, or a recomputed forward): `total` is the larger of the two backwards'
    measuring: float = 0.0
    # checkpointed layer inputs offloaded to host RAM (memory.offload_checkpoints), per rank; `host` has the node's
    checkpoints_host: float = 0.0
    # memory.int8_shards: each 8-bit term in bytes (planning/int8_shards.py int8_terms; in `params`); else empty
    int8: dict = field(default_factory=dict)

    @property
    def accounted(self) -> float:
        return self.params + self.grads + self.optimizer_states + self.activations

    def gib(self) -> dict:
        return {k: (v / GIB if isinstance(v, float) else {t: x / GIB for t, x in v.items()} if isinstance(v, dict)
                    else v) for k, v in asdict(self).items()}


def layer_activation_bytes(m: ModelSpec, run: RunSpec) -> float:
    """Bytes one decoder layer saves in the forward without checkpointing (docs/memory.md, "Activations";
    sdpa / flash attention and the sequence options: planning/sequence.py)."""
    T, b, h, d = run.tokens, run.b, m.hidden, m.d
    mlp = mlp_saved_bytes(m, run)
    if run.attn != "eager":
        return norm_saved_bytes(m, run) + attention_saved_bytes(m, run) + mlp + family_layer_bytes(m, run)
    rep = m.heads if m.k < m.heads else m.k
    return (2 * T * h * (4 + b) + 4 * T * m.heads * d * b + 2 * T * m.k * d * b + 2 * T * rep * d * b
            + eager_scores_bytes(m, run) + mlp + family_layer_bytes(m, run))


def recomputed_layer_bytes(m: ModelSpec, run: RunSpec) -> float:
    """One layer's saved bytes and what its backward holds beside them (the MLP's tile, the Ulysses buffers)."""
    return layer_activation_bytes(m, run) + layer_transient_bytes(m, run)


def family_layer_bytes(m: ModelSpec, run: RunSpec) -> float:
    """What a family's decoder layer saves beyond LLaMA's (measured on tiny models,
    tests/planning/test_planner_families.py):
      (norms - 2) T h (4 + b)     more norms per layer (Gemma 2, 3: four)
    + T (H + K) d (4 + b)         RMSNorm of each head's q and k (Qwen3, OLMo-2, Gemma 3)
    + 4 B H S^2                   tanh soft-capping of the fp32 attention scores (Gemma 2)
    MoE, in place of the dense MLP's 4 T f b, each token routed to k of E experts of width f_e:
      T k (3 h + 4 f_e + 2) b     each token-expert pair's input, gate/up, activation and output
    + 4 T E + 12 T k + 4 T        the router's fp32 probabilities, the top-k indices and weights
    + 4 T f_s b + 2 T h b         a shared expert of width f_s and its gate (Qwen2-MoE)"""
    T, b, h = run.tokens, run.b, m.hidden
    out = (m.norms_per_layer - 2) * T * h * (4 + b)
    if m.qk_norm:
        out += T * (m.heads + m.k) * m.d * (4 + b)
    if m.softcap and run.attn == "eager":
        out += 4 * run.batch * (m.heads // run.sp) * run.seq**2
    if m.experts:
        k = m.experts_per_tok
        out += T * k * (3 * h + 4 * m.expert_intermediate + 2) * b + 4 * T * m.experts + 12 * T * k + 4 * T
        if m.shared_intermediate:
            out += 4 * T * m.shared_intermediate * b + 2 * T * h * b
    return out


def gathered_expert_bytes(m: ModelSpec, run: RunSpec) -> int:
    """Bytes of one decoder layer's stacked expert tensors in the model dtype. Under ZeRO-3 on N > 1
    ranks the experts' matmuls save views of the gathered [E, R, C] tensors, which keep the
    gathered storage alive until the backward: every layer's experts stay gathered through the
    forward (without checkpointing), or the recomputed layer's (with it)."""
    per_layer = sum(math.prod(s) for s in m.param_shapes() if len(s) >= 3) // max(m.layers, 1)
    return run.b * per_layer


def activation_bytes(m: ModelSpec, run: RunSpec) -> tuple[float, float]:
    """(forward-saved bytes, recompute bytes added during backward)."""
    T, b, h = run.tokens, run.b, m.hidden
    # Every position labelled: the bound for packed chat; the recipe's forward computes the head
    # only from the first labelled position on (keep_labelled_logits).
    # the rotary cos/sin are saved by the layers that use them: not by checkpointed ones (their
    # forward keeps no graph)
    rotary = 0 if run.checkpointing else 2 * run.local_seq * m.d * b
    head = T * h * (4 + b) + loss_saved_bytes(m, run) + rotary
    layer = recomputed_layer_bytes(m, run)
    # The chunked loss's logits exist one chunk at a time, in its forward and in its backward
    # (before any layer is recomputed).
    loss = loss_transient_bytes(m, run)
    if run.checkpointing:
        # each checkpointed layer saves its inputs (on the GPU, or offloaded but for the two in
        # flight), and eager attention the 4-D causal mask shared by all layers
        mask = run.batch * run.seq**2 * b if run.attn == "eager" else 0
        return checkpoint_bytes(m, run)[0] + mask + head, max(layer, loss)
    return m.layers * layer_activation_bytes(m, run) + head, max(loss, layer_transient_bytes(m, run))


def loss_saved_bytes(m: ModelSpec, run: RunSpec) -> int:
    """What the loss saves for the backward, every position labelled. transformers' loss: the fp32
    log-softmax of every position (4 T V) and the targets. The chunked loss (engine/chunked_loss.py):
    the labelled positions' hidden states (a copy, T h b), their log-sum-exp (4 T), the targets and
    their positions (16 T), and where every position fits in one chunk, that chunk's gradient of the
    logits (4 T V: kept from the forward instead of recomputed, loss_kept_bytes)."""
    T = run.tokens
    if chunked_loss(m, run):
        return T * m.hidden * run.b + 20 * T + loss_kept_bytes(m, run)
    # tanh soft-capping of the fp32 logits (Gemma 2) saves them once more
    return 4 * T * m.vocab * (2 if m.final_softcap else 1) + 8 * T


def loss_chunk_bytes(m: ModelSpec, run: RunSpec) -> int:
    """The chunked loss's transient bytes, in its forward and again in its backward: one chunk of
    positions' logits (memory.loss_chunk_logits // V positions, at least one), in the model's dtype
    and in fp32 (6 bytes a logit in bf16, 4 in fp32), with Gemma-2's soft-capping its tanh and the
    capped logits beside them (12)."""
    c = min(max(1, run.loss_chunk // m.vocab), run.tokens)
    per_logit = 12 if m.final_softcap else 4 + (run.b if run.b != 4 else 0)
    return per_logit * c * m.vocab


def loss_backward_bytes(m: ModelSpec, run: RunSpec) -> int:
    """The chunked loss's transient bytes in its backward. One chunk (its kept gradient): within
    loss_chunk_bytes. Several (engine/chunked_loss.py _backward_by_vocabulary_blocks): blocks of the
    vocabulary over every position, a block's logits within loss_chunk_bytes, so that each block of
    the head's gradient is rounded once; the input's gradient is summed over the blocks in fp32
    instead (4 T h, an fp32 V h head gradient would be 4 V h). In fp32 that buffer is the input's
    gradient itself (returned, as the plain loss's, and not counted); in a lower dtype it is beside
    the block's logits cast to it (2 bytes a logit) and the block's product (b T h), which is added
    a slice of rows at a time (a CPU converts each slice to fp32 first: 4 T h / LOSS_ADD_SLICES,
    counted though a GPU converts in its kernel), or the input's gradient cast at the end (b T h)."""
    T, h = run.tokens, m.hidden
    chunk = loss_chunk_bytes(m, run)
    if not chunked_loss(m, run) or T <= max(1, run.loss_chunk // m.vocab) or run.b == 4:
        return chunk
    c = min(max(1, run.loss_chunk // m.vocab), T)
    return 4 * T * h + max(chunk, 2 * c * m.vocab + run.b * T * h + 4 * T * h // LOSS_ADD_SLICES)


def loss_transient_bytes(m: ModelSpec, run: RunSpec) -> int:
    """The chunked loss's transient bytes, the larger of its forward's and its backward's (0 for
    the plain loss, whose logits are saved activations)."""
    if not chunked_loss(m, run):
        return 0
    return max(loss_chunk_bytes(m, run), loss_backward_bytes(m, run))


def loss_kept_bytes(m: ModelSpec, run: RunSpec) -> int:
    """Where every position's logits fit in one chunk of the chunked loss, the chunk's fp32 gradient
    of the logits that its forward keeps for the backward (4 T V; saved, in loss_saved_bytes): made
    in place of the forward's fp32 logits (within loss_chunk_bytes) and freed by the loss's backward,
    before any layer's. In fp32 its backward multiplies by it as it is; in a lower dtype it casts it
    into one buffer (2 bytes a logit) an eighth at a time, within loss_chunk_bytes too."""
    T = run.tokens
    one_chunk = T <= max(1, run.loss_chunk // m.vocab)
    return 4 * T * m.vocab if chunked_loss(m, run) and one_chunk else 0


def measuring_backward_bytes(run: RunSpec, resident: float, layer: float, slice_n: int) -> float:
    """The peak of the first of two backwards (run.two_pass: norm clipping, or loss scaling, at
    K = 1) where it keeps its graph for the second ("retain_graph"), in its layers' backward; 0
    otherwise (one backward, or "recompute": its first backward frees the graph as the updating
    one does, and updates nothing). The retained graph keeps the one chunk's kept gradient of the
    logits (4 T V, saved: in `resident`'s activations) alive beside every recomputed layer, where
    the updating backward has freed it; the pass updates nothing, and sums each slice's squares
    through an fp32 copy of one chunk at a time where the slice is in a lower dtype
    (engine/update/shard.py grad_sum_sq). Its loss's forward and backward are the updating pass's."""
    if run.two_pass != "retain_graph" or run.accumulation > 1:
        return 0.0
    measure = 4 * min(slice_n, run.update_chunk) if run.b != 4 else 0
    return resident + layer + measure


def update_temp_bytes(n: int, run: RunSpec) -> int:
    """Transient bytes of the fused update of an n-element slice (docs/memory.md), which is
    updated memory.update_chunk_elements at a time (8-bit shards: int8_shards.update_temp_bytes)."""
    if run.int8_shards:
        return int8_shards.update_temp_bytes(n, run)
    n = min(n, run.update_chunk)
    if run.b == 4:
        # fp32 weights are updated in place; the gradient chunk is copied where it is masked (the
        # pass's finite flag on the device) or clipped, since it may be the received bucket itself
        return 4 * n
    grad32 = weights32 = 4 * n
    if run.lomo_fp32_master:
        return grad32  # the master is the fp32 weight: updated in place, then cast
    rounding = 13 * n if run.dtype == "bf16" and run.stochastic_rounding else 0
    return grad32 + weights32 + rounding


def adalomo_update_temp_bytes(bucket_n: int, slice_n: int, run: RunSpec, statistics_n: int = 0) -> int:
    """Transient bytes of AdaLomo's update of a bucket of `bucket_n` shard elements (its largest
    slice `slice_n`): each of its passes reads a slice chunk by chunk (engine/update/adalomo.py), so one
    chunk's fp32 gradient (u in its place), fp32 weights and rounding: LOMO's figure (an fp32 slice
    is updated whole, in place); beside it the statistics of its largest matrix, `statistics_n`
    rows + columns: their reduced sums, means and factors, 12 bytes each. An accumulated sum in host
    RAM (memory.accumulate_on cpu) is copied to the device once for the three passes: the bucket's
    fp32 sum, 4 bytes an element, rather than once a pass."""
    statistics = 12 * statistics_n
    copied = 4 * bucket_n if run.accumulation > 1 and run.accumulate_on_host and not run.offload else 0
    if run.b == 4 and not run.int8_shards:
        return copied + statistics  # fp32 gradient and weights: updated in place, nothing copied
    return copied + update_temp_bytes(min(bucket_n, slice_n), run) + statistics


def adalomo_statistics_numel(m: ModelSpec) -> int:
    """Rows + columns of the model's largest matrix (by rows + columns): AdaLomo's statistics."""
    return max((shape[0] + shape[1] for shape in m.param_shapes() if len(shape) == 2), default=0)


def adalomo_state_bytes(m: ModelSpec, gpus: int) -> int:
    """AdaLomo's optimizer state on each rank: fp32 row and column second moments of every matrix
    (of each matrix of a stacked [E, R, C] tensor: E (R + C)), whole on every rank (their sums are
    all-reduced), this rank's slice of the second moment of every vector, and an fp64 step count
    per parameter."""
    return sum(4 * math.prod(shape[:-2]) * (shape[-2] + shape[-1]) if len(shape) >= 2
               else 4 * math.ceil(math.prod(shape) / gpus) for shape in m.param_shapes()) + 8 * len(m.param_shapes())


# The built-in rules' planner terms (config/rules.py names them; rules.PlanTerms says how they are called).
def no_state_bytes(m: ModelSpec, gpus: int) -> int:
    """SGD keeps no state."""
    return 0


def sgd_update_bytes(m: ModelSpec, run: RunSpec, slice_n: int, bucket_n: int) -> int:
    """SGD updates slice by slice: one slice's chunk at a time."""
    return update_temp_bytes(slice_n, run)


def adalomo_update_bytes(m: ModelSpec, run: RunSpec, slice_n: int, bucket_n: int) -> int:
    return adalomo_update_temp_bytes(bucket_n, slice_n, run, adalomo_statistics_numel(m))


def adalomo_offload_update_bytes(m: ModelSpec, run: RunSpec, bucket_n: int) -> int:
    """AdaLomo's hook keeps its statistics on the device: the bucket's fp32 gradient (a copy unless
    it is fp32) and u, staged for the worker; the worker's update is LOMO's."""
    return 4 * bucket_n * (1 if run.b == 4 else 2)


def _terms(method: str):
    """(state_bytes, update_bytes, offload_update_bytes) of the rule planned as `method`."""
    plan = rule_of(method).plan
    offload = plan.offload_update_bytes
    return (rules.resolve(plan.state_bytes), rules.resolve(plan.update_bytes),
            rules.resolve(offload) if offload is not None else (lambda m, run, bucket_n: 0))


def gathered_param_bytes(m: ModelSpec, run: RunSpec, n: int) -> int:
    """What a GPU holds of the parameters beside its shards: the persistent parameters and the
    gathered working set W in the compute dtype (none on one GPU, where the shard is the parameter,
    unless offloaded); with 8-bit shards also on one GPU, and the gather's transients
    (int8_shards.param_bytes)."""
    if run.int8_shards:
        return int8_shards.param_bytes(m, run, n)[1]
    persist, work = working_set(m, run)
    return run.b * (persist + work) if n > 1 or run.offload else 0


def _refuse(method: str, gpus: int, run: RunSpec) -> None:
    """What the planner does not model, refused naming the setting."""
    int8_shards.check_int8(run)
    if run.int8_shards and method not in FUSED:
        raise ValueError(f"int8_shards: 8-bit shards are written by the fused update "
                         f"({' and '.join(METHOD_LABELS[r] for r in FUSED)}), not by DeepSpeed's {method!r}")
    if gpus % run.sp:
        raise ValueError(f"sp: {run.sp} sequence-parallel ranks need a GPU count that is a multiple of {run.sp}, "
                         f"got {gpus}")
    if run.offload and method not in FUSED:
        raise ValueError(f"offload_param: the planner models parameter offload for "
                         f"{' and '.join(METHOD_LABELS[r] for r in FUSED)} only, not {method!r}")


def estimate(m: ModelSpec, method: str, gpus: int, run: RunSpec = RunSpec()) -> Estimate:
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    run = resolve_auto(m, run)
    check_sequence(m, run)
    _refuse(method, gpus, run)
    numels = m.param_numels()
    P, n, b = sum(numels), gpus, run.b
    max_p = max(numels)
    shard_numel = sum(math.ceil(x / n) for x in numels)
    gathered = gathered_param_bytes(m, run, n)
    # the shards on the GPU, or (offload_param) in host RAM
    shards = int8_shards.host_shard_bytes(m, run, n) if run.int8_shards else b * shard_numel
    shard = 0 if run.offload else int8_shards.param_bytes(m, run, n)[0] if run.int8_shards else shards
    params = shard + gathered
    acts, recompute = activation_bytes(m, run)
    if n > 1 and m.experts:  # gathered experts held by the forward's saved views (gathered_expert_bytes)
        if run.checkpointing:
            recompute += gathered_expert_bytes(m, run)
        else:
            acts += m.layers * gathered_expert_bytes(m, run)
    if method in FUSED:
        state_bytes, update_bytes, offload_update_bytes = _terms(method)
        grads = b * max_p if n == 1 else (2 + 1 / n) * b * min(P, max(run.lomo_bucket * n, max_p))
        masters = 4 * shard_numel if run.lomo_fp32_master and b != 4 else 0
        # A rule's state stays on the rank's device, offloaded shards or not (engine/update/adalomo.py)
        state = state_bytes(m, n)
        slice_n = math.ceil(max_p / n)
        staged_n = max(min(run.lomo_bucket, shard_numel), slice_n)  # a bucket, at least the largest slice
        bucket_n = max_p if n == 1 else staged_n  # one GPU applies each gradient as it arrives
        update = update_bytes(m, run, slice_n, bucket_n)
        accumulator = DTYPE_BYTES[run.accumulate_dtype] * shard_numel if run.accumulation > 1 else 0
        on_host = run.offload or run.accumulate_on_host  # with offloaded shards it lives beside them
        host = 0.0
        if run.offload:
            # the masters live with the shards: in host RAM, like the update; the reduced slices
            # wait for the host-update worker in pinned staging buffers, a bucket each (at least
            # the largest slice), MAX_STAGED queued and one being applied
            staging = (HOST_STAGED_BUCKETS + 1) * b * staged_n
            host = float(n * (shards + masters + staging + update_temp_bytes(slice_n, run)))
            masters = 0
            # What the rule's hook keeps on the device; the host-update worker's update is SGD's.
            update = offload_update_bytes(m, run, bucket_n)
        if on_host:
            host += n * accumulator  # every rank's accumulator on the node
        else:
            grads += accumulator
        # The chunked loss's logits are gone before the first gradient is updated; the update runs
        # beside a recomputed layer (the layers' gradients arrive while it is alive).
        loss = loss_transient_bytes(m, run)
        layer = ((recomputed_layer_bytes(m, run) if run.checkpointing else layer_transient_bytes(m, run))
                 if chunked_loss(m, run) else recompute)
        resident = params + grads + masters + state + acts
        # The kept gradient of the logits (saved) is the forward's logits, gone before the layers' backward.
        updating = resident - loss_kept_bytes(m, run) + max(layer + update, loss)
        measuring = measuring_backward_bytes(run, resident, layer, slice_n)
        ckpt_host = checkpoint_bytes(m, run)[1]
        return Estimate(method, n, float(params), float(grads), float(masters + state), float(acts), float(recompute),
                        float(update), float(max(updating, measuring)), host + n * ckpt_host, float(accumulator),
                        on_host and accumulator > 0, float(measuring), float(ckpt_host),
                        int8_shards.int8_terms(m, run, n) if run.int8_shards else {})
    grad_buf = b * shard_numel + b * run.reduce_bucket
    fp32_grad = 4 * min(shard_numel, run.sub_group)
    optim = 4 * shard_numel
    if method == "adamw":
        optim += 8 * shard_numel
    elif run.sgd_momentum:
        optim += 4 * shard_numel
    backward = params + grad_buf + b * max_p + optim + acts + recompute
    # the gathered layers are released for the step
    step = params - (b * working_set(m, run)[1] if n > 1 else 0) + grad_buf + fp32_grad + optim
    grads = grad_buf + b * max_p + fp32_grad
    total = max(backward, step)
    ckpt_host = checkpoint_bytes(m, run)[1]
    return Estimate(method, n, float(params), float(grads), float(optim), float(acts), float(recompute), 0.0,
                    float(total), float(n * ckpt_host), checkpoints_host=float(ckpt_host))


@dataclass
class Plan:
    model: ModelSpec
    run: RunSpec
    gpu_mem_gib: float
    source: str = "planner defaults"  # where the run's figures came from, printed with the assumptions
    estimates: dict = field(default_factory=dict)  # (method, gpus) -> Estimate
    min_gpus: dict = field(default_factory=dict)  # method -> smallest count that fits, or None

    def fits(self, method: str, gpus: int) -> bool:
        return self.estimates[(method, gpus)].total <= self.gpu_mem_gib * GIB


def plan(m: ModelSpec, gpu_mem_gib: float = 24.0, run: RunSpec = RunSpec(), gpu_counts=GPU_COUNTS,
         methods=None, source: str = "planner defaults") -> Plan:
    """Every method x GPU count, and the smallest count that fits. Offloaded runs plan LOMO and AdaLomo only."""
    methods = methods or (FUSED if run.offload or run.int8_shards else METHODS)
    run = resolve_auto(m, run)
    p = Plan(m, run, gpu_mem_gib, source)
    if not any(c % run.sp == 0 for c in gpu_counts):
        raise ValueError(f"sp: {run.sp} sequence-parallel ranks need a GPU count that is a multiple of {run.sp}; "
                         f"none of {sorted(gpu_counts)} is (give it with --gpus)")
    for method in methods:
        p.min_gpus[method] = None
        for n in sorted(c for c in gpu_counts if c % run.sp == 0):  # the SP ranks are among the GPUs
            est = estimate(m, method, n, run)
            p.estimates[(method, n)] = est
            if p.min_gpus[method] is None and est.total <= gpu_mem_gib * GIB:
                p.min_gpus[method] = n
    return p


def io_host_bytes(m: ModelSpec, run: RunSpec, gpus: int) -> tuple[float, float]:
    """Host RAM that saving and exporting add to a run's (not in the GPU totals, nor in `host`):
    (the export's, on rank 0: one file of at most EXPORT_FILE_BYTES plus the tensor being gathered;
    a checkpoint save's or resume's, per rank: one shard tensor on its way to or from disk, in the
    parameters' dtype and, with fp32 masters, the master's; nothing more: torch.distributed.checkpoint's
    planners pass one piece at a time, and a resume reads into the live shards). With offload_param the
    shards are in host memory already: a save copies nothing."""
    b, max_p = run.b, max(m.param_numels())
    export = min(EXPORT_FILE_BYTES, b * m.n_params) + b * max_p
    slice_n = math.ceil(max_p / gpus)
    # 8-bit shards: the int8 slice and its scales (at most one more piece than whole blocks)
    piece = slice_n + 4 * (math.ceil(slice_n / run.int8_block) + 1) if run.int8_shards else b * slice_n
    per_rank = 0 if run.offload else piece + (4 * slice_n if run.lomo_fp32_master and b != 4 else 0)
    return float(export), float(per_rank)
