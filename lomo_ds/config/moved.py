"""Keys that moved when the configuration was split by concern: a config (or a --set) written for
the old keys fails with one line per old key present, naming where it went, instead of the
schema's "unknown key"."""
from __future__ import annotations

from lomo_ds.config.errors import ConfigError

_TO_COMM = ("grad_reduction", "param_gather", "bucket_size", "reduce_dtype", "max_in_flight", "sparse_params")
_TO_MEMORY = ("update_chunk_elements", "chunked_loss", "loss_chunk_logits", "host_update", "accumulate_on",
              "accumulate_dtype", "two_pass_mode")
_TO_TRAIN = ("clip_grad_norm", "clip_grad_value", "scheduler", "collective_timeout", "accumulation_steps",
             "loss_normalization")

# old dotted key -> the key that replaced it
MOVED: dict[str, str] = {
    **{f"lomo.{k}": f"comm.{k}" for k in _TO_COMM},
    **{f"lomo.{k}": f"memory.{k}" for k in _TO_MEMORY},
    **{f"lomo.{k}": f"train.{k}" for k in _TO_TRAIN},
    "lomo.recipes": "lomo.presets",
    "lomo.seed": "train.seed",
    "data.seed": "train.seed",
    "train.baseline_lr": "train.lr",
    "train.baseline_weight_decay": "train.weight_decay",
    "train.lora.lr": "train.lr",
}


def moved_to(dotted: str) -> str | None:
    """Where an old dotted key (or a key inside an old section, lomo.recipes.sgd.lr) went, or None."""
    for old, new in MOVED.items():
        if dotted == old or dotted.startswith(old + "."):
            return new + dotted[len(old):]
    return None


def check_moved(raw: dict, src: str) -> None:
    """Refuse a raw config that still has old keys: one line each, every line naming the new key."""
    lines = [f"{src}: {old} moved to {new}" for old, new in MOVED.items() if _present(raw, old)]
    if lines:
        raise ConfigError("\n".join(lines))


def _present(raw: dict, dotted: str) -> bool:
    *parents, name = dotted.split(".")
    node = raw
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    return isinstance(node, dict) and name in node
