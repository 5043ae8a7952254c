"""What the planner sizes: a model's architecture (ModelSpec; the LLaMA-1 sizes in LLAMA) and what a
run does that memory depends on (RunSpec; defaults: the shipped GPU configs'), with the constants
the estimates share."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from lomo_ds.config import rules

GIB = 2**30


DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


# DeepSpeed's own optimizers, the paper's baselines: planned here, not by a registered rule.
BASELINE_LABELS = {"sgd": "SGD", "adamw": "AdamW"}


def plannable_rules() -> list:
    """The registered update rules the planner has terms for (config/rules.py), in registration order."""
    return [s for s in rules.specs() if s.plan is not None]


def rule_of(method: str):
    """The registered rule whose planner row `method` is (its RuleSpec), or None: a baseline's row."""
    spec = rules.by_row(method)
    return spec if spec is not None and spec.plan is not None else None


class _Rows(Sequence):
    """A tuple of the planner's rows read from the registry each time it is used, so that a rule
    registered after this module was imported (a plug-in) is planned with its own terms."""

    def __init__(self, baselines: bool):
        self.baselines = baselines

    def _rows(self) -> tuple[str, ...]:
        return tuple(s.row for s in plannable_rules()) + (tuple(BASELINE_LABELS) if self.baselines else ())

    def __getitem__(self, i):
        return self._rows()[i]

    def __len__(self) -> int:
        return len(self._rows())

    def __eq__(self, other) -> bool:
        return tuple(self) == (tuple(other) if isinstance(other, (tuple, list, _Rows)) else other)

    def __hash__(self) -> int:
        return hash(self._rows())

    def __repr__(self) -> str:
        return repr(self._rows())


class _Labels(Mapping):
    """Row -> label: the registered rules' plan labels and the baselines'."""

    def _labels(self) -> dict[str, str]:
        return {**{s.row: s.plan_label or s.label for s in plannable_rules()}, **BASELINE_LABELS}

    def __getitem__(self, row: str) -> str:
        return self._labels()[row]

    def __iter__(self):
        return iter(self._labels())

    def __len__(self) -> int:
        return len(self._labels())


METHODS = _Rows(baselines=True)  # every row: the registered rules' ("lomo": SGD, "adalomo", ...) and the baselines


FUSED = _Rows(baselines=False)  # the rows whose update is fused into the backward (lomo_ds's engine): the rules


METHOD_LABELS = _Labels()


GPU_COUNTS = (1, 2, 4, 8)


# Buckets staged ahead of the host-update worker (engine/host_updates.py MAX_STAGED; not imported:
# the planner runs without torch's engine modules loaded). tests/planning/test_planner.py checks they agree.
HOST_STAGED_BUCKETS = 4


# The largest safetensors file the export writes (storage/checkpoint.py MAX_SHARD_SIZE; not imported:
# planning sits below storage; tests/planning/test_planner.py checks they agree).
EXPORT_FILE_BYTES = 5 * 10**9


# The model types whose output head the chunked loss knows (engine/chunked_loss.py HEADS, by
# transformers' model_type; not imported: planning sits below the engine; tests/planning/test_planner.py
# checks they agree). Any other model keeps its own loss, fp32 logits of every position.
CHUNKED_LOSS_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3")


# Slices of rows the chunked loss's backward adds a block's product into its fp32 input gradient
# by (engine/chunked_loss.py KEPT_SLICES; tests/planning/test_planner_passes.py checks they agree).
LOSS_ADD_SLICES = 8


def chunked_loss(m: "ModelSpec", run: "RunSpec") -> bool:
    """Whether the run's loss is the chunked one: memory.chunked_loss not off, and a head it knows."""
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
# of 16 over the GPU count Table 2 gives the size. tests/planning/test_planner.py checks these against the files.
SHIPPED_MICRO_BATCH = {"7b": 16, "13b": 8, "30b": 4, "65b": 2}


# DeepSpeed's own defaults for the zero_optimization keys the planner reads, for configs that leave
# them out (RunSpec's defaults are the shipped configs' values instead).
DEEPSPEED_ZERO_DEFAULTS = {"reduce_bucket_size": 500_000_000, "stage3_prefetch_bucket_size": 50_000_000,
                           "stage3_max_live_parameters": 1_000_000_000, "stage3_max_reuse_distance": 1_000_000_000,
                           "stage3_param_persistence_threshold": 100_000, "sub_group_size": 1_000_000_000}


ZERO_FIELDS = {"reduce_bucket_size": "reduce_bucket", "stage3_prefetch_bucket_size": "prefetch",
                "stage3_max_live_parameters": "max_live", "stage3_max_reuse_distance": "max_reuse",
                "stage3_param_persistence_threshold": "persistence", "sub_group_size": "sub_group"}


# zero_optimization.leaf_module.classes for one gather per decoder layer (the shipped configs').
PER_LAYER = ("LlamaDecoderLayer",)


# zero_optimization.leaf_module "auto": the classes the model names in _no_split_modules
# (ModelSpec.no_split), resolved by resolve_auto as lomo_ds resolves it for DeepSpeed.
AUTO = ("auto",)


def resolve_auto(m: ModelSpec, run: RunSpec) -> RunSpec:
    """`run` with leaf_module "auto" replaced by the model's own unsplittable classes, and the
    attention the model runs: soft-capped attention scores (Gemma 2) have no sdpa or flash kernel in
    transformers, which runs them eager."""
    if m.softcap and run.attn != "eager":
        run = replace(run, attn="eager")
    return replace(run, leaf_classes=tuple(m.no_split)) if run.leaf_classes == AUTO else run


@dataclass(frozen=True)
class RunSpec:
    """What a run does that the memory depends on. Defaults: the shipped GPU configs'."""

    seq: int = 512  # tokenizer.max_length
    batch: int = 1  # train_micro_batch_size_per_gpu (shipped_run(size) sets the shipped one)
    dtype: str = "bf16"
    checkpointing: bool = True  # model.gradient_checkpointing
    offload: bool = False  # zero_optimization.offload_param.device == "cpu"
    lomo_bucket: int = 25_000_000  # comm.bucket_size (shard elements)
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
    accumulate_dtype: str = "fp32"  # memory.accumulate_dtype
    accumulate_on_host: bool = False  # memory.accumulate_on == "cpu"
    update_chunk: int = 1 << 22  # memory.update_chunk_elements
    chunked_loss: bool = True  # memory.chunked_loss (a causal LM it knows)
    loss_chunk: int = 1 << 25  # memory.loss_chunk_logits
    # memory.two_pass_mode where a step of one micro-batch takes a measuring backward before the
    # updating one (train.clip_grad_norm set, or fp16 loss scaling): "retain_graph" | "recompute";
    # None: one backward (the shipped GPU configs: AdaLomo, no norm clipping)
    two_pass: str | None = None
    # What grows with the sequence (planning/sequence.py; docs/memory.md "Long sequences"):
    attn: str = "sdpa"  # model.attn_implementation as ATTENTION names it: only "eager" keeps S x S scores
    sp: int = 1  # sequence-parallel ranks (Ulysses): each holds seq / sp tokens through the layers
    tiled_mlp: bool = False  # memory.tiled_mlp: each decoder layer's MLP computed a tile of positions at a time
    mlp_tiles: int = 0  # memory.mlp_tiles: tiles per sequence; 0: ceil(seq / sp / hidden), DeepSpeed's choice
    offload_checkpoints: bool = False  # memory.offload_checkpoints: the layers' checkpointed inputs in host RAM
    # memory.int8_shards, memory.int8_block: each rank's shard in int8, an fp32 scale a block (planning/int8_shards.py)
    int8_shards: bool = False
    int8_block: int = 128

    @property
    def b(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def local_seq(self) -> int:
        """Positions of a sequence on each rank through the layers (seq / sp)."""
        return self.seq // self.sp

    @property
    def tokens(self) -> int:
        """Positions on each rank through the layers: micro-batch x seq / sp."""
        return self.batch * self.local_seq

    def assumptions(self, batch: bool = True) -> str:
        per_gpu = [f"micro-batch {self.batch} per GPU"] if batch else []
        weights = (f"int8 shards (an fp32 scale per {self.int8_block} elements), {self.dtype} compute"
                   if self.int8_shards else f"{self.dtype} weights")
        return ", ".join([weights, f"seq {self.seq}"] + per_gpu + [
            f"activation checkpointing {'on' if self.checkpointing else 'off'}",
            f"offload_param {'cpu' if self.offload else 'none'}", f"comm.bucket_size {self.lomo_bucket:,}",
            f"stochastic rounding {'on' if self.stochastic_rounding else 'off'}",
            f"fp32 masters {'on' if self.lomo_fp32_master else 'off'}",
            f"persistence threshold {self.persistence:,}", f"max live parameters {self.max_live:,}",
            f"fetch {self.fetch_label}",
            f"gradient accumulation {self.accumulation}" + (
                f" ({self.accumulate_dtype} accumulator on the {'host' if self.accumulate_on_host else 'GPU'})"
                if self.accumulation > 1 else "")] + (
            [f"two backwards a step (norm clipping or loss scaling, {self.two_pass})"] if self.two_pass else [])
            + self.sequence_assumptions())

    def sequence_assumptions(self) -> list[str]:
        """The attention and the long-sequence options, in words (the defaults say only the attention)."""
        out = [f"attention {self.attn}" + (" (S x S scores)" if self.attn == "eager" else " (no S x S scores)")]
        if self.sp > 1:
            out.append(f"sequence parallel {self.sp} (Ulysses: {self.local_seq:,} positions per rank)")
        if self.tiled_mlp:
            out.append(f"tiled MLP ({self.mlp_tiles or 'auto'} tiles)")
        if self.offload_checkpoints:
            out.append("checkpointed activations offloaded to host RAM")
        return out

    @property
    def fetch_label(self) -> str:
        """The fetch granularity in words."""
        parts = [f"leaf_module {', '.join(self.leaf_classes)}"] if self.leaf_classes else []
        if self.granularity_threshold:
            parts.append(f"stage3_module_granularity_threshold {self.granularity_threshold:,}")
        return " + ".join(parts) if parts else "per module"


# model.attn_implementation -> the planner's attention: eager keeps the fp32 S x S scores and their
# cast; sdpa and flash attention keep q, k, v, the output and a log-sum-exp per head and position.
ATTENTION = {"eager": "eager", "sdpa": "sdpa", "flash_attention_2": "flash", "flash_attention_3": "flash",
             "flex_attention": "sdpa"}


def attention_of(attn_implementation: str | None) -> str:
    """The planner's attention for model.attn_implementation (None: transformers' default, sdpa)."""
    if attn_implementation is None:
        return "sdpa"
    if attn_implementation not in ATTENTION:
        raise ValueError(f"model.attn_implementation {attn_implementation!r}: the planner knows {sorted(ATTENTION)}")
    return ATTENTION[attn_implementation]


def llama_spec(size: str) -> ModelSpec:
    key = size.lower().removeprefix("llama-").removeprefix("llama")
    if key not in LLAMA:
        raise ValueError(f"model size {size!r}: expected one of {list(LLAMA)}, an HF config.json or a run config")
    return LLAMA[key]
