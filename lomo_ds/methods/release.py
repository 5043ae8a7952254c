"""Free what a method's engine holds, for a process that is done training but not done (the
harness on the export: lomo_ds/recipe/harness_eval.py loads the whole model on rank 0's device next).

Each method's engine frees what it owns through its own `release()` (MethodEngine.release; LOMO's
engines first hand their LomoEngine its own, LomoEngine.release); how a tensor is freed in place is
lomo_ds/engine/release.py's. The engine is unusable afterwards.
"""
from __future__ import annotations


def merge_freed(*freed: dict[str, int]) -> dict[str, int]:
    """Bytes freed by device type, summed over several releases."""
    out: dict[str, int] = {}
    for part in freed:
        for kind, n in part.items():
            out[kind] = out.get(kind, 0) + n
    return out


def release_engine(engine) -> dict[str, int]:
    """Empty every tensor the method's `engine` holds and the accelerator's cache; returns the bytes
    freed by device type ({"cuda": .., "cpu": ..}), each storage counted once."""
    return engine.release()
