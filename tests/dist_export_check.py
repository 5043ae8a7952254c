"""Trains a tiny model 2 steps through the engine, exports it with lomo_ds.checkpoint.export_hf
(shards of at most argv[3] bytes),
and saves the engine's own logits on a fixed batch beside it (tests/test_train.py compares)."""
import os
import sys

import torch

import lomo_ds
from lomo_ds.checkpoint import export_hf
from tiny import global_batch, tiny_llama  # this script's own directory is on sys.path


def main(out_dir: str, tie: bool, max_shard_size: int) -> None:
    lomo_ds.init_distributed()
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


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "tied", int(sys.argv[3]))
