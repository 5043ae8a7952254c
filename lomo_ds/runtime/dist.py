"""Process-group helpers every training method shares: starting the group, reducing a few step
statistics over the ranks, the loss of a model's outputs, and gathering full parameters."""
from __future__ import annotations

from typing import Any

import torch

from lomo_ds.runtime import ds_compat
from lomo_ds.runtime.device import group_device


def init_distributed() -> None:
    """Start the process group once (gloo on a CPU, NCCL on GPUs: DeepSpeed's accelerator picks)."""
    import deepspeed

    if not torch.distributed.is_initialized():
        deepspeed.init_distributed()
        if torch.distributed.get_backend() == "gloo":
            torch.distributed.barrier()  # every rank has mapped its peers' shared memory
            ds_compat.forget_shm_allreduce_names()


def loss_of(outputs) -> torch.Tensor:
    """The loss of a model's outputs (a tensor, or a dict/ModelOutput with "loss")."""
    loss = outputs if torch.is_tensor(outputs) else outputs["loss"]
    if loss is None:
        raise ValueError("the model returned no loss: pass `labels` in the batch")
    return loss


def sum_over_ranks(values: list[float], world: int, group=None, dtype=torch.float32,
                   name="step statistics") -> list[float]:
    """Element-wise sums over the group's ranks, in one all-reduce of a few bytes."""
    t = torch.tensor(values, dtype=dtype, device=group_device(group) if world > 1 else "cpu")
    if world > 1:
        ds_compat.all_reduce(t, group=group, name=name)
    return t.tolist()


def mean_over_ranks(value: float, world: int, group=None) -> float:
    # fp32: 4 bytes on the wire per step are enough for a reported loss.
    return sum_over_ranks([float(value)], world, group, name="loss")[0] / world


def has_labelled_tokens(batch: dict[str, Any]) -> bool:
    """Whether any label is a target. Causal LMs shift labels inside the model (position t
    predicts labels[t + 1]), so the first column is never one. No labels: the model's own loss."""
    labels = batch.get("labels")
    return labels is None or bool((labels[..., 1:] != -100).any())


def gather_full_state_dict(module: torch.nn.Module, rank: int) -> dict[str, torch.Tensor] | None:
    """Collective: full parameters by name on rank 0 (None elsewhere), gathered one at a time.
    A tied tensor appears under each of its names."""
    import deepspeed

    state: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            if rank == 0:
                state[name] = state[seen[id(p)]]
            continue
        seen[id(p)] = name
        if ds_compat.is_zero_param(p):
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                if rank == 0:
                    state[name] = p.data.detach().to("cpu", copy=True)
        elif rank == 0:
            state[name] = p.data.detach().to("cpu", copy=True)
    return state if rank == 0 else None
