"""LOMO's own rule, SGD on the shard: θ = θ (1 - lr weight_decay) - lr g, in fp32 arithmetic,
chunk by chunk (shard.py). Every step is elementwise, so an fp32 result is bit for bit the
unchunked one, and a slice needs nothing from the rest of its bucket: the host-update worker
applies the slices of shards in host memory one by one. No state."""
from __future__ import annotations

from typing import Any

import torch

from lomo_ds.engine.update.rule import BuildContext, Items, PassSettings, PassStats, StateLayout, unscale_and_clip
from lomo_ds.engine.update.shard import ShardWeights, grad_chunk
from lomo_ds.runtime import ds_compat


class SGD:
    name = "sgd"
    takes_whole_bucket = False

    @classmethod
    def build(cls, ctx: BuildContext) -> "SGD":
        return cls()

    def apply_bucket(self, shard: ShardWeights, items: Items, stats: PassStats, settings: PassSettings) -> None:
        finite = stats.finite_now()
        for param, grad_shard in items:
            self.apply(shard, param, grad_shard, finite, settings)

    def apply(self, shard: ShardWeights, param: torch.nn.Parameter, grad_shard, finite: torch.Tensor | bool,
              settings: PassSettings) -> None:
        """Update this rank's slice of `param` from its reduced slice (a tensor, or the accumulator's
        sum), unless `finite` (the pass's device flag as of this bucket) is false; `finite=True`:
        known finite on the host."""
        n = shard.geometry(param).local
        if n == 0:
            return
        device = ds_compat.shard(param).device
        keep = None if finite is True else finite.to(device)
        step_scale = 1.0 if settings.clip_value is not None else settings.grad_scale
        decay = None
        if settings.weight_decay:
            decay = 1.0 - settings.lr * settings.weight_decay
            decay = decay if keep is None else torch.where(keep, decay, 1.0)
        masked = keep is not None or settings.clip_value is not None
        for a, b in shard.chunks(param):  # whole 8-bit blocks where the shard has them
            # The slice may be the received bucket or the accumulator itself: written only as a copy.
            g = grad_chunk(grad_shard, a, b, device, fresh=masked)
            if keep is not None:
                g.masked_fill_(~keep, 0.0)  # a skipped bucket moves nothing (NaN * 0 would still be NaN)
            if settings.clip_value is not None:
                g = unscale_and_clip(g, settings)
            weights = shard.weights(param, a, b)
            if decay is not None:
                weights.mul_(decay)
            weights.add_(g, alpha=-settings.lr * step_scale)  # scale folded into the axpy: one pass
            shard.write_back(param, weights, a, b)
            del g, weights

    def slice_device(self, param: torch.nn.Parameter) -> torch.device:
        return ds_compat.shard(param).device

    def state_dict(self) -> None:
        return None

    def check_state(self, state: dict[str, Any] | None) -> None:
        if state:
            raise ValueError(f"SGD keeps no state, and the checkpoint's rule state has {sorted(state)[:3]}: "
                             "a checkpoint of another rule (lomo.optimizer)")

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        return None

    def state_layout(self) -> StateLayout:
        return {}

    def state_bytes(self) -> int:
        return 0
