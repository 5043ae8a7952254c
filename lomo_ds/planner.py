"""Per-GPU memory planner for LOMO, SGD and AdamW under DeepSpeed ZeRO-3, and the smallest GPU count
that fits.

    est = estimate(LLAMA["7b"], "lomo", gpus=1, run=RunSpec(seq=1024, batch=1, checkpointing=True))
    est.total                 # predicted peak bytes per GPU
    plan(LLAMA["13b"], gpu_mem_gib=24, run=...)   # every method x (1, 2, 4, 8) GPUs + the smallest that fits

Notation: P parameters, N GPUs (ZeRO-3 data-parallel ranks), b bytes of the model dtype (2 for
fp16/bf16, 4 for fp32), T = batch x seq tokens per GPU, L layers, h hidden, f intermediate, V vocab,
H / K query / key-value heads of width d. All figures are bytes per GPU; GiB = 2^30 bytes (the
paper's "GB" are GiB: 2 x 6.74e9 bytes = 12.55).

Model states
------------
  params       b P / N                        this rank's ZeRO-3 shards
             + b P_persist    (N > 1)         parameters of <= stage3_param_persistence_threshold
                                              elements (the RMSNorm weights) stay gathered everywhere
             + b W            (N > 1)         the gathered working set. DeepSpeed keeps gathered
                                              parameters up to stage3_max_live_parameters (and keeps
                                              those reused within stage3_max_reuse_distance), plus the
                                              module being computed and the prefetch bucket:
                                              W = min(P - P_persist, min(max_live, max_reuse) + largest
                                              parameter + stage3_prefetch_bucket_size).
                                              On one GPU the shard is the whole parameter: nothing is
                                              gathered.
  LOMO grads   b max_p                        N = 1: the one gradient alive at a time (the largest
                                              parameter: the embedding / LM head)
               2 b max(bucket x N, max_p)     N > 1: the gradients waiting in the reduce-scatter bucket
                                              (bucket_size elements of shard = bucket x N full elements)
                                              + the rank-major send buffer of the same size
  LOMO optim   0                              (4 P / N with fp32 master shards)
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

Activations (bytes autograd saves in the forward; what lomo_ds.memory.ActivationCounter counts)
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

The total is a conservative peak: model states + forward activations (+ recompute), all at once.
`accounted` is the same without the recompute term: what the engines' accounting (the
MemoryTracker peak + the saved-tensor count) measures, and what tests/test_planner.py compares
against measured runs.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, replace

GIB = 2**30
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
METHODS = ("lomo", "sgd", "adamw")
GPU_COUNTS = (1, 2, 4, 8)


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

    @property
    def d(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def k(self) -> int:
        return self.kv_heads or self.heads

    def param_numels(self) -> list[int]:
        h, f, d = self.hidden, self.intermediate, self.d
        out = [self.vocab * h]
        if not self.tie:
            out.append(self.vocab * h)
        for _ in range(self.layers):
            out += [h * self.heads * d, h * self.k * d, h * self.k * d, self.heads * d * h, h * f, h * f, f * h, h, h]
        out.append(h)
        return out

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


@dataclass(frozen=True)
class RunSpec:
    seq: int = 1024
    batch: int = 1
    dtype: str = "fp16"
    checkpointing: bool = False
    lomo_bucket: int = 25_000_000  # lomo.bucket_size (shard elements)
    lomo_fp32_master: bool = False
    reduce_bucket: int = 500_000_000  # zero_optimization.reduce_bucket_size
    prefetch: int = 50_000_000  # stage3_prefetch_bucket_size
    max_live: int = 1_000_000_000  # stage3_max_live_parameters
    max_reuse: int = 1_000_000_000  # stage3_max_reuse_distance
    persistence: int = 100_000  # stage3_param_persistence_threshold
    sub_group: int = 1_000_000_000  # sub_group_size
    sgd_momentum: bool = False  # the paper's SGD has none (Table 1: optimizer states = fp32 master only)

    @property
    def b(self) -> int:
        return DTYPE_BYTES[self.dtype]


@dataclass
class Estimate:
    method: str
    gpus: int
    params: float
    grads: float
    optimizer_states: float
    activations: float
    recompute: float
    total: float

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
            + attn + 4 * T * f * b)


def activation_bytes(m: ModelSpec, run: RunSpec) -> tuple[float, float]:
    """(forward-saved bytes, recompute bytes added during backward)."""
    T, b, h = run.batch * run.seq, run.b, m.hidden
    head = T * h * (4 + b) + 4 * T * m.vocab + 8 * T + 2 * run.seq * m.d * b
    layer = layer_activation_bytes(m, run)
    if run.checkpointing:
        # each checkpointed layer saves its inputs: the hidden states, and the (eager) 4-D causal mask
        # shared by all layers
        return m.layers * T * h * b + run.batch * run.seq**2 * b + head, layer
    return m.layers * layer + head, 0.0


def _params_bytes(m: ModelSpec, run: RunSpec, n: int) -> float:
    numels = m.param_numels()
    P = sum(numels)
    b = run.b
    shard = b * sum(math.ceil(x / n) for x in numels)
    if n == 1:
        return shard
    persist = sum(x for x in numels if x <= run.persistence)
    work = min(P - persist, min(run.max_live, run.max_reuse) + max(numels) + run.prefetch)
    return shard + b * persist + b * work


def estimate(m: ModelSpec, method: str, gpus: int, run: RunSpec = RunSpec()) -> Estimate:
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    numels = m.param_numels()
    P, n, b = sum(numels), gpus, run.b
    max_p = max(numels)
    shard_numel = sum(math.ceil(x / n) for x in numels)
    params = _params_bytes(m, run, n)
    acts, recompute = activation_bytes(m, run)
    if method == "lomo":
        grads = b * max_p if n == 1 else 2 * b * min(P, max(run.lomo_bucket * n, max_p))
        optim = 4 * shard_numel if run.lomo_fp32_master and b != 4 else 0
        total = params + grads + optim + acts + recompute
        return Estimate(method, n, float(params), float(grads), float(optim), float(acts), float(recompute), float(total))
    grad_buf = b * shard_numel + b * run.reduce_bucket
    fp32_grad = 4 * min(shard_numel, run.sub_group)
    optim = 4 * shard_numel
    if method == "adamw":
        optim += 8 * shard_numel
    elif run.sgd_momentum:
        optim += 4 * shard_numel
    backward = params + grad_buf + b * max_p + optim + acts + recompute
    step = params - _work_only(m, run, n) + grad_buf + fp32_grad + optim
    grads = grad_buf + b * max_p + fp32_grad
    total = max(backward, step)
    return Estimate(method, n, float(params), float(grads), float(optim), float(acts), float(recompute), float(total))


def _work_only(m: ModelSpec, run: RunSpec, n: int) -> float:
    if n == 1:
        return 0.0
    numels = m.param_numels()
    persist = sum(x for x in numels if x <= run.persistence)
    return run.b * min(sum(numels) - persist, min(run.max_live, run.max_reuse) + max(numels) + run.prefetch)


@dataclass
class Plan:
    model: ModelSpec
    run: RunSpec
    gpu_mem_gib: float
    estimates: dict = field(default_factory=dict)  # (method, gpus) -> Estimate
    min_gpus: dict = field(default_factory=dict)  # method -> smallest count that fits, or None

    def fits(self, method: str, gpus: int) -> bool:
        return self.estimates[(method, gpus)].total <= self.gpu_mem_gib * GIB


def plan(m: ModelSpec, gpu_mem_gib: float = 24.0, run: RunSpec = RunSpec(), gpu_counts=GPU_COUNTS,
         methods=METHODS) -> Plan:
    p = Plan(m, run, gpu_mem_gib)
    for method in methods:
        p.min_gpus[method] = None
        for n in gpu_counts:
            est = estimate(m, method, n, run)
            p.estimates[(method, n)] = est
            if p.min_gpus[method] is None and est.total <= gpu_mem_gib * GIB:
                p.min_gpus[method] = n
    return p


def format_plan(p: Plan, gpu_counts=GPU_COUNTS) -> str:
    m, run = p.model, p.run
    lines = [f"# {m.name}: {m.n_params / 1e9:.2f}B parameters (h={m.hidden}, L={m.layers}, f={m.intermediate}, "
             f"V={m.vocab}); seq {run.seq}, batch {run.batch}, {run.dtype}, "
             f"activation checkpointing {'on' if run.checkpointing else 'off'}; {p.gpu_mem_gib:g} GiB per GPU",
             "",
             "| method | GPUs | params | grads | optimizer states | activations (+recompute) | total GiB/GPU | fits |",
             "|---|---|---|---|---|---|---|---|"]
    for method in METHODS:
        for n in gpu_counts:
            if (method, n) not in p.estimates:
                continue
            e = p.estimates[(method, n)]
            lines.append(f"| {method} | {n} | {e.params / GIB:.2f} | {e.grads / GIB:.2f} | {e.optimizer_states / GIB:.2f} | "
                         f"{e.activations / GIB:.2f} (+{e.recompute / GIB:.2f}) | {e.total / GIB:.2f} | "
                         f"{'yes' if p.fits(method, n) else 'OOM'} |")
    lines.append("")
    for method in METHODS:
        g = p.min_gpus.get(method)
        lines.append(f"smallest GPU count for {method}: {g if g else 'none of ' + ','.join(map(str, gpu_counts))}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- inputs
def spec_from_hf_config(cfg: dict, name: str = "model") -> ModelSpec:
    try:
        return ModelSpec(name=name, hidden=int(cfg["hidden_size"]), layers=int(cfg["num_hidden_layers"]),
                         intermediate=int(cfg["intermediate_size"]), vocab=int(cfg.get("vocab_size", 32000)),
                         heads=int(cfg["num_attention_heads"]),
                         kv_heads=cfg.get("num_key_value_heads"), head_dim=cfg.get("head_dim"),
                         tie=bool(cfg.get("tie_word_embeddings", False)))
    except KeyError as e:
        raise ValueError(f"{name}: not a LLaMA-style config, missing {e.args[0]!r}") from None


def run_overrides_from_ds(ds: dict) -> dict:
    """RunSpec fields a DeepSpeed / lomo_ds run config sets."""
    out = {}
    zero = ds.get("zero_optimization", {}) or {}
    keys = {"reduce_bucket_size": "reduce_bucket", "stage3_prefetch_bucket_size": "prefetch",
            "stage3_max_live_parameters": "max_live", "stage3_max_reuse_distance": "max_reuse",
            "stage3_param_persistence_threshold": "persistence", "sub_group_size": "sub_group"}
    for k, f in keys.items():
        if k in zero:
            out[f] = int(float(zero[k]))
    if ds.get("bf16", {}).get("enabled"):
        out["dtype"] = "bf16"
    elif ds.get("fp16", {}).get("enabled"):
        out["dtype"] = "fp16"
    lomo = ds.get("lomo", {}) or {}
    if "bucket_size" in lomo:
        out["lomo_bucket"] = int(lomo["bucket_size"])
    if lomo.get("fp32_master_weights"):
        out["lomo_fp32_master"] = True
    if "train_micro_batch_size_per_gpu" in ds:
        out["batch"] = int(ds["train_micro_batch_size_per_gpu"])
    return out


def resolve_model(arg: str) -> tuple[ModelSpec, dict]:
    """`7b|13b|30b|65b`, an HF config.json (or a folder holding one), or a lomo_ds run config (JSON
    with DeepSpeed keys, "lomo", and "model": {"path": ...} naming one of those; its
    model.gradient_checkpointing, tokenizer.max_length, micro-batch, precision and bucket sizes
    are taken too).
    Returns the model and the RunSpec overrides the run config sets."""
    key = arg.lower().removeprefix("llama-").removeprefix("llama")
    if key in LLAMA:
        return LLAMA[key], {}
    path = arg
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"--model {arg!r}: expected one of {sorted(LLAMA)}, a config.json or a run config")
    with open(path) as f:
        cfg = json.load(f)
    if "hidden_size" in cfg:
        return spec_from_hf_config(cfg, name=os.path.basename(os.path.dirname(os.path.abspath(path))) or path), {}
    model = cfg.get("model")
    ref = model.get("path") if isinstance(model, dict) else model
    ref = ref if isinstance(ref, str) else cfg.get("model_path") or cfg.get("model_name_or_path")
    if isinstance(ref, str):
        if ref.startswith("builtin:"):
            raise ValueError(f"{path}: model.path {ref!r}: give its HF config.json to the planner instead")
        if not os.path.isabs(ref) and ref.lower().removeprefix("llama-").removeprefix("llama") not in LLAMA:
            cand = os.path.join(os.path.dirname(os.path.abspath(path)), ref)
            ref = cand if os.path.exists(cand) else ref
        spec, _ = resolve_model(ref)
        overrides = run_overrides_from_ds(cfg)
        if isinstance(model, dict) and model.get("gradient_checkpointing"):
            overrides["checkpointing"] = True
        tok = cfg.get("tokenizer") or {}
        if isinstance(tok, dict) and "max_length" in tok:
            overrides["seq"] = int(tok["max_length"])
        return spec, overrides
    raise ValueError(f"{path}: neither an HF config (hidden_size ...) nor a run config with a 'model' entry")


def run_spec(**overrides) -> RunSpec:
    return replace(RunSpec(), **overrides)


def llama_size_of(path: str) -> str:
    """7b/13b/30b/65b for an HF LLaMA folder: the size whose parameter count is nearest."""
    with open(os.path.join(path, "config.json")) as f:
        spec = spec_from_hf_config(json.load(f))
    return min(LLAMA, key=lambda s: abs(LLAMA[s].n_params - spec.n_params))


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
