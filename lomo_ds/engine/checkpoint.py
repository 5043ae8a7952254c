"""The engine's resumable state: each rank's shards, fp32 masters, AdaLomo state and the step
counters (a checkpoint holds one such part per rank; lomo_ds/recipe writes and reads them)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lomo_ds.runtime import ds_compat

if TYPE_CHECKING:
    from lomo_ds.engine.lomo_engine import LomoEngine


def shard_state_dict(engine: "LomoEngine") -> dict[str, Any]:
    """This rank's part of a resumable checkpoint: its shards, masters and the step state.
    Only at a step boundary: the accumulator is then empty, so it is not part of the state.
    The tensors are the live shards themselves, not copies (a node's ranks would otherwise
    hold the whole model twice in host memory): write them out before the next step.
    torch.save copies a device tensor to the host one at a time as it writes it."""
    if engine.micro_step:
        raise RuntimeError(f"shard_state_dict: {engine.micro_step} micro-batch(es) of a window of "
                           f"{engine.window_length} are accumulated; checkpoint at a step boundary")
    names = {id(p): n for n, p in engine.module.named_parameters()}
    return {
        "world": engine.world,
        "rank": engine.rank,
        "shards": {names[id(p)]: ds_compat.shard(p).detach() for p in engine.params},
        "masters": {names[id(p)]: engine.updater.masters[ds_compat.param_id(p)].detach()
                    for p in engine.params if ds_compat.param_id(p) in engine.updater.masters},
        "global_step": engine.global_step,
        "skipped_steps": engine.skipped_steps,
        "consecutive_skips": engine.consecutive_skips,
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler else None,
        "adalomo": engine.updater.adalomo.state_dict() if engine.updater.adalomo else None,
    }


def load_shard_state_dict(engine: "LomoEngine", state: dict[str, Any]) -> None:
    """Restore what shard_state_dict wrote, on the rank that wrote it; every refusal comes before
    any shard is written."""
    if state["world"] != engine.world or state["rank"] != engine.rank:
        raise ValueError(f"checkpoint shard was written by rank {state['rank']} of {state['world']}, "
                         f"this is rank {engine.rank} of {engine.world}")
    by_name = dict(engine.module.named_parameters())
    for name in state["shards"]:
        if name not in by_name:
            raise ValueError(f"checkpoint has parameter {name!r}, the model does not")
    names = {id(p): n for n, p in by_name.items()}
    for p in engine.params:
        name = names[id(p)]
        if name not in state["shards"]:
            raise ValueError(f"checkpoint has no shard of {name!r}, which this run trains")
        if ds_compat.param_id(p) in engine.updater.masters and name not in state["masters"]:
            # Left at its pretrained value, the master would overwrite the trained shard at
            # the first update.
            raise ValueError(f"checkpoint has no fp32 master of {name!r}: it was written without "
                             f"lomo.fp32_master_weights; resume with the setting it was written with")
    for name, tensor in state["shards"].items():
        ds_compat.shard(by_name[name]).copy_(tensor)
    for name in state["masters"]:
        master = engine.updater.masters.get(ds_compat.param_id(by_name[name]))
        if master is not None:
            master.copy_(state["masters"][name])
    if engine.updater.adalomo is not None:
        if not state.get("adalomo"):
            raise ValueError("checkpoint shard has no AdaLomo state (written with lomo.optimizer 'sgd'); "
                             "resume with the optimizer it was written with")
        engine.updater.adalomo.load_state_dict(state["adalomo"])
        # The shards were just written: the sums of squares recorded by the host-update worker
        # describe the weights before the load.
        engine.updater.adalomo.forget_weight_norms()
    engine.global_step = state["global_step"]
    engine.skipped_steps = state["skipped_steps"]
    engine.consecutive_skips = state.get("consecutive_skips", 0)
    if engine.loss_scaler is not None and state["loss_scaler"] is not None:
        engine.loss_scaler.load_state_dict(state["loss_scaler"])
    ds_compat.release_all(engine.offload)
