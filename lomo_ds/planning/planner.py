"""The memory planner in one import: `from lomo_ds.planning import planner` then planner.plan(...),
planner.format_plan(...), ... The parts: specs.py (what is sized), fetch_units.py (ZeRO-3's gathers),
estimate.py (the bytes; the model behind them: docs/memory.md), int8_shards.py (8-bit shards' terms),
granularity.py (the fetch granularities weighed), report.py (the printed tables),
inputs.py (specs from sizes, config.json files and run configs).

    p = plan_for_run(load_run_config("ds_configs/llama7b.json"), world=1, model_size="7b")
    print(format_plan(p))     # assumptions, per-method rows, the smallest GPU count for each
    est = estimate(LLAMA["13b"], "lomo", gpus=2, run=shipped_run("13b"))
    est.total                 # predicted peak bytes per GPU
"""
from __future__ import annotations

from lomo_ds.planning.estimate import (
    Estimate,
    Plan,
    activation_bytes,
    adalomo_state_bytes,
    adalomo_statistics_numel,
    adalomo_update_temp_bytes,
    estimate,
    family_layer_bytes,
    gathered_expert_bytes,
    gathered_param_bytes,
    io_host_bytes,
    layer_activation_bytes,
    loss_backward_bytes,
    loss_chunk_bytes,
    loss_kept_bytes,
    loss_saved_bytes,
    loss_transient_bytes,
    measuring_backward_bytes,
    plan,
    recomputed_layer_bytes,
    update_temp_bytes,
)
from lomo_ds.planning.fetch_units import (
    _MAX_LEAF,
    ModuleNode,
    _fetch_plan,
    _granularity,
    _is_leaf_by_config,
    fetch_units,
    largest_fetch_unit,
    leaf_module_names,
    module_tree,
    working_set,
)
from lomo_ds.planning.granularity import GRANULARITIES, GranularityRow, coarsest_fitting, granularity_rows
from lomo_ds.planning.inputs import (
    hf_config_path,
    llama_model_paths,
    llama_size_of,
    method_of_run,
    model_spec_for,
    plan_for_run,
    resolve_model,
    run_overrides_from_ds,
    run_spec,
    run_spec_for,
    shipped_run,
    spec_from_hf_config,
)
from lomo_ds.planning.report import (
    ACCUMULATOR_PLACES,
    format_accumulation_summary,
    format_granularity,
    format_plan,
    format_summary,
    shipped_plans,
)
from lomo_ds.planning.specs import (
    ATTENTION,
    AUTO,
    CHUNKED_LOSS_FAMILIES,
    DEEPSPEED_ZERO_DEFAULTS,
    DTYPE_BYTES,
    EXPORT_FILE_BYTES,
    FUSED,
    GIB,
    GPU_COUNTS,
    HOST_STAGED_BUCKETS,
    LLAMA,
    LOSS_ADD_SLICES,
    METHOD_LABELS,
    METHODS,
    PER_LAYER,
    SHIPPED_MICRO_BATCH,
    ZERO_FIELDS,
    ModelSpec,
    RunSpec,
    attention_of,
    chunked_loss,
    llama_spec,
    resolve_auto,
)

__all__ = [
    "ACCUMULATOR_PLACES", "ATTENTION", "AUTO", "attention_of", "recomputed_layer_bytes",
    "CHUNKED_LOSS_FAMILIES", "DEEPSPEED_ZERO_DEFAULTS", "DTYPE_BYTES",
    "EXPORT_FILE_BYTES", "Estimate", "FUSED", "GIB", "GPU_COUNTS", "GRANULARITIES", "GranularityRow",
    "HOST_STAGED_BUCKETS", "LLAMA", "LOSS_ADD_SLICES", "METHODS", "METHOD_LABELS", "ModelSpec", "ModuleNode",
    "PER_LAYER", "Plan", "RunSpec", "SHIPPED_MICRO_BATCH", "_MAX_LEAF", "ZERO_FIELDS", "_fetch_plan", "_granularity",
    "_is_leaf_by_config", "working_set", "activation_bytes", "adalomo_state_bytes", "adalomo_statistics_numel",
    "adalomo_update_temp_bytes", "chunked_loss", "coarsest_fitting", "estimate", "family_layer_bytes",
    "fetch_units", "format_accumulation_summary", "format_granularity", "format_plan", "format_summary",
    "gathered_expert_bytes", "gathered_param_bytes", "granularity_rows", "hf_config_path", "io_host_bytes",
    "largest_fetch_unit",
    "layer_activation_bytes", "leaf_module_names", "llama_model_paths", "llama_size_of", "llama_spec",
    "loss_backward_bytes", "loss_chunk_bytes", "loss_kept_bytes", "loss_saved_bytes", "loss_transient_bytes",
    "measuring_backward_bytes", "method_of_run", "model_spec_for", "module_tree", "plan",
    "plan_for_run", "resolve_auto", "resolve_model", "run_overrides_from_ds", "run_spec", "run_spec_for",
    "shipped_plans", "shipped_run", "spec_from_hf_config", "update_temp_bytes",
]
