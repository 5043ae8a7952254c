"""The engine's other config sections, split by concern: `comm` (how gradients and parameters travel
between ranks, lomo_ds/comm), `memory` (what a step holds at once), and `train`'s keys that every
method reads (clipping, schedule, accumulation, seed). `EngineConfig` is the one typed object the
engine takes: these three and the update rule (`lomo`, lomo_section.py)."""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from lomo_ds.config.lomo_section import LomoConfig, ScheduleConfig
from lomo_ds.config.section import Int, Section, expects

# How gradient buckets are summed over ranks: the transports of lomo_ds/comm/grad.py.
GradReduction = Literal["auto", "reduce_scatter", "shared_memory", "all_reduce"]
# How ZeRO-3's parameter all-gathers are carried: lomo_ds/comm/param_gather.py.
ParamGather = Literal["auto", "shared_memory", "torch"]

# The engine's sections, in the order a config lists them; every other top-level key of an
# engine config is DeepSpeed's.
ENGINE_SECTIONS = ("lomo", "comm", "memory", "train")


class CommConfig(Section):
    """The `comm` section: how the gradients reach the rank that owns each slice, and how ZeRO-3's
    parameter gathers travel (lomo_ds/comm)."""

    grad_reduction: GradReduction = Field("auto", description=(
        "how gradient buckets are summed over ranks: auto = through shared memory for CPU ranks on one node "
        "(shared_memory), else the backend's overlapped reduce-scatter (reduce_scatter), and on one rank each "
        "gradient applied as it arrives; all_reduce: the reference code's way, twice the bytes (benchmarks only); "
        "a transport named on one rank runs as a one-rank collective"))
    param_gather: ParamGather = Field("auto", description=(
        "how ZeRO-3's parameter all-gathers travel, for LOMO and for the DeepSpeed baselines alike: auto = through "
        "shared memory for CPU ranks on one node (shared_memory), else torch.distributed's (torch); process-wide "
        "(the last engine built decides)"))
    bucket_size: Int = Field(25_000_000, ge=1, description="gradient elements per reduce-scatter bucket")
    reduce_dtype: Literal["fp32", "fp16", "bf16"] | None = Field(None, description="dtype of the reduce-scatter "
                                                                                   "(null: the model's)")
    max_in_flight: Int = Field(1, ge=1, description="reduce-scatters outstanding at once (memory: one bucket's "
                                                    "payload and receive buffer each)")
    sparse_params: tuple[str, ...] = Field((), strict=False, description=(
        "fnmatch patterns of parameters that may get no gradient on some rank (mixture-of-experts experts): "
        "reduced at the end of the backward on every rank from the first step on (one found without a gradient "
        "in the first step is treated so from then on)"))


class MemoryConfig(Section):
    """The `memory` section: what a step holds at once, and where (the update's chunks, the loss's
    chunks, the accumulator, the host-memory update, norm clipping's second backward)."""

    update_chunk_elements: Int = Field(1 << 22, ge=1, description=(
        "elements of a shard slice updated at once (lomo_ds/engine/update/shard.py): the update's fp32 and "
        "rounding temporaries are bounded by this chunk (about 21 bytes an element for bf16), whatever the "
        "parameter's size; fp32 results are the same for every value"))
    chunked_loss: Literal["auto", "on", "off"] = Field("auto", description=(
        "the causal LM's loss as a linear + cross-entropy over chunks of positions (lomo_ds/engine/chunked_loss.py): "
        "no fp32 logits of every position at once. auto = on for the transformers families whose output head it "
        "knows, the model's own loss for the others; on = refuse a model it does not know; off = the model's own"))
    loss_chunk_logits: Int = Field(1 << 25, ge=1, description=(
        "logits (positions x vocabulary) the chunked loss computes at once: max(1, this // vocabulary) positions "
        "a chunk, so its memory (6 bytes a logit in bf16, 12 with Gemma-2's soft-capping) does not grow with the "
        "vocabulary"))
    host_update: Literal["auto", "thread", "inline"] = Field("auto", description=(
        "where the update of a shard in host memory (offload_param: cpu) runs: on a worker thread while the "
        "backward goes on, its slices copied without blocking into pinned buffers (thread), or in the gradient "
        "hook (inline); auto = thread on accelerators, inline on CPU ranks. With AdaLomo the thread applies "
        "the shard's update only: its statistics, per-bucket collectives and coefficients stay in the hook, "
        "on the device"))
    accumulate_on: Literal["device", "cpu"] = Field(
        "device", description="where the shard accumulator (train.accumulation_steps > 1) lives: beside the "
                              "shards, or in pinned host memory")
    accumulate_dtype: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="dtype of the shard accumulator (fp16 runs the step as one pass after the last backward)")
    two_pass_mode: Literal["retain_graph", "recompute"] = Field(
        "retain_graph", description="how norm clipping's second backward gets its graph: kept from the first, or "
                                    "recomputed by a second forward (less memory)")
    tiled_mlp: bool = Field(False, description=(
        "compute each decoder layer's MLP a tile of positions at a time (DeepSpeed's TiledMLP): its forward keeps "
        "only the input, its backward recomputes one tile at a time, so the MLP's intermediate activations are one "
        "tile's, not the whole sequence's (lomo_ds/engine/sequence_memory.py)"))
    mlp_tiles: Int = Field(0, ge=0, description=(
        "tiles per sequence for memory.tiled_mlp; 0 = ceil(positions / hidden size), DeepSpeed's choice"))
    offload_checkpoints: bool = Field(False, description=(
        "keep the checkpointed decoder layers' inputs in host memory from the forward to their recomputation "
        "(needs model.gradient_checkpointing; copied without blocking through pinned buffers on accelerators)"))
    int8_shards: bool = Field(False, description=(
        "keep each rank's ZeRO-3 shard of every trainable, non-persistent parameter in int8 with one fp32 absmax "
        "scale per memory.int8_block elements of the parameter's global flat index (lomo_ds/runtime/quant8.py): "
        "about 0.52x of bf16's shard and gather bytes at 128; the update requantizes with stochastic rounding "
        "keyed by (seed, step, parameter, element), so every rank count rounds alike. Persistent parameters "
        "(norms, biases) stay in the compute dtype. Refused with lomo.fp32_master_weights, fp16 and DeepSpeed's "
        "zero_quantized_* flags. Within a point of bf16 on the quality benchmark over 3 seeds "
        "(docs/results.md); not yet run on a GPU"))
    int8_block: Int = Field(128, ge=8, multiple_of=8, json_schema_extra=expects("a positive multiple of 8"),
                            description=(
        "elements per scale for memory.int8_shards, on each parameter's global flat index: smaller blocks "
        "follow outliers more closely at 4 bytes of scale a block (128: 1/32 byte an element)"))


# Elements of a rank's part of a gathered 8-bit parameter dequantized at a time (lomo_ds/comm/
# int8_gather.py, and the planner's term for it): its fp32 transient is this, not the whole part,
# which for a large vocabulary's embedding on one GPU would be gigabytes.
INT8_DEQUANTIZE_CHUNK = 1 << 22


class EngineTrainConfig(Section):
    """The `train` keys every method reads (the run config's train section adds the training
    program's own: method, epochs, ...)."""

    seed: Int = Field(42, description="the run's one seed: the model's initialisation and the data order (the "
                                      "training program), the sample subsets (data.train_samples), and the "
                                      "stochastic rounding's noise (a pure function of seed, rank and step)")
    clip_grad_norm: float | None = Field(None, gt=0, json_schema_extra=expects("a positive number or null"),
                                         description="clip the global L2 norm of the gradient to this; costs LOMO a "
                                                     "second backward pass (null: no norm clipping)")
    clip_grad_value: float | None = Field(None, gt=0, json_schema_extra=expects("a positive number or null"),
                                          description="clamp every gradient element to [-v, v]; free (null: none)")
    scheduler: ScheduleConfig = ScheduleConfig()
    accumulation_steps: Int = Field(1, ge=1, description=(
        "micro-batches per optimizer step (DeepSpeed's gradient_accumulation_steps maps here): under LOMO each "
        "rank sums its own reduced shards into an accumulator of 1/N of the model (lomo_ds/engine/accumulation.py)"))
    loss_normalization: Literal["mean", "tokens"] = Field("mean", description=(
        "how a step weighs its micro-batches: mean = each micro-batch's token mean, averaged over the window's "
        "micro-batches x ranks (DeepSpeed's); tokens = every label token of the window weighs the same (LOMO's "
        "methods only)"))
    sequence_parallel_size: Int = Field(1, ge=1, description=(
        "ranks that share each sequence, its positions split between them, attention through DeepSpeed's Ulysses "
        "all-to-all (lomo_ds/runtime/sequence_parallel.py); world / this ranks are data-parallel replicas. Must "
        "divide the ranks, the sequence length, the attention heads and the key/value heads (or be divided by them); "
        "needs attn_implementation sdpa (flash attention on CUDA); LOMO's methods only"))
    collective_timeout: float = Field(600.0, gt=0, description="seconds a collective may wait on a peer before the "
                                                               "run fails (NCCL's watchdog, gloo's timeout, the "
                                                               "shared-memory transport's); a dead peer is detected "
                                                               "sooner where it can be")


class EngineConfig(Section):
    """Everything the engine reads besides DeepSpeed's own keys: the update rule and the sections
    split by concern. `lomo_ds.config.engine_config.load_config` builds it from a config file or dict; a
    run config gives its own as `RunConfig.engine`."""

    SECTIONS: ClassVar[tuple[str, ...]] = ENGINE_SECTIONS  # every other top-level key is DeepSpeed's
    lomo: LomoConfig = LomoConfig()
    comm: CommConfig = CommConfig()
    memory: MemoryConfig = MemoryConfig()
    train: EngineTrainConfig = EngineTrainConfig()

    @property
    def lomo_update(self) -> bool:
        """Whether LOMO does the update: always, for the engine's own config."""
        return True


def group_by_section(options: dict) -> dict[str, dict]:
    """Engine options named by their keys alone ({"lr": .., "bucket_size": ..}) as the sections that
    hold them ({"lomo": {"lr": ..}, "comm": {"bucket_size": ..}}): a key names one field of one
    section, so command lines and checks can take the options without their sections. An unknown
    key is a ValueError naming it."""
    section_of = {name: section for section, field in EngineConfig.model_fields.items()
                  for name in field.annotation.model_fields}
    out: dict[str, dict] = {}
    for name, value in options.items():
        if name not in section_of:
            raise ValueError(f"{name}: not a key of any engine section ({', '.join(ENGINE_SECTIONS)})")
        out.setdefault(section_of[name], {})[name] = value
    return out
