"""The route of ZeRO-3's parameter all-gathers (comm.param_gather), for every engine lomo_ds
builds (LOMO, the DeepSpeed baselines, zero-shot, the benchmarks' floor): through
torch.distributed (deepspeed.comm's own), or through shared memory between CPU ranks of one node
(shm_all_gather.py). Process-wide, set before DeepSpeed partitions a model."""
from __future__ import annotations

import enum

from lomo_ds.comm import shm_all_gather


class ParamRoute(str, enum.Enum):
    TORCH = "torch"
    SHARED_MEMORY = "shared_memory"


def configure_param_gather(requested: str = "auto", timeout_s: float | None = None) -> ParamRoute:
    """Every rank, the same arguments, at the same point: route the gathers from now on as
    `requested` ("auto", "torch" or "shared_memory") resolves on these ranks."""
    return ParamRoute(shm_all_gather.configure(requested, timeout_s))


def abandon_param_gather() -> None:
    """This rank's step raised: peers waiting on its next gather fail now where the route can
    tell them."""
    shm_all_gather.abandon()
