"""Per-GPU memory planner for LOMO, SGD and AdamW under DeepSpeed ZeRO-3, the smallest GPU count
that fits, and (with `offload_param: cpu`) the host RAM a LOMO run needs.

    p = plan_for_run(load_run_config("ds_configs/llama7b.json"), world=1, model_size="7b")
    print(format_plan(p))     # assumptions, per-method rows, the smallest GPU count for each
    est = estimate(LLAMA["13b"], "lomo", gpus=2, run=shipped_run("13b"))
    est.total                 # predicted peak bytes per GPU

The model: a LLaMA size (LLAMA), or any config.json transformers knows, built on the meta device
(model_tree.py: its real shapes and module tree, its decoder-layer class for leaf_module "auto").
Defaults are the shipped GPU configs' (ds_configs/llama*.json): bf16 weights, sequences of 512
tokens, activation checkpointing on, stochastic rounding on, lomo.bucket_size 25e6, and their
ZeRO-3 settings (one gather per decoder layer included); `shipped_run(size)` adds that size's
micro-batch (global batch 16 over the paper's GPU count). Every printed plan starts with the assumptions it made.

Notation: P parameters, N GPUs (ZeRO-3 data-parallel ranks), b bytes of the model dtype (2 for
fp16/bf16, 4 for fp32), T = batch x seq tokens per GPU, L layers, h hidden, f intermediate, V vocab,
H / K query / key-value heads of width d, n = ceil(max_p / N) the largest local slice. All figures
are bytes per GPU; GiB = 2^30 bytes (the paper's "GB" are GiB: 2 x 6.74e9 bytes = 12.55).

Model states
------------
  params       b P / N                        this rank's ZeRO-3 shards
             + b P_persist    (N > 1)         parameters of <= stage3_param_persistence_threshold
                                              elements (the RMSNorm weights) stay gathered everywhere
             + b W            (N > 1)         the gathered working set. DeepSpeed keeps gathered
                                              parameters up to stage3_max_live_parameters (and keeps
                                              those reused within stage3_max_reuse_distance), plus the
                                              fetch unit being computed and the prefetch bucket:
                                              W = min(P - P_persist, min(max_live, max_reuse) + largest
                                              fetch unit + stage3_prefetch_bucket_size).
                                              On one GPU the shard is the whole parameter: nothing is
                                              gathered.
  Fetch units (the fetch granularity). By default ZeRO-3 gathers each module's own parameters in
  its own hooks: the largest unit is the largest parameter (a Linear, or the embedding). A leaf
  module (zero_optimization.leaf_module: classes, names or name suffixes; or every module whose
  DeepSpeed "granularity", its parameters over its modules, is at most
  stage3_module_granularity_threshold, outermost first) is gathered whole, by one set of hooks:
  per decoder layer, the largest unit is a whole layer (12 h^2 for LLaMA-7B's 4096, 1.6 GB in bf16
  for 65B, against 0.36 GB for its largest Linear). Fewer, larger gathers cost less host time
  (fetch_units() lists them; format_plan prints W under each granularity). Not modelled: leaves
  made by the threshold go through DeepSpeed's fast leaf fetch, which was measured keeping about
  three times the working set above gathered on a small model (tests/test_planner.py); the
  shipped configs name their leaves (leaf_module.classes), where the measured peak matches W.
  LOMO grads   b max_p                        N = 1: the one gradient alive at a time (the largest
                                              parameter: the embedding / LM head)
  (2 + 1/N) b max(bucket x N, max_p)  N > 1: the gradients filling the next bucket (bucket_size
                                              elements of shard = bucket x N full elements), the
                                              rank-major payload of the one in flight, and its
                                              receive buffer (1/N of it)
  LOMO accum   a P / N  (K > 1)               gradient accumulation: this rank's accumulator of its
                                              reduced shards, a = 4 (lomo.accumulate_dtype fp32) or 2;
                                              on the GPU, or in host RAM (N a P / N per node) with
                                              lomo.accumulate_on "cpu" or offload_param "cpu"
  LOMO optim   0                              (4 P / N with fp32 master shards)
  AdaLomo optim  4 sum(r + c) + 4 V / N + 8 p   AdaLomo's state: fp32 row and column second moments
                                              of every r x c matrix (E (r + c) for E stacked MoE
                                              experts [E, r, c]; whole on every rank), this
                                              rank's slice of every vector's (V elements in all),
                                              an fp64 step count per parameter (p of them): 10 MiB
                                              for LLaMA-7B, 49 MiB for 65B (on 8 GPUs)
  DeepSpeed ZeRO-3 optimizer (SGD / AdamW, mixed precision):
  grads        b P / N                        the gradient shard buffer for the whole model
             + b reduce_bucket_size           the contiguous reduce bucket
             + b max_p                        the gradient alive before it is bucketed
             + 4 min(P / N, sub_group_size)   at the step, one sub-group's gradient in fp32
  optim        4 P / N                        fp32 master shards (a copy even for an fp32 model)
             + 4 P / N  (SGD with momentum)   / + 8 P / N (AdamW: exp_avg, exp_avg_sq)
  The DeepSpeed total is the larger of the backward-phase sum (states + buffers + working set +
  activations) and the step-phase sum (states + buffers + the fp32 sub-group gradient; activations
  and gathered parameters are gone by then).

The update's transient memory (LOMO; lomo_ds/engine/fused_update.py, ShardUpdater.apply)
-------------------------------------------------------------------------------------
The update of one slice of n elements allocates, while the backward's other memory is alive:
  4 n   g = grad_shard.float()           unless the gradient is fp32 already (then a view)
  4 n   weights = shard.float()          unless the shard is fp32, or an fp32 master copy is kept
 13 n   stochastic_round_to_bf16         bf16 shards without masters: the int32 noise (4 n), the
                                         isfinite mask (1 n), the rounded bits (4 n) and
                                         torch.where's result (4 n) live together
so 21 n bytes for bf16 with stochastic rounding, 8 n for fp16 (or bf16 without it), 0 for fp32.
The largest slice is the largest parameter's (the embedding / LM head): n = ceil(max_p / N).
AdaLomo (lomo_ds/engine/adalomo.py) needs a bucket's statistics before it updates any slice of it,
so the fp32 gradient and fp32 weights of the whole bucket (B elements of shard, or the largest
parameter on one GPU) live together: 8 B bytes, plus one slice's 13 n of rounding (bf16 without
masters); 4 B with fp32 masters, 0 for fp32. Under offload its hook keeps the bucket's fp32
gradient and u on the GPU (8 B, 4 B for fp32), and the worker's update is LOMO's, in host RAM.

Offloaded parameters (zero_optimization.offload_param.device = "cpu", LOMO and AdaLomo only)
------------------------------------------------------------------------------
The shards live in host RAM, and the update runs there on a copy of the reduced gradient slice.
  GPU     b P_persist + b W              persistent parameters and the gathered working set (on
                                         any N: a gathered parameter is never the host shard)
        + LOMO grads (as above) + activations; no shard, no update temporaries
  host    b P (+ 4 P fp32 masters)       every rank's shards, for the whole node (one node)
        + N (5 b B' + update temporaries) each rank's reduced slices staged in pinned buffers for the
                                         host-update worker (B' = max(bucket, n): MAX_STAGED = 4
                                         queued, one applied), and its update
Host RAM is for the N ranks on one machine; it leaves out the processes' own footprint (CUDA
context, Python, the DeepSpeed runtime) and the dataset. `lomo-ds plan --offload` prints, for the
shipped configs' settings on 24 GiB GPUs:

  | model | micro-batch | LOMO GPUs | GiB/GPU | host RAM GiB (node) |    without offload:
  | 7b    | 16          | 1         | 7.13    | 13.9                |    1 GPU, 17.43 GiB
  | 13b   | 8           | 1         | 6.01    | 25.9                |    2 GPUs, 18.67 GiB
  | 30b   | 4           | 1         | 5.91    | 62.7                |    4 GPUs, 21.64 GiB
  | 65b   | 2           | 1         | 5.84    | 124.1               |    8 GPUs, 21.67 GiB

Activations (bytes autograd saves in the forward; what lomo_ds.planning.memory.ActivationCounter counts)
------------------------------------------------------------------------------------------------
  per layer, no checkpointing (HF LLaMA, eager attention):
      2 T h (4 + b)                 two RMSNorms: the fp32 input and the normalised output
    + T H d b x 4                   q, rotate_half(q), rotated q, attention output (o_proj input)
    + T K d b x 2                   k, rotate_half(k)
    + T H' d b x 2                  repeated k and v (H' = H when K < H, else K)
    + B H S^2 (4 + b[b != 4])       fp32 softmax + its cast to the model dtype
    + 4 T f b                       gate, silu(gate), up, silu x up
  with (reentrant) checkpointing: T h b per layer (the layer input) + B S^2 b (the eager 4-D causal
  mask, one tensor every layer's checkpoint saves), and the backward recomputes one
  layer at a time: one layer's figure above is added to the peak ("recompute"), not to the
  forward-saved count.
  head: T h (4 + b) (final norm) + 4 T V (fp32 log-softmax of the loss) + 8 T (targets)
        + 2 S d b (rotary cos/sin, shared by all layers).

The total is a conservative peak: model states + forward activations (+ recompute) + the update's
temporaries, all at once. `accounted` is the same without the recompute and update terms: what the
engines' accounting (the MemoryTracker peak + the saved-tensor count) measures, and what tests/test_planner.py compares
against measured runs.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, replace

GIB = 2**30
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
METHODS = ("lomo", "adalomo", "sgd", "adamw")
FUSED = ("lomo", "adalomo")  # the methods whose update is fused into the backward (lomo_ds's engine)
METHOD_LABELS = {"lomo": "LOMO", "adalomo": "AdaLomo", "sgd": "SGD", "adamw": "AdamW"}
GPU_COUNTS = (1, 2, 4, 8)

# Buckets staged ahead of the host-update worker (engine/host_updates.py MAX_STAGED; not imported:
# the planner runs without torch's engine modules loaded). tests/test_planner.py checks they agree.
HOST_STAGED_BUCKETS = 4
# The largest safetensors file the export writes (storage/checkpoint.py MAX_SHARD_SIZE; not imported:
# planning sits below storage; tests/test_planner.py checks they agree).
EXPORT_FILE_BYTES = 5 * 10**9
# The model types whose output head the chunked loss knows (engine/chunked_loss.py HEADS, by
# transformers' model_type; not imported: planning sits below the engine; tests/test_planner.py
# checks they agree). Any other model keeps its own loss, fp32 logits of every position.
CHUNKED_LOSS_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3")


def chunked_loss(m: "ModelSpec", run: "RunSpec") -> bool:
    """Whether the run's loss is the chunked one: lomo.chunked_loss not off, and a head it knows."""
    return run.chunked_loss and m.family in CHUNKED_LOSS_FAMILIES


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hidden: int
    layers: int
    intermediate: int
    vocab: int = 32000
    heads: int = 32
    kv_heads: int | None = None
    head_dim: int | None = None
    tie: bool = False
    # From the model built on the meta device (planning/model_tree.py; the LLaMA sizes above need
    # none): every parameter's shape, the module tree, the decoder layer's class, the classes the
    # model names as unsplittable (leaf_module "auto"), and what the activation terms read.
    shapes: tuple | None = field(default=None, compare=False, repr=False)
    tree: object = field(default=None, compare=False, repr=False)
    family: str = "llama"
    layer_class: str = "LlamaDecoderLayer"
    no_split: tuple[str, ...] = ("LlamaDecoderLayer",)
    norms_per_layer: int = 2
    qk_norm: bool = False  # RMSNorm over each head's q and k (Qwen3, OLMo-2, Gemma 3)
    experts: int = 0  # MoE: routed experts per layer (stacked [E, R, C] tensors), 0 for a dense MLP
    experts_per_tok: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0  # a shared expert's MLP width (Qwen2-MoE)
    softcap: bool = False  # tanh soft-capping of the attention scores (Gemma 2)
    final_softcap: bool = False  # ... and of the logits

    @property
    def d(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def k(self) -> int:
        return self.kv_heads or self.heads

    def param_shapes(self) -> list[tuple[int, ...]]:
        """Every parameter's shape (nn.Linear: [out, in]): the built model's, else LLaMA's."""
        if self.shapes is not None:
            return list(self.shapes)
        h, f, d = self.hidden, self.intermediate, self.d
        out = [(self.vocab, h)]
        if not self.tie:
            out.append((self.vocab, h))
        for _ in range(self.layers):
            out += [(self.heads * d, h), (self.k * d, h), (self.k * d, h), (h, self.heads * d),
                    (f, h), (f, h), (h, f), (h,), (h,)]
        out.append((h,))
        return out

    def param_numels(self) -> list[int]:
        return [math.prod(shape) for shape in self.param_shapes()]

    @property
    def n_params(self) -> int:
        return sum(self.param_numels())


# The real LLaMA-1 configurations (Touvron et al. 2023; their HF config.json files).
LLAMA = {
    "7b": ModelSpec("llama-7b", 4096, 32, 11008, 32000, 32),
    "13b": ModelSpec("llama-13b", 5120, 40, 13824, 32000, 40),
    "30b": ModelSpec("llama-30b", 6656, 60, 17920, 32000, 52),
    "65b": ModelSpec("llama-65b", 8192, 80, 22016, 32000, 64),
}


# Micro-batch per GPU of each shipped config (ds_configs/llama<size>.json): the paper's global batch
# of 16 over the GPU count Table 2 gives the size. tests/test_planner.py checks these against the files.
SHIPPED_MICRO_BATCH = {"7b": 16, "13b": 8, "30b": 4, "65b": 2}

# DeepSpeed's own defaults for the zero_optimization keys the planner reads, for configs that leave
# them out (RunSpec's defaults are the shipped configs' values instead).
DEEPSPEED_ZERO_DEFAULTS = {"reduce_bucket_size": 500_000_000, "stage3_prefetch_bucket_size": 50_000_000,
                           "stage3_max_live_parameters": 1_000_000_000, "stage3_max_reuse_distance": 1_000_000_000,
                           "stage3_param_persistence_threshold": 100_000, "sub_group_size": 1_000_000_000}
_ZERO_FIELDS = {"reduce_bucket_size": "reduce_bucket", "stage3_prefetch_bucket_size": "prefetch",
                "stage3_max_live_parameters": "max_live", "stage3_max_reuse_distance": "max_reuse",
                "stage3_param_persistence_threshold": "persistence", "sub_group_size": "sub_group"}


# zero_optimization.leaf_module.classes for one gather per decoder layer (the shipped configs').
PER_LAYER = ("LlamaDecoderLayer",)
# zero_optimization.leaf_module "auto": the classes the model names in _no_split_modules
# (ModelSpec.no_split), resolved by resolve_auto as lomo_ds resolves it for DeepSpeed.
AUTO = ("auto",)


def resolve_auto(m: ModelSpec, run: RunSpec) -> RunSpec:
    """`run` with leaf_module "auto" replaced by the model's own unsplittable classes."""
    return replace(run, leaf_classes=tuple(m.no_split)) if run.leaf_classes == AUTO else run


@dataclass(frozen=True)
class RunSpec:
    """What a run does that the memory depends on. Defaults: the shipped GPU configs'."""

    seq: int = 512  # tokenizer.max_length
    batch: int = 1  # train_micro_batch_size_per_gpu (shipped_run(size) sets the shipped one)
    dtype: str = "bf16"
    checkpointing: bool = True  # model.gradient_checkpointing
    offload: bool = False  # zero_optimization.offload_param.device == "cpu"
    lomo_bucket: int = 25_000_000  # lomo.bucket_size (shard elements)
    lomo_fp32_master: bool = False
    stochastic_rounding: bool = True  # lomo.stochastic_rounding (bf16 shards without masters)
    reduce_bucket: int = 500_000_000  # zero_optimization.reduce_bucket_size
    prefetch: int = 50_000_000  # stage3_prefetch_bucket_size
    max_live: int = 1_000_000_000  # stage3_max_live_parameters
    max_reuse: int = 1_000_000_000  # stage3_max_reuse_distance
    persistence: int = 10_000  # stage3_param_persistence_threshold
    sub_group: int = 1_000_000_000  # sub_group_size
    sgd_momentum: bool = False  # the paper's SGD has none (Table 1: optimizer states = fp32 master only)
    # The fetch granularity (zero_optimization.leaf_module and stage3_module_granularity_threshold).
    # class names, or modules' dotted names / name suffixes; AUTO: the model's own (resolve_auto)
    leaf_classes: tuple[str, ...] = AUTO
    granularity_threshold: int = 0
    accumulation: int = 1  # gradient_accumulation_steps (LOMO keeps a shard accumulator when > 1)
    accumulate_dtype: str = "fp32"  # lomo.accumulate_dtype
    accumulate_on_host: bool = False  # lomo.accumulate_on == "cpu"
    update_chunk: int = 1 << 22  # lomo.update_chunk_elements
    chunked_loss: bool = True  # lomo.chunked_loss (a causal LM it knows)
    loss_chunk: int = 1 << 25  # lomo.loss_chunk_logits

    @property
    def b(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def assumptions(self, batch: bool = True) -> str:
        per_gpu = [f"micro-batch {self.batch} per GPU"] if batch else []
        return ", ".join([f"{self.dtype} weights", f"seq {self.seq}"] + per_gpu + [
            f"activation checkpointing {'on' if self.checkpointing else 'off'}",
            f"offload_param {'cpu' if self.offload else 'none'}", f"lomo.bucket_size {self.lomo_bucket:,}",
            f"stochastic rounding {'on' if self.stochastic_rounding else 'off'}",
            f"fp32 masters {'on' if self.lomo_fp32_master else 'off'}",
            f"persistence threshold {self.persistence:,}", f"max live parameters {self.max_live:,}",
            f"fetch {self.fetch_label}",
            f"gradient accumulation {self.accumulation}" + (
                f" ({self.accumulate_dtype} accumulator on the {'host' if self.accumulate_on_host else 'GPU'})"
                if self.accumulation > 1 else "")])

    @property
    def fetch_label(self) -> str:
        """The fetch granularity in words."""
        parts = [f"leaf_module {', '.join(self.leaf_classes)}"] if self.leaf_classes else []
        if self.granularity_threshold:
            parts.append(f"stage3_module_granularity_threshold {self.granularity_threshold:,}")
        return " + ".join(parts) if parts else "per module"


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

    @property
    def accounted(self) -> float:
        return self.params + self.grads + self.optimizer_states + self.activations

    def gib(self) -> dict:
        return {k: (v / GIB if isinstance(v, float) else v) for k, v in asdict(self).items()}


def layer_activation_bytes(m: ModelSpec, run: RunSpec) -> float:
    """Bytes one decoder layer saves in the forward without checkpointing (see module docstring)."""
    T, b, h, f, d = run.batch * run.seq, run.b, m.hidden, m.intermediate, m.d
    rep = m.heads if m.k < m.heads else m.k
    attn = run.batch * m.heads * run.seq**2 * (4 + (b if b != 4 else 0))
    return (2 * T * h * (4 + b) + 4 * T * m.heads * d * b + 2 * T * m.k * d * b + 2 * T * rep * d * b
            + attn + (4 * T * f * b if not m.experts else 0) + family_layer_bytes(m, run))


def family_layer_bytes(m: ModelSpec, run: RunSpec) -> float:
    """What a family's decoder layer saves beyond LLaMA's (measured on tiny models, tests/test_planner_families.py):
      (norms - 2) T h (4 + b)     more norms per layer (Gemma 2, 3: four)
    + T (H + K) d (4 + b)         RMSNorm of each head's q and k (Qwen3, OLMo-2, Gemma 3)
    + 4 B H S^2                   tanh soft-capping of the fp32 attention scores (Gemma 2)
    MoE, in place of the dense MLP's 4 T f b, each token routed to k of E experts of width f_e:
      T k (3 h + 4 f_e + 2) b     each token-expert pair's input, gate/up, activation and output
    + 4 T E + 12 T k + 4 T        the router's fp32 probabilities, the top-k indices and weights
    + 4 T f_s b + 2 T h b         a shared expert of width f_s and its gate (Qwen2-MoE)"""
    T, b, h = run.batch * run.seq, run.b, m.hidden
    out = (m.norms_per_layer - 2) * T * h * (4 + b)
    if m.qk_norm:
        out += T * (m.heads + m.k) * m.d * (4 + b)
    if m.softcap:
        out += 4 * run.batch * m.heads * run.seq**2
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
    T, b, h = run.batch * run.seq, run.b, m.hidden
    # Every position labelled: the bound for packed chat; the recipe's forward computes the head
    # only from the first labelled position on (keep_labelled_logits).
    head = T * h * (4 + b) + loss_saved_bytes(m, run) + 2 * run.seq * m.d * b
    layer = layer_activation_bytes(m, run)
    # The chunked loss's logits exist one chunk at a time, in its forward and in its backward
    # (before any layer is recomputed).
    loss = loss_chunk_bytes(m, run) if chunked_loss(m, run) else 0
    if run.checkpointing:
        # each checkpointed layer saves its inputs: the hidden states, and the (eager) 4-D causal mask
        # shared by all layers
        return m.layers * T * h * b + run.batch * run.seq**2 * b + head, max(layer, loss)
    return m.layers * layer + head, loss


@dataclass
class ModuleNode:
    """One module of a LLaMA as transformers builds it: its class, dotted name, own parameters
    (element counts; a tied weight is the same entry under both modules) and children."""

    cls: str
    name: str
    own: list = field(default_factory=list)  # [(parameter key, numel)]
    children: list = field(default_factory=list)
    container: bool = False  # an nn.ModuleList: never a leaf (DeepSpeed's rule)

    def params(self) -> dict:
        """Every parameter under this module, once each: key -> numel."""
        out = dict(self.own)
        for c in self.children:
            out.update(c.params())
        return out


def module_tree(m: ModelSpec) -> ModuleNode:
    """The model's module tree with parameter sizes: the built model's (model_tree.py), else
    LlamaForCausalLM's (transformers' LLaMA)."""
    if m.tree is not None:
        return m.tree
    h, f, d = m.hidden, m.intermediate, m.d

    def linear(name, numel):
        return ModuleNode("Linear", name, [(name + ".weight", numel)])

    def norm(name):
        return ModuleNode("LlamaRMSNorm", name, [(name + ".weight", h)])

    layers = []
    for i in range(m.layers):
        p = f"model.layers.{i}"
        attn = ModuleNode("LlamaAttention", p + ".self_attn", children=[
            linear(p + ".self_attn.q_proj", h * m.heads * d), linear(p + ".self_attn.k_proj", h * m.k * d),
            linear(p + ".self_attn.v_proj", h * m.k * d), linear(p + ".self_attn.o_proj", m.heads * d * h)])
        mlp = ModuleNode("LlamaMLP", p + ".mlp", children=[
            linear(p + ".mlp.gate_proj", h * f), linear(p + ".mlp.up_proj", h * f), linear(p + ".mlp.down_proj", f * h),
            ModuleNode("SiLU", p + ".mlp.act_fn")])
        layers.append(ModuleNode("LlamaDecoderLayer", p, children=[
            attn, mlp, norm(p + ".input_layernorm"), norm(p + ".post_attention_layernorm")]))
    embed = ModuleNode("Embedding", "model.embed_tokens", [("model.embed_tokens.weight", m.vocab * h)])
    model = ModuleNode("LlamaModel", "model", children=[
        embed, ModuleNode("ModuleList", "model.layers", children=layers, container=True), norm("model.norm"),
        ModuleNode("LlamaRotaryEmbedding", "model.rotary_emb")])
    head_key = "model.embed_tokens.weight" if m.tie else "lm_head.weight"
    head = ModuleNode("Linear", "lm_head", [(head_key, m.vocab * h)])
    return ModuleNode("LlamaForCausalLM", "", children=[model, head])


_MAX_LEAF = 1e9  # DeepSpeed never makes a module of more parameters a leaf by threshold (Z3_MAX_LEAF_SIZE)


def _granularity(node: ModuleNode, out: dict) -> tuple[int, int]:
    """DeepSpeed's module granularity (its parameters over its modules, torch leaves and itself
    counted; a tied weight counted under each module), recorded in out[id(node)]; returns
    (modules, parameters) under `node`."""
    if not node.params():
        out[id(node)] = math.inf
        return 0, 0
    own = sum(n for _, n in node.own)
    if not node.children:
        out[id(node)] = math.inf
        return 1, own
    layers, params = 0, own
    for c in node.children:
        cl, cp = _granularity(c, out)
        layers, params = layers + cl, params + cp
    if node.container:
        out[id(node)] = math.inf
        return layers, params
    layers += 1
    out[id(node)] = params // layers if params <= _MAX_LEAF else math.inf
    return layers, params


def _is_leaf_by_config(node: ModuleNode, run: RunSpec) -> bool:
    return any(node.cls == c or node.name == c or (node.name and node.name.endswith(c)) for c in run.leaf_classes)


def fetch_units(m: ModelSpec, run: RunSpec) -> list[tuple[str, int]]:
    """What ZeRO-3 gathers as one unit under the run's fetch granularity, as (module name,
    elements), each parameter in the first unit that holds it; persistent parameters (at most
    stage3_param_persistence_threshold elements) stay gathered and belong to none."""
    return _fetch_plan(m, run)[0]


def leaf_module_names(m: ModelSpec, run: RunSpec) -> list[str]:
    """The modules ZeRO-3 makes leaves (gathered whole) under the run's settings, by dotted name."""
    return _fetch_plan(m, run)[1]


def _fetch_plan(m: ModelSpec, run: RunSpec) -> tuple[list[tuple[str, int]], list[str]]:
    run = resolve_auto(m, run)
    root = module_tree(m)
    gran: dict = {}
    if run.granularity_threshold:
        _granularity(root, gran)
    units, leaves, seen = [], [], set()

    def add(name, params: dict):
        fresh = {k: n for k, n in params.items() if k not in seen and n > run.persistence}
        seen.update(fresh)
        if fresh:
            units.append((name or "(model)", sum(fresh.values())))

    def walk(node: ModuleNode):
        if not node.params():
            return
        if _is_leaf_by_config(node, run) or gran.get(id(node), math.inf) <= run.granularity_threshold:
            leaves.append(node.name)
            add(node.name, node.params())
            return
        add(node.name, dict(node.own))
        for c in node.children:
            walk(c)

    walk(root)
    return units, leaves


def _working_set(m: ModelSpec, run: RunSpec) -> tuple[int, int]:
    """(persistent elements, elements of the gathered working set W)."""
    numels = m.param_numels()
    persist = sum(x for x in numels if x <= run.persistence)
    work = min(sum(numels) - persist, min(run.max_live, run.max_reuse) + largest_fetch_unit(m, run)[1] + run.prefetch)
    return persist, work


def largest_fetch_unit(m: ModelSpec, run: RunSpec) -> tuple[str, int]:
    """The largest unit gathered at once: (module name, elements); ("", 0) when none is."""
    return max(fetch_units(m, run), key=lambda u: u[1], default=("", 0))


def loss_saved_bytes(m: ModelSpec, run: RunSpec) -> int:
    """What the loss saves for the backward, every position labelled. transformers' loss: the fp32
    log-softmax of every position (4 T V) and the targets. The chunked loss (engine/chunked_loss.py):
    the labelled positions' hidden states (a copy, T h b), their log-sum-exp (4 T), the targets and
    their positions (16 T), and where every position fits in one chunk, that chunk's gradient of the
    logits (4 T V: kept from the forward instead of recomputed)."""
    T = run.batch * run.seq
    if chunked_loss(m, run):
        return T * m.hidden * run.b + 20 * T + loss_kept_bytes(m, run)
    # tanh soft-capping of the fp32 logits (Gemma 2) saves them once more
    return 4 * T * m.vocab * (2 if m.final_softcap else 1) + 8 * T


def loss_chunk_bytes(m: ModelSpec, run: RunSpec) -> int:
    """The chunked loss's transient bytes, in its forward and again in its backward: one chunk of
    positions' logits (lomo.loss_chunk_logits // V positions, at least one), in the model's dtype
    and in fp32 (6 bytes a logit in bf16, 4 in fp32), with Gemma-2's soft-capping its tanh and the
    capped logits beside them (12)."""
    c = min(max(1, run.loss_chunk // m.vocab), run.batch * run.seq)
    per_logit = 12 if m.final_softcap else 4 + (run.b if run.b != 4 else 0)
    return per_logit * c * m.vocab


def loss_kept_bytes(m: ModelSpec, run: RunSpec) -> int:
    """Where every position's logits fit in one chunk of the chunked loss, the chunk's fp32 gradient
    of the logits that its forward keeps for the backward (4 T V; saved, in loss_saved_bytes): made
    in place of the forward's fp32 logits (within loss_chunk_bytes) and freed by the loss's backward,
    before any layer's. Its backward scales it an eighth at a time, within loss_chunk_bytes too."""
    T = run.batch * run.seq
    one_chunk = T <= max(1, run.loss_chunk // m.vocab)
    return 4 * T * m.vocab if chunked_loss(m, run) and one_chunk else 0


def update_temp_bytes(n: int, run: RunSpec) -> int:
    """Transient bytes of the fused update of an n-element slice (module docstring), which is
    updated lomo.update_chunk_elements at a time."""
    n = min(n, run.update_chunk)
    if run.b == 4:
        return 0
    grad32 = weights32 = 4 * n
    if run.lomo_fp32_master:
        return grad32  # the master is the fp32 weight: updated in place, then cast
    rounding = 13 * n if run.dtype == "bf16" and run.stochastic_rounding else 0
    return grad32 + weights32 + rounding


def adalomo_update_temp_bytes(bucket_n: int, slice_n: int, run: RunSpec, statistics_n: int = 0) -> int:
    """Transient bytes of AdaLomo's update of a bucket of `bucket_n` shard elements (its largest
    slice `slice_n`): each of its passes reads a slice chunk by chunk (engine/adalomo.py), so one
    chunk's fp32 gradient (u in its place), fp32 weights and rounding: LOMO's figure (an fp32 slice
    is updated whole, in place); beside it the statistics of its largest matrix, `statistics_n`
    rows + columns: their reduced sums, means and factors, 12 bytes each."""
    return update_temp_bytes(min(bucket_n, slice_n), run) + 12 * statistics_n


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


def estimate(m: ModelSpec, method: str, gpus: int, run: RunSpec = RunSpec()) -> Estimate:
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    run = resolve_auto(m, run)
    if run.offload and method not in FUSED:
        raise ValueError(f"offload_param: the planner models parameter offload for LOMO and AdaLomo only, "
                         f"not {method!r}")
    numels = m.param_numels()
    P, n, b = sum(numels), gpus, run.b
    max_p = max(numels)
    shard_numel = sum(math.ceil(x / n) for x in numels)
    persist, work = _working_set(m, run)
    gathered = b * (persist + work) if n > 1 or run.offload else 0  # on one GPU the shard is the parameter
    shard = 0 if run.offload else b * shard_numel
    params = shard + gathered
    acts, recompute = activation_bytes(m, run)
    if n > 1 and m.experts:  # gathered experts held by the forward's saved views (gathered_expert_bytes)
        if run.checkpointing:
            recompute += gathered_expert_bytes(m, run)
        else:
            acts += m.layers * gathered_expert_bytes(m, run)
    if method in FUSED:
        grads = b * max_p if n == 1 else (2 + 1 / n) * b * min(P, max(run.lomo_bucket * n, max_p))
        masters = 4 * shard_numel if run.lomo_fp32_master and b != 4 else 0
        # AdaLomo's state stays on the rank's device, offloaded shards or not (engine/adalomo.py)
        state = adalomo_state_bytes(m, n) if method == "adalomo" else 0
        slice_n = math.ceil(max_p / n)
        staged_n = max(min(run.lomo_bucket, shard_numel), slice_n)  # a bucket, at least the largest slice
        bucket_n = max_p if n == 1 else staged_n  # one GPU applies each gradient as it arrives
        update = (update_temp_bytes(slice_n, run) if method == "lomo" else
                  adalomo_update_temp_bytes(bucket_n, slice_n, run, adalomo_statistics_numel(m)))
        accumulator = DTYPE_BYTES[run.accumulate_dtype] * shard_numel if run.accumulation > 1 else 0
        on_host = run.offload or run.accumulate_on_host  # with offloaded shards it lives beside them
        host = 0.0
        if run.offload:
            # the masters live with the shards: in host RAM, like the update; the reduced slices
            # wait for the host-update worker in pinned staging buffers, a bucket each (at least
            # the largest slice), MAX_STAGED queued and one being applied
            staging = (HOST_STAGED_BUCKETS + 1) * b * staged_n
            host = float(n * (b * shard_numel + masters + staging + update_temp_bytes(slice_n, run)))
            masters = 0
            # AdaLomo's hook keeps its statistics on the device: the bucket's fp32 gradient (a copy
            # unless it is fp32) and u, staged for the worker; the worker's update is LOMO's.
            update = (4 * bucket_n * (1 if b == 4 else 2)) if method == "adalomo" else 0
        if on_host:
            host += n * accumulator  # every rank's accumulator on the node
        else:
            grads += accumulator
        # The chunked loss's logits are gone before the first gradient is updated; the update runs
        # beside a recomputed layer (the layers' gradients arrive while it is alive).
        loss = loss_chunk_bytes(m, run) if chunked_loss(m, run) else 0
        layer = (layer_activation_bytes(m, run) if run.checkpointing else 0) if chunked_loss(m, run) else recompute
        # The kept gradient of the logits (saved) is the forward's logits, gone before the layers' backward.
        total = params + grads + masters + state + acts - loss_kept_bytes(m, run) + max(layer + update, loss)
        return Estimate(method, n, float(params), float(grads), float(masters + state), float(acts), float(recompute),
                        float(update), float(total), host, float(accumulator), on_host and accumulator > 0)
    grad_buf = b * shard_numel + b * run.reduce_bucket
    fp32_grad = 4 * min(shard_numel, run.sub_group)
    optim = 4 * shard_numel
    if method == "adamw":
        optim += 8 * shard_numel
    elif run.sgd_momentum:
        optim += 4 * shard_numel
    backward = params + grad_buf + b * max_p + optim + acts + recompute
    step = params - (b * work if n > 1 else 0) + grad_buf + fp32_grad + optim  # gathered layers are released
    grads = grad_buf + b * max_p + fp32_grad
    total = max(backward, step)
    return Estimate(method, n, float(params), float(grads), float(optim), float(acts), float(recompute), 0.0,
                    float(total))


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
    methods = methods or (FUSED if run.offload else METHODS)
    run = resolve_auto(m, run)
    p = Plan(m, run, gpu_mem_gib, source)
    for method in methods:
        p.min_gpus[method] = None
        for n in sorted(gpu_counts):
            est = estimate(m, method, n, run)
            p.estimates[(method, n)] = est
            if p.min_gpus[method] is None and est.total <= gpu_mem_gib * GIB:
                p.min_gpus[method] = n
    return p


# The fetch granularities the planner weighs, coarsest first: one decoder layer per gather (as
# PyTorch FSDP2 wraps a layer), then DeepSpeed's default of one module's own parameters.
GRANULARITIES = {"per decoder layer": {"leaf_classes": AUTO, "granularity_threshold": 0},
                 "per module": {"leaf_classes": (), "granularity_threshold": 0}}


@dataclass(frozen=True)
class GranularityRow:
    name: str
    run: RunSpec
    units: int  # gathers per pass over the model
    largest: tuple[str, int]  # (module, elements) of the largest unit
    gathered: float  # bytes per GPU: persistent + the working set W (0 on one GPU)
    estimate: Estimate
    fits: bool


def granularity_rows(m: ModelSpec, run: RunSpec, gpus: int, gpu_mem_gib: float, method: str = "lomo"
                     ) -> list[GranularityRow]:
    """`method` on `gpus` GPUs under each fetch granularity, coarsest first; the run's own
    granularity is added when it is neither."""
    run = resolve_auto(m, run)
    options = {name: resolve_auto(m, replace(run, **fields)) for name, fields in GRANULARITIES.items()}
    if all(o.fetch_label != run.fetch_label for o in options.values()):
        options = {f"this config: {run.fetch_label}": run, **options}
    rows = []
    for name, r in options.items():
        est = estimate(m, method, gpus, r)
        persist, work = _working_set(m, r)
        gathered = r.b * (persist + work) if gpus > 1 or r.offload else 0
        rows.append(GranularityRow(name, r, len(fetch_units(m, r)), largest_fetch_unit(m, r), float(gathered), est,
                                   est.total <= gpu_mem_gib * GIB))
    return rows


def coarsest_fitting(m: ModelSpec, run: RunSpec, gpus: int, gpu_mem_gib: float) -> GranularityRow | None:
    """The coarsest of GRANULARITIES under which LOMO fits on `gpus` GPUs (None: not even per module)."""
    return next((row for row in granularity_rows(m, run, gpus, gpu_mem_gib)
                 if row.name in GRANULARITIES and row.fits), None)


def format_granularity(p: Plan, gpus: int | None = None) -> str:
    """The gathered working set and LOMO's total under each fetch granularity, on `gpus` GPUs
    (default: the smallest count LOMO fits on, else the largest planned)."""
    counts = sorted({n for _, n in p.estimates})
    n = gpus or p.min_gpus.get("lomo") or counts[-1]
    rows = granularity_rows(p.model, p.run, n, p.gpu_mem_gib)
    lines = [f"fetch granularity: LOMO on {n} GPU(s), {p.gpu_mem_gib:g} GiB each (this config: {p.run.fetch_label})",
             "", "| fetch | gathers per pass | largest unit (elements) | gathered GiB/GPU | total GiB/GPU | fits |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row.name} | {row.units} | {row.largest[1]:,} ({row.largest[0]}) | {row.gathered / GIB:.2f} | "
                     f"{row.estimate.total / GIB:.2f} | {'yes' if row.fits else 'OOM'} |")
    best = next((r for r in rows if r.name in GRANULARITIES and r.fits), None)
    lines.append("")
    lines.append(f"coarsest fetch that fits: {best.name} ({best.run.fetch_label})" if best else
                 "coarsest fetch that fits: none (LOMO does not fit on this count even per module)")
    if n == 1:
        lines.append("(one GPU holds whole parameters: nothing is gathered, so coarse fetch costs no memory)")
    return "\n".join(lines)


def io_host_bytes(m: ModelSpec, run: RunSpec, gpus: int) -> tuple[float, float]:
    """Host RAM that saving and exporting add to a run's (not in the GPU totals, nor in `host`):
    (the export's, on rank 0: one file of at most EXPORT_FILE_BYTES plus the tensor being gathered;
    a checkpoint save's or resume's, per rank: one shard tensor on its way to or from disk, in the
    parameters' dtype and, with fp32 masters, the master's; nothing more: resume reads its file
    memory-mapped). With offload_param the shards are in host memory already: a save copies nothing."""
    b, max_p = run.b, max(m.param_numels())
    export = min(EXPORT_FILE_BYTES, b * m.n_params) + b * max_p
    slice_n = math.ceil(max_p / gpus)
    per_rank = 0 if run.offload else b * slice_n + (4 * slice_n if run.lomo_fp32_master and b != 4 else 0)
    return float(export), float(per_rank)


def format_plan(p: Plan, gpus: int | None = None) -> str:
    m, run = p.model, p.run
    accumulating = run.accumulation > 1
    host = run.offload or (accumulating and run.accumulate_on_host)
    grads = ["grads (incl. accumulator)", "accumulator"] if accumulating else ["grads"]
    columns = ["method", "GPUs", "params", *grads,
               "optimizer states",
               "activations (+recompute)", "update tmp", "total GiB/GPU", *(["host RAM GiB (node)"] if host else []),
               "fits"]
    moe = f", {m.experts} experts of f={m.expert_intermediate}, top {m.experts_per_tok}" if m.experts else ""
    lines = [f"# {m.name}: {m.n_params / 1e9:.2f}B parameters (h={m.hidden}, L={m.layers}, f={m.intermediate}, "
             f"V={m.vocab}{moe}); decoder layer {m.layer_class}; {p.gpu_mem_gib:g} GiB per GPU",
             f"assumptions ({p.source}): {run.assumptions()}",
             "",
             "| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for (method, n), e in p.estimates.items():
        cells = [method, str(n), f"{e.params / GIB:.2f}", f"{e.grads / GIB:.2f}"]
        if accumulating:
            # Per GPU, inside grads; or per rank in host RAM (the node's host column counts every rank's).
            cells.append("-" if not e.accumulator else
                         f"{e.accumulator / GIB:.2f}" + (" (host)" if e.accumulator_on_host else ""))
        cells += [f"{e.optimizer_states / GIB:.2f}", f"{e.activations / GIB:.2f} (+{e.recompute / GIB:.2f})",
                  f"{e.update / GIB:.2f}", f"{e.total / GIB:.2f}"]
        if host:
            cells.append(f"{e.host / GIB:.1f}")
        cells.append("yes" if p.fits(method, n) else "OOM")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    counts = sorted({n for _, n in p.estimates})
    for method, g in p.min_gpus.items():
        lines.append(f"smallest GPU count for {method}: {g if g else 'none of ' + ','.join(map(str, counts))}")
    n = gpus or max(counts)
    export, per_rank = io_host_bytes(m, run, n)
    lines.append(f"host RAM for checkpoints and the export (beyond training's, on {n} GPU(s)): the export "
                 f"{export / GIB:.2f} GiB on rank 0 (one file of at most {EXPORT_FILE_BYTES / 1e9:g} GB and the "
                 f"tensor being gathered); a checkpoint save or resume {per_rank / GIB:.2f} GiB per rank "
                 "(one tensor at a time; resume reads memory-mapped)")
    if "lomo" in p.min_gpus:
        lines += ["", format_granularity(p, gpus)]
    return "\n".join(lines)


def shipped_plans(gpu_mem_gib: float = 24.0, offload: bool = False, **overrides) -> dict[str, Plan]:
    """One plan per LLaMA size, each with its shipped config's settings (and `overrides`)."""
    return {size: plan(spec, gpu_mem_gib, replace(shipped_run(size), offload=offload, **overrides),
                       source=f"ds_configs/llama{size}.json defaults")
            for size, spec in LLAMA.items()}


def format_summary(plans: dict[str, Plan]) -> str:
    """Smallest GPU count per size and method (with offload: LOMO's, and the host RAM it needs)."""
    first = next(iter(plans.values()))
    offload = first.run.offload
    # AdaLomo, and SGD and AdamW where they are planned (not with offload)
    others = [m for m in METHODS if m != "lomo" and m in first.min_gpus]
    columns = ["model", "params", "micro-batch", "LOMO GPUs", "GiB/GPU",
               *(["host RAM GiB (node)"] if offload else []), *(f"{METHOD_LABELS[m]} GPUs" for m in others)]
    lines = [f"# the smallest number of {first.gpu_mem_gib:g} GiB GPUs for each LLaMA size with its shipped config "
             f"(ds_configs/llama<size>.json): {first.run.assumptions(batch=False)}", "",
             "| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for size, p in plans.items():
        g = p.min_gpus["lomo"]
        e = p.estimates[("lomo", g)] if g else None
        cells = [size, f"{p.model.n_params / 1e9:.2f}B", str(p.run.batch), str(g or "none"),
                 f"{e.total / GIB:.2f}" if e else "-"]
        if offload:
            cells.append(f"{e.host / GIB:.1f}" if e else "-")
        cells += [str(p.min_gpus[m] or "none") for m in others]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


ACCUMULATOR_PLACES = (("fp32", False), ("bf16", False), ("fp32", True))  # (lomo.accumulate_dtype, on the host)


def format_accumulation_summary(gpu_mem_gib: float = 24.0, accumulation: int = 4, **overrides) -> str:
    """LOMO with gradient accumulation for every LLaMA size and its shipped config: the smallest GPU
    count with an fp32 or bf16 accumulator on the GPU, or an fp32 one in host RAM."""
    lines = [f"# LOMO with gradient_accumulation_steps {accumulation}: the accumulator (1/N of the model per rank) "
             f"on each {gpu_mem_gib:g} GiB GPU or in host RAM (lomo.accumulate_on cpu)", "",
             "| model | micro-batch | accumulator | LOMO GPUs | GiB/GPU | accumulator GiB/rank | host RAM GiB (node) |",
             "|---|---|---|---|---|---|---|"]
    for size, spec in LLAMA.items():
        for dtype, on_host in ACCUMULATOR_PLACES:
            run = replace(shipped_run(size), accumulation=accumulation, accumulate_dtype=dtype,
                          accumulate_on_host=on_host, **overrides)
            p = plan(spec, gpu_mem_gib, run, methods=("lomo",))
            g = p.min_gpus["lomo"]
            e = p.estimates[("lomo", g)] if g else None
            lines.append(f"| {size} | {run.batch} | {dtype} on the {'host' if on_host else 'GPU'} | {g or 'none'} | "
                         + (f"{e.total / GIB:.2f} | {e.accumulator / GIB:.2f} | {e.host / GIB:.1f} |" if e else
                            "- | - | - |"))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- inputs
def run_spec(**overrides) -> RunSpec:
    return replace(RunSpec(), **overrides)


def shipped_run(size: str) -> RunSpec:
    """The shipped config's run for a LLaMA size (ds_configs/llama<size>.json)."""
    return RunSpec(batch=SHIPPED_MICRO_BATCH[size])


def spec_from_hf_config(cfg: dict, name: str = "model") -> ModelSpec:
    """The architecture of a config.json: with a model_type, the model transformers builds from it
    (on the meta device: planning/model_tree.py); without one, LLaMA's tree of these sizes."""
    if cfg.get("model_type"):
        from lomo_ds.planning.model_tree import spec_from_config

        return spec_from_config(cfg, name)
    try:
        return ModelSpec(name=name, hidden=int(cfg["hidden_size"]), layers=int(cfg["num_hidden_layers"]),
                         intermediate=int(cfg["intermediate_size"]), vocab=int(cfg.get("vocab_size", 32000)),
                         heads=int(cfg["num_attention_heads"]),
                         kv_heads=cfg.get("num_key_value_heads"), head_dim=cfg.get("head_dim"),
                         tie=bool(cfg.get("tie_word_embeddings", False)),
                         final_softcap=bool(cfg.get("final_logit_softcapping")))
    except KeyError as e:
        raise ValueError(f"{name}: not a LLaMA-style config, missing {e.args[0]!r}") from None


def run_overrides_from_ds(ds: dict) -> dict:
    """RunSpec fields a DeepSpeed config decides: precision, micro-batch, ZeRO-3 sizes and parameter
    offload. A zero_optimization key left out is DeepSpeed's default, not the planner's."""
    zero = ds.get("zero_optimization") or {}
    out = {f: int(float(zero.get(k, DEEPSPEED_ZERO_DEFAULTS[k]))) for k, f in _ZERO_FIELDS.items()}
    leaf = zero.get("leaf_module") or {}
    out["leaf_classes"] = AUTO if leaf == "auto" else tuple(str(x) for key in ("classes", "names", "name_suffixes")
                                for x in ([leaf[key]] if isinstance(leaf.get(key), str) else leaf.get(key) or []))
    out["granularity_threshold"] = int(float(zero.get("stage3_module_granularity_threshold",
                                                      zero.get("module_granularity_threshold", 0))))
    out["dtype"] = ("bf16" if (ds.get("bf16") or {}).get("enabled") else
                    "fp16" if (ds.get("fp16") or {}).get("enabled") else "fp32")
    out["offload"] = ((zero.get("offload_param") or {}).get("device") or "none") == "cpu"
    if "train_micro_batch_size_per_gpu" in ds:
        out["batch"] = int(ds["train_micro_batch_size_per_gpu"])
    return out


def run_spec_for(cfg) -> RunSpec:
    """The RunSpec of a validated run config (lomo_ds.config.run.RunConfig)."""
    return replace(RunSpec(), **run_overrides_from_ds(cfg.ds), seq=cfg.tokenizer.max_length,
                   checkpointing=cfg.model.gradient_checkpointing, lomo_bucket=cfg.lomo.bucket_size,
                   lomo_fp32_master=cfg.lomo.fp32_master_weights, stochastic_rounding=cfg.lomo.stochastic_rounding,
                   accumulation=cfg.lomo.accumulation_steps, accumulate_dtype=cfg.lomo.accumulate_dtype,
                   accumulate_on_host=cfg.lomo.accumulate_on == "cpu", update_chunk=cfg.lomo.update_chunk_elements,
                   chunked_loss=cfg.lomo.chunked_loss != "off", loss_chunk=cfg.lomo.loss_chunk_logits)


def model_spec_for(cfg, model_size: str | None = None) -> ModelSpec:
    """The architecture a run config trains: `model_size` (7b|13b|30b|65b), else the config's
    model.planner_size or model.planner_config (a config.json), else read from model.path (an HF
    folder's config.json, or the GGUF file's metadata: the builtin model). A path that is not on
    this machine (the shipped configs' placeholders, a hub name) needs one of the others."""
    from lomo_ds.config.run import resolve_model_source

    model_size = model_size or cfg.model.planner_size
    if model_size is not None:
        return llama_spec(model_size)
    if cfg.model.planner_config:
        if hf_config_path(cfg.model.planner_config) is None:
            raise ValueError(f"model.planner_config {cfg.model.planner_config!r}: not an HF config.json")
        return resolve_model(cfg.model.planner_config)
    source, gguf = resolve_model_source(cfg.model.path, cfg.model.gguf_file)
    if gguf:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        hf = load_gguf_checkpoint(os.path.join(source, gguf), return_tensors=False)["config"]
        return spec_from_hf_config(hf, name=os.path.splitext(gguf)[0])
    config_json = os.path.join(source, "config.json")
    if not os.path.isfile(config_json):
        raise ValueError(f"model.path {cfg.model.path!r}: no config.json there to read the architecture from; "
                         f"set model.planner_size (or lomo-ds plan --size) to one of {list(LLAMA)}")
    with open(config_json) as f:
        return spec_from_hf_config(json.load(f), name=os.path.basename(os.path.abspath(source)))


def method_of_run(cfg) -> str | None:
    """The planner's row for a validated run config's training: LOMO's engine under the rule
    lomo.optimizer names, DeepSpeed's SGD or AdamW; None for methods the planner has no row for."""
    from lomo_ds.config.run import LOMO_METHODS

    if cfg.train.method in LOMO_METHODS:
        return "adalomo" if cfg.lomo.optimizer == "adalomo" else "lomo"
    return cfg.train.method if cfg.train.method in METHODS else None


def plan_for_run(cfg, world: int | None = None, model_size: str | None = None, gpu_mem_gib: float = 24.0,
                 overrides: dict | None = None) -> Plan:
    """The plan for a validated run config: its model, precision, micro-batch, sequence length,
    checkpointing, buckets and offload (RunSpec fields in `overrides` win), over 1, 2, 4, 8 GPUs
    and `world` (this launch's count)."""
    counts = set(GPU_COUNTS) | ({world} if world else set())
    run = replace(run_spec_for(cfg), **(overrides or {}))
    return plan(model_spec_for(cfg, model_size), gpu_mem_gib, run, gpu_counts=counts,
                source=cfg.source_path or "run config")


def llama_spec(size: str) -> ModelSpec:
    key = size.lower().removeprefix("llama-").removeprefix("llama")
    if key not in LLAMA:
        raise ValueError(f"model size {size!r}: expected one of {list(LLAMA)}, an HF config.json or a run config")
    return LLAMA[key]


def hf_config_path(arg: str) -> str | None:
    """The config.json `arg` names (the file, or the folder holding it), if it is an HF model config."""
    path = os.path.join(arg, "config.json") if os.path.isdir(arg) else arg
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError:
            return None
    return path if isinstance(raw, dict) and "hidden_size" in raw else None


def resolve_model(arg: str) -> ModelSpec:
    """`7b|13b|30b|65b` (LLaMA), or an HF config.json (or a folder holding one)."""
    path = hf_config_path(arg)
    if path is None:
        return llama_spec(arg)
    stem = os.path.splitext(os.path.basename(path))[0]
    name = os.path.basename(os.path.dirname(os.path.abspath(path))) if stem == "config" else stem
    with open(path) as f:
        return spec_from_hf_config(json.load(f), name=name)


def llama_size_of(path: str) -> str:
    """7b/13b/30b/65b for an HF LLaMA folder: the size whose parameter count is nearest."""
    n_params = resolve_model(path).n_params
    return min(LLAMA, key=lambda s: abs(LLAMA[s].n_params - n_params))


def llama_model_paths(model_path_items: list[str] | None, model_root: str | None) -> dict[str, str]:
    """size -> HF folder, from `[SIZE=]PATH` items (size guessed from config.json when absent)
    and a folder holding llama-7b, llama13b, 30b, ... (the experiments' --model-path/--model-root)."""
    paths = {}
    for item in model_path_items or []:
        size, sep, path = item.partition("=")
        if not sep:
            path, size = item, llama_size_of(item)
        paths[size.lower().removeprefix("llama-")] = path
    if model_root:
        for size in LLAMA:
            for name in (f"llama-{size}", f"llama{size}", size):
                p = os.path.join(model_root, name)
                if os.path.isdir(p) and size not in paths:
                    paths[size] = p
    return paths
