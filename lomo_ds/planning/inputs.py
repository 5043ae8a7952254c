"""The planner's inputs: a model spec from a LLaMA size, an HF config.json or a run config's model,
and a RunSpec from a run config (its DeepSpeed keys, sequence length and engine sections)."""
from __future__ import annotations

import json
import os
from dataclasses import replace

from lomo_ds.config.run import LOMO_METHODS, resolve_model_source
from lomo_ds.planning.estimate import Plan, plan
from lomo_ds.planning.specs import (
    AUTO,
    DEEPSPEED_ZERO_DEFAULTS,
    GPU_COUNTS,
    LLAMA,
    METHODS,
    SHIPPED_MICRO_BATCH,
    ZERO_FIELDS,
    ModelSpec,
    RunSpec,
    attention_of,
    llama_spec,
)


def run_spec(**overrides) -> RunSpec:
    return replace(RunSpec(), **overrides)


def shipped_run(size: str) -> RunSpec:
    """The shipped config's run for a LLaMA size (ds_configs/llama<size>.json)."""
    return RunSpec(batch=SHIPPED_MICRO_BATCH[size])


def spec_from_hf_config(cfg: dict, name: str = "model") -> ModelSpec:
    """The architecture of a config.json: with a model_type, the model transformers builds from it
    (on the meta device: planning/model_tree.py); without one, LLaMA's tree of these sizes."""
    if cfg.get("model_type"):
        from lomo_ds.planning.model_tree import spec_from_config  # torch and transformers: only for a config.json

        return spec_from_config(cfg, name)
    try:
        return ModelSpec(name=name, hidden=int(cfg["hidden_size"]), layers=int(cfg["num_hidden_layers"]),
                         intermediate=int(cfg["intermediate_size"]), vocab=int(cfg.get("vocab_size", 32000)),
                         heads=int(cfg["num_attention_heads"]),
                         kv_heads=cfg.get("num_key_value_heads"), head_dim=cfg.get("head_dim"),
                         tie=bool(cfg.get("tie_word_embeddings", False)),
                         softcap=bool(cfg.get("attn_logit_softcapping")),
                         final_softcap=bool(cfg.get("final_logit_softcapping")))
    except KeyError as e:
        raise ValueError(f"{name}: not a LLaMA-style config, missing {e.args[0]!r}") from None


def run_overrides_from_ds(ds: dict) -> dict:
    """RunSpec fields a DeepSpeed config decides: precision, micro-batch, ZeRO-3 sizes and parameter
    offload. A zero_optimization key left out is DeepSpeed's default, not the planner's."""
    zero = ds.get("zero_optimization") or {}
    out = {f: int(float(zero.get(k, DEEPSPEED_ZERO_DEFAULTS[k]))) for k, f in ZERO_FIELDS.items()}
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
    ds = run_overrides_from_ds(cfg.ds)
    return replace(RunSpec(), **ds, seq=cfg.tokenizer.max_length,
                   checkpointing=cfg.model.gradient_checkpointing, lomo_bucket=cfg.comm.bucket_size,
                   lomo_fp32_master=cfg.lomo.fp32_master_weights, stochastic_rounding=cfg.lomo.stochastic_rounding,
                   accumulation=cfg.train.accumulation_steps, accumulate_dtype=cfg.memory.accumulate_dtype,
                   accumulate_on_host=cfg.memory.accumulate_on == "cpu", update_chunk=cfg.memory.update_chunk_elements,
                   chunked_loss=cfg.memory.chunked_loss != "off", loss_chunk=cfg.memory.loss_chunk_logits,
                   two_pass=cfg.memory.two_pass_mode if two_backwards(cfg, ds["dtype"]) else None,
                   attn=attention_of(cfg.model.attn_implementation), tiled_mlp=cfg.memory.tiled_mlp,
                   mlp_tiles=cfg.memory.mlp_tiles, offload_checkpoints=cfg.memory.offload_checkpoints,
                   sp=cfg.train.sequence_parallel_size, int8_shards=cfg.memory.int8_shards,
                   int8_block=cfg.memory.int8_block)


def two_backwards(cfg, dtype: str) -> bool:
    """Whether a step of one micro-batch takes a measuring backward first, as the engine decides
    (LomoEngine.two_passes) from `cfg`'s sections: norm clipping (train.clip_grad_norm), or a loss
    scaler (lomo.loss_scale.enabled; unset: fp16)."""
    scaling = cfg.lomo.loss_scale.enabled if cfg.lomo.loss_scale.enabled is not None else dtype == "fp16"
    return cfg.train.clip_grad_norm is not None or bool(scaling)


def model_spec_for(cfg, model_size: str | None = None) -> ModelSpec:
    """The architecture a run config trains: `model_size` (7b|13b|30b|65b), else the config's
    model.planner_size or model.planner_config (a config.json), else read from model.path (an HF
    folder's config.json, or the GGUF file's metadata: the builtin model). A path that is not on
    this machine (the shipped configs' placeholders, a hub name) needs one of the others."""
    model_size = model_size or cfg.model.planner_size
    if model_size is not None:
        return llama_spec(model_size)
    if cfg.model.planner_config:
        if hf_config_path(cfg.model.planner_config) is None:
            raise ValueError(f"model.planner_config {cfg.model.planner_config!r}: not an HF config.json")
        return resolve_model(cfg.model.planner_config)
    source, gguf = resolve_model_source(cfg.model.path, cfg.model.gguf_file)
    if gguf:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint  # transformers: only for a GGUF

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
    lomo.optimizer names (its registered row, config/rules.py), DeepSpeed's SGD or AdamW; None for
    methods, or rules, the planner has no terms for."""
    if cfg.train.method in LOMO_METHODS:
        spec = cfg.lomo.rule
        return spec.row if spec.plan is not None else None
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
    and a folder holding llama-7b, llama13b, 30b, ... (the benchmarks' --model-path/--model-root)."""
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
