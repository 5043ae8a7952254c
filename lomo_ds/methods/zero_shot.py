"""Zero-shot: no training. DeepSpeed ZeRO-3 partitions the model (no optimizer); train_step only
reports the loss, so the method fits the same loop and tables as the others."""
from __future__ import annotations

# DeepSpeed, transformers, safetensors and peft are imported inside the functions that use them: the
# CLI and the config checks start without them, and recipe/train.py's show_what_matters sets the
# ranks' logging before their first import.
from typing import Any

import torch

from lomo_ds.comm import configure_param_gather
from lomo_ds.config import leaf_module
from lomo_ds.methods.base import MethodEngine
from lomo_ds.methods.deepspeed_optim import baseline_ds_config
from lomo_ds.runtime import ds_compat
from lomo_ds.runtime.device import move_batch
from lomo_ds.runtime.dist import init_distributed, loss_of, mean_over_ranks


class ZeroShotEngine(MethodEngine):
    method = "zero_shot"
    supports_resume = False  # nothing is trained, so there is nothing to resume

    def __init__(self, model: torch.nn.Module, ds_config: dict, param_gather: str = "auto"):
        import deepspeed

        super().__init__()
        init_distributed()
        self.param_gather = configure_param_gather(param_gather)  # comm.param_gather, as every engine
        for p in model.parameters():
            p.requires_grad_(False)
        # No step to accumulate for: gradient_accumulation_steps is ignored.
        ds = {**baseline_ds_config(ds_config, clip=None), "gradient_accumulation_steps": 1}
        self.ds_engine, *_ = deepspeed.initialize(model=model, config=leaf_module.resolve(ds, model),
                                                  model_parameters=None, optimizer=None)
        self.module = self.ds_engine.module
        self.params = self.all_params()
        self.group = ds_compat.process_group(self.params[0])
        self.world = torch.distributed.get_world_size(self.group)
        self.rank = torch.distributed.get_rank(self.group)
        self.global_step = 0

    def train_step(self, batch: dict[str, Any]) -> dict[str, Any]:
        with torch.no_grad():
            loss = loss_of(self.module(**move_batch(batch, self.device)))
        if self.tracker is not None:
            self.tracker.sample()
        ds_compat.release_all(ds_compat.offload_of(self.ds_engine))
        self.global_step += 1
        return {"loss": mean_over_ranks(loss.float().item(), self.world, self.group), "lr": 0.0,
                "grad_norm": None, "skipped": True, "loss_scale": 1.0, "stepped": True, "micro_batches": 1}
