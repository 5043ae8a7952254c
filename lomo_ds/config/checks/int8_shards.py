"""8-bit weight shards (memory.int8_shards, lomo_ds/runtime/quant8.py): what they cannot run with.

The engine runs `refuse_int8_conflicts` too, on the config it was given, so a config that never
went through the run config's loader is refused the same way."""
from __future__ import annotations

from lomo_ds.config.errors import ConfigError
from lomo_ds.config.methods import LOMO_METHODS

# DeepSpeed's ZeRO++ quantization switches: its CUDA quantizer op, fp16 only, and a second,
# different 8-bit format over the same partitions.
DS_QUANTIZED = ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients")


def refuse_int8_conflicts(memory, lomo, ds: dict) -> None:
    """With memory.int8_shards on: a ConfigError naming the first key that conflicts, and why."""
    if not memory.int8_shards:
        return
    if lomo.fp32_master_weights:
        raise ConfigError("lomo.fp32_master_weights: expected false with memory.int8_shards (fp32 masters hold 4 "
                          "bytes a parameter, where 8-bit shards exist to hold about 1)")
    if (ds.get("fp16") or {}).get("enabled", False):
        raise ConfigError("fp16.enabled: expected false with memory.int8_shards (8-bit shards dequantize to bf16 or "
                          "fp32; fp16's range cannot hold every block's scale times 127, and its loss scaling would "
                          "scale the shards' updates)")
    zero = ds.get("zero_optimization") or {}
    for key in DS_QUANTIZED:
        if zero.get(key, False):
            raise ConfigError(f"zero_optimization.{key}: expected false with memory.int8_shards (DeepSpeed's ZeRO++ "
                              "quantization is a CUDA op for fp16 with its own 8-bit format; memory.int8_shards "
                              "already gathers the 8-bit shards and their scales)")
    refuse_host_update_worker(memory, zero)
    block = memory.int8_block
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0 or block % 8:
        raise ConfigError(f"memory.int8_block: expected a positive multiple of 8, got {block!r}")


def refuse_host_update_worker(memory, zero: dict) -> None:
    """offload_param cpu with memory.host_update "thread": the worker that updates the shards in host
    memory issues no collective, and an 8-bit block cut between ranks gets its one scale from one
    (engine/update/int8.py). "auto" never picks the worker with 8-bit shards, and "inline" updates
    8-bit shards in host memory in the hook."""
    offload = zero.get("offload_param") or {}
    on_host = (isinstance(offload, dict) and offload.get("device") == "cpu") or zero.get("cpu_offload_param", False)
    if on_host and getattr(memory, "host_update", "auto") == "thread":
        raise ConfigError("memory.host_update: expected 'inline' or 'auto' with memory.int8_shards and "
                          "zero_optimization.offload_param.device 'cpu' (the host-update worker issues no "
                          "collective, and an 8-bit block cut between ranks gets its one scale from one)")


def check_int8_shards(cfg, loading) -> None:
    if cfg.output.export_int8:
        refuse_int8_export(cfg)
    if not cfg.memory.int8_shards:
        return
    if cfg.train.method not in LOMO_METHODS:
        raise ConfigError(f"memory.int8_shards: applied by the fused-update engine (train.method {LOMO_METHODS}), "
                          f"not by {cfg.train.method!r}")
    refuse_int8_conflicts(cfg.memory, cfg.lomo, cfg.ds)


def refuse_int8_export(cfg) -> None:
    """output.export_int8 writes the run's 8-bit shards beside its bf16 export: it needs both."""
    if not cfg.memory.int8_shards:
        raise ConfigError("output.export_int8: expected memory.int8_shards true (the 8-bit export writes the run's "
                          "8-bit weight shards and their scales; without memory.int8_shards there are none)")
    if not cfg.output.export_hf:
        raise ConfigError("output.export_int8: expected output.export_hf true (the 8-bit form is written beside "
                          "the Hugging Face export, hf_model)")
    if cfg.train.method != "lomo":
        raise ConfigError(f"output.export_int8: expected train.method 'lomo', got {cfg.train.method!r} (LoRA's 8-bit "
                          "shards are its adapters; its export, hf_model, merges them into the base weights)")
