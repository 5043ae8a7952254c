"""Trains a tiny model 2 steps through the engine, exports it with lomo_ds.storage.checkpoint.export_hf
(shards of at most MAX_SHARD_SIZE bytes), and saves the engine's own logits on a fixed batch beside
it. tests/dist_checks.py runs it, tied and untied, in its 2-rank launch; tests/test_train.py loads
the export in transformers and compares."""
import os

import torch

import lomo_ds
from lomo_ds.storage.checkpoint import export_hf
from tiny import global_batch, tiny_llama  # this script's own directory is on sys.path


MAX_SHARD_SIZE = 40_000  # bytes: the ~0.2 MB tiny model in several shards, as a 65B one is in 5 GB ones


def export(out_dir: str, tie: bool, max_shard_size: int) -> dict:
    engine = lomo_ds.initialize(tiny_llama(11, tie=tie), {"train_micro_batch_size_per_gpu": 2,
                                                          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000},
                                                          "lomo": {"lr": 0.05, "clip_grad_norm": 1.0}})
    for step in range(2):
        engine.train_step(global_batch(step, engine.world)[engine.rank])
    export_hf(engine, None, out_dir, torch.distributed.barrier, max_shard_size=max_shard_size)
    probe = global_batch(99, 1)[0]["input_ids"]
    logits = engine.eval_forward({"input_ids": probe}).logits
    if engine.rank == 0:
        torch.save({"input_ids": probe, "logits": logits}, os.path.join(out_dir, "engine_logits.pt"))
    return {"dir": out_dir, "max_shard_size": max_shard_size}


def export_checks(world: int, work_dir: str) -> dict:
    """The export of a tied and an untied model, each into its own folder under `work_dir`."""
    return {tie: (lambda tie=tie: export(os.path.join(work_dir, f"export_{tie}"), tie == "tied", MAX_SHARD_SIZE))
            for tie in ("untied", "tied")}
