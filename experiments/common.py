"""What the experiment scripts share."""
from __future__ import annotations

import statistics
import time
from typing import Iterable


# ----------------------------------------------------------------------------- throughput
def measure_tgs(engine, batches: Iterable[dict], warmup: int = 2, steps: int = 5,
                tokens_per_step: int | None = None) -> dict[str, float]:
    """Tokens per rank (GPU) per second, the paper's TGS: `warmup` steps excluded, median of `steps`
    timed steps. `batches` yields this rank's micro-batches (cycled when short). Each step ends
    with a barrier so the time is the slowest rank's."""
    batches = list(batches)
    if not batches:
        raise ValueError("measure_tgs: no batches")
    times = []
    for i in range(warmup + steps):
        batch = batches[i % len(batches)]
        _sync()
        t0 = time.perf_counter()
        engine.train_step(batch)
        _sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    tokens = tokens_per_step if tokens_per_step is not None else int(batches[0]["input_ids"].numel())
    med = statistics.median(times)
    return {"step_time_s": med, "tgs": tokens / med, "tokens_per_step": tokens, "steps": steps,
            "warmup": warmup, "all_times_s": times}


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


# ----------------------------------------------------------------------------- engines
def build_method_engine(model, ds_config: dict, method: str, lomo: dict, train: dict | None = None,
                        activation_checkpointing: bool = False):
    """lomo_ds.methods.build_engine for a model built in memory, the run config made of these sections
    (`train`: e.g. baseline_lr; `lomo`: the LOMO section, whose clip_grad_norm every method uses)."""
    from lomo_ds.methods import build_engine
    from lomo_ds.run_config import load_run_config

    if activation_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
        model.config.use_cache = False
    cfg = load_run_config({**ds_config, "lomo": lomo, "model": {"path": "<built in memory>"},
                           "train": {"method": method, **(train or {})}}, check_files=False)
    return build_engine(cfg, model, total_steps=0)
