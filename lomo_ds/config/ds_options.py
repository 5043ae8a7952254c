"""What LOMO does with each DeepSpeed option: one table, read by the config validator and
printed into docs/configs.md ("DeepSpeed options").

LOMO replaces DeepSpeed's optimizer, its gradient reduction and its loss scaler; it keeps
DeepSpeed's ZeRO-3 parameter partitioning and gathering. So every option is one of:

- supported: the engine honours it (parameter-side knobs), or it only configures a part of
  DeepSpeed that LOMO does not run, so it changes nothing a LOMO run computes;
- mapped: LOMO has its own key for it; the DeepSpeed value is copied into that key of the
  engine's sections (an error names both when both are set and disagree);
- refused: LOMO cannot honour it; the config fails, before any model is allocated, with the
  reason or the replacement. `accepts` lists the values that are still fine (the defaults).

Every top-level key and every `zero_optimization` key of DeepSpeed 0.19 is listed (tests compare
the table with the keys the installed DeepSpeed's config reads), so an unknown key there is a
typo and is refused too. A section refused `when_enabled` is fine while that switch is off.

DeepSpeed's monitors (tensorboard, wandb, csv_monitor, comet) write from DeepSpeed's optimizer
step, which LOMO never runs: under LOMO they are refused, naming lomo_ds's own metrics.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

SUPPORTED, MAPPED, REFUSED = "supported", "mapped", "refused"


@dataclass(frozen=True)
class DsOption:
    key: str  # dotted path in a DeepSpeed config
    status: str  # SUPPORTED | MAPPED | REFUSED
    reason: str
    aliases: tuple[str, ...] = ()  # other spellings DeepSpeed accepts at the same level
    maps_to: str | None = None  # MAPPED: the dotted key of ours it sets (section included)
    convert: Callable[[Any], Any] | None = None  # MAPPED: DeepSpeed's value -> ours
    accepts: tuple = ()  # REFUSED: values that are fine (nothing to refuse)
    all_methods: bool = False  # REFUSED for the baselines too: the trainer itself cannot honour it
    when_enabled: str | None = None  # REFUSED only while this switch of the section is on

    def refuses(self, value) -> bool:
        """Whether `value` of this key is refused (by a REFUSED row)."""
        if self.status != REFUSED or value is None or value in self.accepts:
            return False
        if self.when_enabled is not None:
            return isinstance(value, dict) and bool(value.get(self.when_enabled))
        return True


def _clip(value):
    return None if value == 0 else value  # DeepSpeed's gradient_clipping 0 means no clipping


def _dtype_name(value):
    return value.lower() if isinstance(value, str) else value


_HARMLESS_OPT = "configures DeepSpeed's optimizer step, which LOMO does not run: no effect"
_HARMLESS_12 = "ZeRO stage 1/2 only: no effect on stage 3"
_GRAD_SIDE = "configures DeepSpeed's gradient reduction, which LOMO replaces with lomo's buckets: no effect"
_FETCH = "parameter gathering/partitioning, which DeepSpeed still does under LOMO"
_REMOVED = "removed from DeepSpeed 0.19 (DeepSpeed refuses it too)"
_IN_DS_STEP = "runs in DeepSpeed's optimizer step, which LOMO does not run"
_NO_EFFECT = "no effect on what LOMO computes"
_DATA_PARALLEL = "every lomo_ds rank is a data-parallel rank (no tensor, pipeline, expert or sequence parallelism)"
_MONITOR = ("DeepSpeed's monitors write from its optimizer step, which LOMO does not run: lomo_ds writes every "
            "step's loss, lr and grad_norm to output.metrics_file (JSON lines) and, with output.tensorboard: true, "
            "to TensorBoard; lomo_ds.initialize users log train_step()'s returned dict")
_Z = "zero_optimization."
_OP = _Z + "offload_param."

OPTIONS: tuple[DsOption, ...] = (
    # ---- top level: what LOMO replaces
    DsOption("optimizer", REFUSED, "LOMO is the optimizer: set lomo.lr, lomo.weight_decay, train.clip_grad_norm "
             "(baselines: train.lr, train.weight_decay)", all_methods=True),
    DsOption("scheduler", REFUSED, "use train.scheduler (a DeepSpeed scheduler needs a DeepSpeed optimizer)",
             all_methods=True),
    DsOption("gradient_accumulation_steps", MAPPED, "one optimizer step every K micro-batches: LOMO sums each "
             "rank's reduced shards into a 1/N accumulator (the baselines use DeepSpeed's own accumulation)",
             maps_to="train.accumulation_steps"),
    DsOption("gradient_clipping", MAPPED, "global-norm clipping (0 = off); costs LOMO a second backward at K = 1, "
             "a pass over the accumulated shards at K > 1",
             maps_to="train.clip_grad_norm", convert=_clip),
    DsOption("communication_data_type", MAPPED, "dtype of the gradient reduce-scatter", maps_to="comm.reduce_dtype",
             convert=_dtype_name),
    DsOption("prescale_gradients", REFUSED, "LOMO averages gradients in its own reduce-scatter; expected false",
             accepts=(False,)),
    DsOption("gradient_predivide_factor", REFUSED, "LOMO averages gradients in its own reduce-scatter; expected 1.0",
             accepts=(1.0,)),
    DsOption("bfloat16", REFUSED, "old spelling of 'bf16': write bf16, the key lomo_ds reads for the model dtype",
             all_methods=True),
    DsOption("fp16.loss_scale", REFUSED, "LOMO's fp16 loss scale is dynamic only (the first scale is "
             "lomo.loss_scale.initial_scale_power); 0 selects dynamic scaling", accepts=(0,)),
    DsOption("fp16.initial_scale_power", MAPPED, "first dynamic loss scale is 2**power",
             maps_to="lomo.loss_scale.initial_scale_power"),
    DsOption("fp16.loss_scale_window", MAPPED, "clean steps before the scale doubles",
             maps_to="lomo.loss_scale.window"),
    DsOption("fp16.min_loss_scale", MAPPED, "the scale never halves below this", maps_to="lomo.loss_scale.min_scale"),
    DsOption("fp16.hysteresis", REFUSED, "LOMO's scaler halves on every overflow (hysteresis 1); expected 1",
             accepts=(1,)),
    DsOption("fp16.consecutive_hysteresis", REFUSED, "LOMO's scaler has no hysteresis; expected false",
             accepts=(False,)),
    DsOption("fp16.fp16_master_weights_and_grads", REFUSED, "optimizer-side; LOMO's master copy is "
             "lomo.fp32_master_weights; expected false", accepts=(False,)),
    DsOption("bf16.bf16_master_weights_and_grads", REFUSED, "optimizer-side; LOMO's master copy is "
             "lomo.fp32_master_weights; expected false", accepts=(False,)),
    # ---- top level: every other key DeepSpeed 0.19's config reads
    DsOption("train_batch_size", SUPPORTED, "derived by DeepSpeed from the micro-batch and the ranks"),
    DsOption("train_micro_batch_size_per_gpu", SUPPORTED, "the micro-batch of each rank"),
    DsOption("fp16", SUPPORTED, "fp16 weights; lomo.loss_scale replaces DeepSpeed's loss scaler (keys below)"),
    DsOption("bf16", SUPPORTED, "bf16 weights"),
    DsOption("zero_optimization", SUPPORTED, "ZeRO-3's parameter partitioning (keys below)"),
    DsOption("steps_per_print", SUPPORTED, "DeepSpeed's own step logs by it (the baselines); LOMO's steps are logged "
             "by lomo_ds"),
    DsOption("activation_checkpointing", SUPPORTED, "deepspeed.checkpointing, for a model that calls it: its "
             "recomputed backward reaches the engine's hooks like any other"),
    DsOption("aio", SUPPORTED, "NVMe I/O (NVMe offload is refused): no effect"),
    DsOption("comms_logger", SUPPORTED, "logs every collective through deepspeed.comm, lomo_ds's own included"),
    DsOption("disable_allgather", SUPPORTED, _HARMLESS_12),
    DsOption("dump_state", SUPPORTED, "prints DeepSpeed's state at initialise: logging only"),
    DsOption("log_level", SUPPORTED, "DeepSpeed's logging only"),
    DsOption("memory_breakdown", SUPPORTED, "DeepSpeed's memory logging only"),
    DsOption("timers", SUPPORTED, "DeepSpeed's throughput timers: logging only"),
    DsOption("disable_python_gc", SUPPORTED, "garbage collection around DeepSpeed's step: " + _NO_EFFECT),
    DsOption("graph_harvesting", SUPPORTED, "CUDA graphs of DeepSpeed's optimizer step: " + _NO_EFFECT),
    DsOption("zero_allow_untested_optimizer", SUPPORTED, "checks a DeepSpeed optimizer: " + _NO_EFFECT),
    DsOption("zero_force_ds_cpu_optimizer", SUPPORTED, "checks a DeepSpeed optimizer: " + _NO_EFFECT),
    DsOption("sparse_attention", SUPPORTED, "read by DeepSpeed's sparse attention modules, if the model has them"),
    DsOption("vocabulary_size", SUPPORTED, "read by DeepSpeed's data-efficiency tools only: " + _NO_EFFECT),
    DsOption("seq_parallel_communication_data_type", SUPPORTED, "sequence parallelism only, which lomo_ds does not "
             "use: " + _NO_EFFECT),
    DsOption("tensorboard", REFUSED, _MONITOR, when_enabled="enabled"),
    DsOption("wandb", REFUSED, _MONITOR, when_enabled="enabled"),
    DsOption("csv_monitor", REFUSED, _MONITOR, when_enabled="enabled"),
    DsOption("comet", REFUSED, _MONITOR, when_enabled="enabled"),
    DsOption("wall_clock_breakdown", REFUSED, "times DeepSpeed's step, which LOMO does not run; LOMO's breakdown is "
             "benchmarks/bench_step.py; expected false", accepts=(False,)),
    DsOption("flops_profiler", REFUSED, "profiles through DeepSpeed's engine forward, which LOMO bypasses; time a "
             "step with benchmarks/bench_step.py", when_enabled="enabled"),
    DsOption("amp", REFUSED, "apex AMP wraps DeepSpeed's optimizer: set fp16 or bf16", when_enabled="enabled",
             all_methods=True),
    DsOption("torch_autocast", REFUSED, "autocast inside DeepSpeed's engine forward, which LOMO bypasses: set fp16 "
             "or bf16 weights", when_enabled="enabled"),
    DsOption("autotuning", REFUSED, "DeepSpeed's autotuner varies the ZeRO stage and the optimizer",
             when_enabled="enabled", all_methods=True),
    DsOption("compile", REFUSED, "DeepCompile rewrites ZeRO-3's hooks; not verified with the in-backward update",
             when_enabled="deepcompile"),
    DsOption("curriculum_learning", REFUSED, _IN_DS_STEP, when_enabled="enabled"),
    DsOption("data_efficiency", REFUSED, _IN_DS_STEP, when_enabled="enabled"),
    DsOption("progressive_layer_drop", REFUSED, _IN_DS_STEP, when_enabled="enabled"),
    DsOption("quantize_training", REFUSED, _IN_DS_STEP, when_enabled="enabled"),
    DsOption("eigenvalue", REFUSED, _IN_DS_STEP, when_enabled="enabled"),
    DsOption("elasticity", REFUSED, "elastic batch sizes " + _IN_DS_STEP.split(" ", 1)[1], when_enabled="enabled",
             all_methods=True),
    DsOption("hybrid_engine", REFUSED, "the RLHF hybrid engine wraps DeepSpeed's engine", when_enabled="enabled",
             all_methods=True),
    DsOption("nebula", REFUSED, "a checkpoint engine for DeepSpeed's save_checkpoint; lomo_ds writes its own "
             "checkpoints (output.checkpoint_every)", when_enabled="enabled"),
    DsOption("checkpoint", REFUSED, "configures DeepSpeed's save_checkpoint; lomo_ds writes its own checkpoints "
             "(output.checkpoint_every)", accepts=({},)),
    DsOption("datastates_ckpt", REFUSED, "a checkpoint engine for DeepSpeed's save_checkpoint; lomo_ds writes its own "
             "checkpoints (output.checkpoint_every)", accepts=({},)),
    DsOption("compression_training", REFUSED, "compression schedules " + _IN_DS_STEP.split(" ", 1)[1], accepts=({},)),
    DsOption("weight_quantization", REFUSED, "quantized weights are not verified against the in-place shard update",
             accepts=({},)),
    DsOption("data_types", REFUSED, "sets the dtype of DeepSpeed's gradient accumulation, which LOMO replaces: set "
             "comm.reduce_dtype", accepts=({},)),
    DsOption("dataloader_drop_last", REFUSED, "DeepSpeed's dataloader only; lomo_ds batches its own data; expected "
             "false", accepts=(False,)),
    DsOption("sparse_gradients", REFUSED, "DeepSpeed's sparse embedding-gradient reduction; LOMO reduces dense "
             "buckets; expected false", accepts=(False,)),
    DsOption("gradient_allreduce_op", REFUSED, "LOMO averages gradients in its own reduce-scatter; expected 'mean'",
             accepts=("mean",)),
    DsOption("managed_gradient_accumulation", REFUSED, "DeepSpeed's gradient accumulation, which LOMO replaces; "
             "expected false", accepts=(False,)),
    DsOption("pipeline", REFUSED, _DATA_PARALLEL, accepts=({},), all_methods=True),
    DsOption("tensor_parallel", REFUSED, _DATA_PARALLEL, accepts=({},), all_methods=True),
    DsOption("expert_parallel", REFUSED, _DATA_PARALLEL, accepts=({},), all_methods=True),
    DsOption("use_data_before_expert_parallelism", REFUSED, _DATA_PARALLEL + "; expected false", accepts=(False,),
             all_methods=True),
    # ---- zero_optimization: every key DeepSpeed 0.19 knows
    DsOption(_Z + "stage", REFUSED, "LOMO runs on ZeRO stage 3: it updates the shards inside the backward; expected 3",
             accepts=(3,), all_methods=True),
    # Not mapped: DeepSpeed counts a bucket in full-gradient elements, comm.bucket_size in this
    # rank's shard elements, and the ratio (the world size) is unknown until the ranks start;
    # copied as it is, a DeepSpeed-sized bucket would hold world times the gradients.
    DsOption(_Z + "reduce_bucket_size", REFUSED, "sizes DeepSpeed's gradient buckets in full-gradient elements: "
             "set comm.bucket_size instead, in shard elements (reduce_bucket_size / data-parallel ranks)"),
    DsOption(_Z + "contiguous_gradients", SUPPORTED, _GRAD_SIDE),
    DsOption(_Z + "reduce_scatter", SUPPORTED, _GRAD_SIDE + " (comm.grad_reduction)"),
    DsOption(_Z + "overlap_comm", SUPPORTED, _GRAD_SIDE),
    DsOption(_Z + "use_multi_rank_bucket_allreduce", SUPPORTED, _GRAD_SIDE),
    DsOption(_Z + "allgather_partitions", SUPPORTED, _HARMLESS_12),
    DsOption(_Z + "allgather_bucket_size", SUPPORTED, _HARMLESS_12),
    DsOption(_Z + "compute_grad_norm", SUPPORTED, _HARMLESS_12),
    DsOption(_Z + "round_robin_gradients", SUPPORTED, _HARMLESS_12),
    DsOption(_Z + "parameter_alignment", SUPPORTED, _HARMLESS_12),
    DsOption(_Z + "ignore_unused_parameters", SUPPORTED, _HARMLESS_12),
    DsOption(_Z + "legacy_stage1", SUPPORTED, _HARMLESS_12),
    DsOption(_Z + "load_from_fp32_weights", SUPPORTED, _HARMLESS_OPT),
    DsOption(_Z + "elastic_checkpoint", SUPPORTED, _HARMLESS_OPT),
    DsOption(_Z + "sub_group_size", SUPPORTED, _HARMLESS_OPT),
    DsOption(_Z + "save_muon_momentum_buffer_in_memory", SUPPORTED, _HARMLESS_OPT),
    DsOption(_Z + "offload_optimizer", REFUSED, "LOMO has no optimizer state to offload (the baselines' torch "
             "optimizers cannot be offloaded either)", all_methods=True),
    DsOption(_Z + "cpu_offload", REFUSED, "deprecated spelling of offload_optimizer: LOMO has no optimizer state "
             "to offload; expected false", accepts=(False, None), all_methods=True),
    DsOption(_Z + "zenflow", REFUSED, "ZenFlow splits DeepSpeed's optimizer step; LOMO has none"),
    DsOption(_Z + "offload_param", SUPPORTED, "ZeRO-Infinity: the update runs where the shard lives (see device)"),
    DsOption(_OP + "device", REFUSED, "'nvme' is refused: the fused update would page each shard in from NVMe "
             "inside the backward; 'cpu' is supported", accepts=("none", "cpu")),
    DsOption(_OP + "nvme_path", SUPPORTED, "NVMe offload only (refused above): no effect"),
    DsOption(_OP + "buffer_count", SUPPORTED, "NVMe offload only (refused above): no effect"),
    DsOption(_OP + "buffer_size", SUPPORTED, "NVMe offload only (refused above): no effect"),
    DsOption(_OP + "max_in_cpu", SUPPORTED, "NVMe offload only (refused above): no effect"),
    DsOption(_OP + "pin_memory", SUPPORTED, "page-locked host shards for faster copies"),
    DsOption(_Z + "cpu_offload_param", SUPPORTED, "deprecated spelling of offload_param.device 'cpu'"),
    DsOption(_Z + "cpu_offload_use_pin_memory", SUPPORTED, "deprecated spelling of offload_param.pin_memory"),
    DsOption(_Z + "stage3_prefetch_bucket_size", SUPPORTED, _FETCH, aliases=("prefetch_bucket_size",)),
    DsOption(_Z + "stage3_param_persistence_threshold", SUPPORTED,
             "small tensors stay gathered; the engine releases them after each update, the next forward gathers "
             "them fresh",
             aliases=("param_persistence_threshold",)),
    DsOption(_Z + "stage3_model_persistence_threshold", SUPPORTED, "caps the tensors kept gathered (see above)",
             aliases=("model_persistence_threshold",)),
    DsOption(_Z + "stage3_max_live_parameters", SUPPORTED, _FETCH, aliases=("max_live_parameters",)),
    DsOption(_Z + "stage3_max_reuse_distance", SUPPORTED, _FETCH, aliases=("max_reuse_distance",)),
    DsOption(_Z + "stage3_module_granularity_threshold", SUPPORTED, _FETCH,
             aliases=("module_granularity_threshold",)),
    DsOption(_Z + "stage3_use_all_reduce_for_fetch_params", SUPPORTED, _FETCH,
             aliases=("use_all_reduce_for_fetch_params",)),
    DsOption(_Z + "stage3_allgather_sequential", SUPPORTED, _FETCH, aliases=("allgather_sequential",)),
    DsOption(_Z + "stage3_gather_16bit_weights_on_model_save", SUPPORTED,
             "DeepSpeed's save_16bit_model only; lomo_ds exports through its own gather",
             aliases=("gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save")),
    DsOption(_Z + "memory_efficient_linear", SUPPORTED, "ZeRO-3's linear autograd function; gradients still "
             "reach the engine's hooks"),
    DsOption(_Z + "leaf_module", SUPPORTED, "modules fetched as one unit (also \"auto\": the model's own "
             "decoder layer, from its _no_split_modules, resolved by lomo_ds): " + _FETCH),
    DsOption(_Z + "override_module_apply", SUPPORTED, "model initialisation under ZeRO-3"),
    DsOption(_Z + "pipeline_loading_checkpoint", SUPPORTED, "checkpoint loading in pipeline mode: no effect"),
    DsOption(_Z + "log_trace_cache_warnings", SUPPORTED, "logging only"),
    DsOption(_Z + "enable_sanity_checks", SUPPORTED, "DeepSpeed's own debugging checks"),
    DsOption(_Z + "zero_hpz_partition_size", REFUSED, "ZeRO++ hpZ: the forward would read a secondary copy that "
             "the fused update never writes, silently freezing the weights; expected 1", accepts=(0, 1)),
    DsOption(_Z + "zero_quantized_weights", REFUSED, "quantized weight gathers are not verified against the "
             "in-place shard update; expected false", accepts=(False,)),
    DsOption(_Z + "zero_quantized_nontrainable_weights", REFUSED, "quantized weight storage is not verified "
             "against the in-place shard update; expected false", accepts=(False,)),
    DsOption(_Z + "zero_quantized_gradients", REFUSED, "quantizes DeepSpeed's gradient reduction, which LOMO does "
             "not use: set comm.reduce_dtype; expected false", accepts=(False,)),
    DsOption(_Z + "mics_shard_size", REFUSED, "MiCS: " + _REMOVED),
    DsOption(_Z + "mics_hierarchical_params_gather", REFUSED, "MiCS: " + _REMOVED),
    DsOption(_Z + "zeropp_loco_param", REFUSED, "LoCo-ZeRO++: " + _REMOVED),
)

_BY_KEY = {}
for _opt in OPTIONS:
    _parent = _opt.key.rpartition(".")[0]
    for _name in (_opt.key.rpartition(".")[2], *_opt.aliases):
        _BY_KEY[f"{_parent}.{_name}" if _parent else _name] = _opt


def option(dotted_key: str) -> DsOption | None:
    """The table row for a dotted DeepSpeed key, under any of its spellings."""
    return _BY_KEY.get(dotted_key)


def table_markdown() -> str:
    """The table as the Markdown of docs/configs.md's "DeepSpeed options" section."""
    rows = ["| key | LOMO | why |", "|---|---|---|"]
    for o in OPTIONS:
        key = f"`{o.key}`" + "".join(f" (`{a}`)" for a in o.aliases)
        if o.status == MAPPED:
            status = f"mapped to `{o.maps_to}`"
        elif o.status == REFUSED and o.when_enabled:
            status = f"refused when `{o.when_enabled}`"
        elif o.status == REFUSED and o.accepts:
            status = "refused unless " + " or ".join(f"`{json.dumps(v)}`" for v in o.accepts)
        else:
            status = o.status
        if o.status == REFUSED and o.all_methods:
            status += " (every method)"
        rows.append(f"| {key} | {status} | {o.reason} |")
    return "\n".join(rows) + "\n"


