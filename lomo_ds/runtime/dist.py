"""Process-group helpers every training method shares: starting the group, reducing a few step
statistics over the ranks, the loss of a model's outputs, and gathering full parameters."""
from __future__ import annotations

# DeepSpeed, transformers, safetensors and peft are imported inside the functions that use them: the
# CLI and the config checks start without them, and recipe/train.py's show_what_matters sets the
# ranks' logging before their first import.
import inspect
import os
from datetime import timedelta
from typing import Any

import torch

from lomo_ds.runtime import ds_compat
from lomo_ds.runtime.device import group_device, set_rank_device


def init_distributed(timeout_s: float | None = None) -> None:
    """Start the process group once, then put this rank on its own accelerator (gloo on a CPU,
    NCCL on GPUs: DeepSpeed's accelerator picks). `timeout_s` (train.collective_timeout): how long
    a collective may wait on a peer before the run fails; NCCL's watchdog then aborts the
    communicator and raises (async error handling) instead of leaving the peers waiting."""
    import deepspeed

    if not torch.distributed.is_initialized():
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        kwargs = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
        ds_compat.skip_shm_allreduce_op()
        deepspeed.init_distributed(**kwargs)
    # After DeepSpeed's start: under an MPI-style launcher (mpirun, SLURM's srun) its discovery is
    # what sets LOCAL_RANK, so before it every rank would pick the first GPU. NCCL makes its
    # communicators at the first collective, by then on this rank's device.
    set_rank_device()


_IO_GROUPS: dict[float, object] = {}


def io_group(timeout_s: float):
    """Collective on first use (every rank at the same call): a gloo group of every rank whose
    timeout is `timeout_s` (output.io_timeout), for the waits on disk writes and the checkpoint's
    own planning, whose tensors are host tensors."""
    group = _IO_GROUPS.get(timeout_s)
    if group is None:
        group = _IO_GROUPS[timeout_s] = torch.distributed.new_group(backend="gloo",
                                                                     timeout=timedelta(seconds=timeout_s))
    return group


def io_barrier(timeout_s: float) -> None:
    """Collective: wait for every rank where some rank may spend long on disk (a checkpoint's or an
    export's files), through io_group(timeout_s), not train.collective_timeout: a slow disk must not
    look like a dead peer to NCCL's watchdog, which would kill the job after training with its
    export half-written. No NCCL collective is in flight while a rank waits here."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return
    torch.distributed.barrier(group=io_group(timeout_s))


def loss_of(outputs) -> torch.Tensor:
    """The loss of a model's outputs (a tensor, or a dict/ModelOutput with "loss")."""
    loss = outputs if torch.is_tensor(outputs) else outputs["loss"]
    if loss is None:
        raise ValueError("the model returned no loss: pass `labels` in the batch")
    return loss


def all_reduce_sum(t: torch.Tensor, world: int, group=None, name: str = "step statistics") -> torch.Tensor:
    """`t` summed over the group's ranks, on the group's device (NCCL: the accelerator; gloo: the
    CPU; `t` is moved there first when it lives elsewhere)."""
    if world == 1:
        return t
    t = t.to(group_device(group))
    ds_compat.all_reduce(t, group=group, name=name)
    return t


def sum_over_ranks(values, world: int, group=None, dtype=torch.float32, name="step statistics") -> list[float]:
    """Element-wise sums over the group's ranks, in one all-reduce of a few bytes, read back to
    the host. `values`: numbers, or a 1-D tensor (kept in its dtype: a device tensor is reduced
    with no host sync before the one read)."""
    t = values if torch.is_tensor(values) else torch.tensor(values, dtype=dtype, device="cpu")
    return all_reduce_sum(t, world, group, name).tolist()


def mean_over_ranks(value: float, world: int, group=None) -> float:
    # fp32: 4 bytes on the wire per step are enough for a reported loss.
    return sum_over_ranks([float(value)], world, group, name="loss")[0] / world


def has_labelled_tokens(batch: dict[str, Any]) -> bool:
    """Whether any label is a target. Causal LMs shift labels inside the model (position t
    predicts labels[t + 1]), so the first column is never one. No labels: the model's own loss."""
    labels = batch.get("labels")
    return labels is None or bool((labels[..., 1:] != -100).any())


def label_tokens(batch: dict[str, Any]) -> int:
    """The target tokens of a batch (labels shifted as in has_labelled_tokens); with no labels,
    every position the model's own loss predicts (all but the first of each row)."""
    labels = batch.get("labels")
    if labels is None:
        ids = batch["input_ids"]
        return ids[..., 1:].numel()
    return int((labels[..., 1:] != -100).sum())


def accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the model's forward takes transformers' `logits_to_keep` (causal LMs do; a peft
    model passes it on to its base model)."""
    base = getattr(model, "get_base_model", lambda: model)()
    return "logits_to_keep" in inspect.signature(base.forward).parameters


def keep_labelled_logits(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch with the model asked for logits only from the first position that predicts a
    label on (`logits_to_keep`), and its labels cut to match. The loss reads no logit before that
    position, so it is the same loss (the same target tokens, the same mean); but the output
    projection and its gradient skip the prompt: for a yes/no task nearly the whole sequence, and
    the [batch, length, vocabulary] logits are a small model's largest activation (SmolLM2-135M's
    output projection is a fifth of its weights; figures: docs/results.md).
    Call it on the host batch; it reads the labels only."""
    labels = batch.get("labels")
    if labels is None or labels.dim() != 2 or "logits_to_keep" in batch:
        return batch
    # Column c >= 1 holds a target of position c - 1 (causal LMs shift labels by one).
    targets = (labels[:, 1:] != -100).any(dim=0).nonzero()
    if targets.numel() == 0:
        return batch  # nothing to learn: the engines skip such a batch on their own
    first = int(targets[0]) + 1
    if first < 2:
        return batch
    # Kept: positions first-1 .. end; labels from the same column, so the model's shift pairs
    # kept position j with label column first + j as before (the new first column is no target).
    return {**batch, "labels": labels[:, first - 1:], "logits_to_keep": labels.size(1) - first + 1}


def gather_full_state_dict(module: torch.nn.Module, rank: int) -> dict[str, torch.Tensor] | None:
    """Collective: full parameters by name on rank 0 (None elsewhere), gathered one at a time.
    A tied tensor appears under each of its names."""

    state: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            if rank == 0:
                state[name] = state[seen[id(p)]]
            continue
        seen[id(p)] = name
        full = full_on_first_rank(p, rank)
        if rank == 0:
            state[name] = full
    return state if rank == 0 else None


def full_on_first_rank(p: torch.nn.Parameter, rank: int) -> torch.Tensor | None:
    """Collective for a ZeRO-3 parameter (a plain one is read where it is): its full value, a copy
    in rank 0's host memory; None on the other ranks."""
    return full_copy_where(p, rank == 0)


def full_copy_where(p: torch.nn.Parameter, here: bool) -> torch.Tensor | None:
    """Collective for a ZeRO-3 parameter (a plain one is read where it is): its full value, a copy
    in the host memory of every rank where `here` is true (each node's writer, when every node
    keeps its own copy of a checkpoint); None on the others."""
    import deepspeed

    if ds_compat.is_zero_param(p):
        with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
            return p.data.detach().to("cpu", copy=True) if here else None
    return p.data.detach().to("cpu", copy=True) if here else None
