"""The integrations on the GPU launch (tests/gpu/gpu_checks.py): the HF Trainer, TRL's SFTTrainer and
DPOTrainer through lomo_ds.integrations, as the CPU suite drives them (tests/integrations/dist_hf_checks.py,
tests/integrations/dist_dpo_checks.py), and the Trainer's bf16 AdaLomo with accumulation, the path where
bf16 AdaLomo without masters once read gradients it had overwritten.

The Trainer's and SFTTrainer's references are single-process on the CPU and make no collective, so
the CPU suite's checks run here as they are. DPO's reference calls TRL's own loss, which gathers its
metrics over the ranks: on NCCL those must be device tensors, so dpo_on_device runs the CPU suite's
check with the reference model and its batches moved to the trainer's device.
"""
from __future__ import annotations

import contextlib

import torch

from tests.adalomo_reference import ReferenceAdaLomo
from tests.gpu.precision_checks import bf16_ulps
from tests.integrations import dist_dpo_checks as D
from tests.integrations import dist_hf_checks as H
from tests.tiny import tiny_llama


class DeviceAdaLomo(ReferenceAdaLomo):
    """The reference AdaLomo with its statistics made on each parameter's device (the reference
    makes them on the CPU, which a GPU parameter cannot be updated with)."""

    def __init__(self, params, lr: float, **kw):
        super().__init__(params, lr, **kw)
        for p in self.params:
            dev = p.device
            if p.dim() >= 2:
                self.moments[id(p)] = (torch.zeros(p.shape[:-1], device=dev),
                                       torch.zeros((*p.shape[:-2], p.shape[-1]), device=dev))
            else:
                self.moments[id(p)] = (torch.zeros(p.shape, device=dev),)


def on_device_trainer(base):
    """`base` (LomoDPOTrainer) whose reference calls (a plain model the trainer does not train) run on
    the trainer's device: the model moved there, each batch moved, the log-probs handed back on the
    CPU where the check compares them with the recorded batches'."""

    class OnDevice(base):
        def _reference(self, model, inputs):
            # The trained model and the precompute's engine are ZeRO-3's (partitioned: ds_id), and
            # their results are gathered over the ranks on the device: only the check's plain copy moves.
            if model is self.model or model is self.model_wrapped or any(hasattr(p, "ds_id")
                                                                         for p in model.parameters()):
                return False, inputs
            device = self.accelerator.device
            model.to(device)
            return True, {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}

        def compute_ref_log_probs(self, model, inputs):
            foreign, inputs = self._reference(model, inputs)
            out = super().compute_ref_log_probs(model, inputs)
            return tuple(t.cpu() for t in out) if foreign else out

        def _compute_loss(self, model, inputs, return_outputs):
            _, inputs = self._reference(model, inputs)
            return super()._compute_loss(model, inputs, return_outputs)

    return OnDevice


def host_diff(a: dict | None, b: dict | None) -> float | None:
    """tests/integrations/dist_hf_checks.diff of weights that may be on two devices (the trained ones on the CPU)."""
    if a is None or b is None:
        return None
    return max((a[k].cpu() - b[k].cpu()).abs().max().item() for k in a)


@contextlib.contextmanager
def dpo_reference_on_device():
    from lomo_ds.integrations import dpo

    saved = dpo.LomoDPOTrainer, D.ReferenceAdaLomo, D.diff
    dpo.LomoDPOTrainer, D.ReferenceAdaLomo, D.diff = on_device_trainer(saved[0]), DeviceAdaLomo, host_diff
    try:
        yield
    finally:
        dpo.LomoDPOTrainer, D.ReferenceAdaLomo, D.diff = saved


def clip_for_this_world() -> None:
    """The CPU suite's clipping thresholds are set for 1 and 2 ranks (where they clip some steps and
    not others); on more GPUs the 2-rank one stands in: the comparison holds with any threshold."""
    world = torch.distributed.get_world_size()
    H.CLIP.setdefault(world, H.CLIP[2])
    D.CLIP.setdefault(world, D.CLIP[2])


def trainer_on_gpus(optim: str) -> dict:
    """tests/integrations/dist_hf_checks.check_equivalence on this launch's world (its reference on the CPU)."""
    clip_for_this_world()
    return H.check_equivalence(optim)


def dpo_on_device(optim: str) -> dict:
    """tests/integrations/dist_dpo_checks.check_equivalence with its reference on the trainer's device."""
    clip_for_this_world()
    with dpo_reference_on_device():
        return D.check_equivalence(optim)


BF16_TRAINER = dict(optim="adalomo", bf16=True, gradient_accumulation_steps=4, learning_rate=0.05,
                    lr_scheduler_type="constant", warmup_steps=0, max_steps=3)


def trainer_bf16_adalomo(use_cpu: bool) -> dict:
    """TrainingArguments(optim="adalomo", bf16=True, gradient_accumulation_steps=4) (as a user's run
    sets it; HF's default norm clipping at 1.0), bf16 shards without masters (stochastic
    rounding, as shipped) against the same run with lomo.fp32_master_weights. Both start from the
    same bf16 weights and read the same gradients at the first step; after it the run without
    masters may drift from the other by one ulp a step (its rounding), so the figure is the largest
    difference of the final weights in bf16 ulps (precision_checks.bf16_ulps), and the master run's
    movement in the same unit, to compare it with. `use_cpu`: transformers' bf16 on CPU ranks."""
    world = torch.distributed.get_world_size()
    data = H.Samples(BF16_TRAINER["max_steps"] * BF16_TRAINER["gradient_accumulation_steps"] * world * H.BATCH)
    runs = {}
    for name, lomo in (("no_master", {}), ("fp32_master", {"fp32_master_weights": True})):
        with H.trainer_session():
            args = H.training_args(H._out(f"bf16_{name}"), deepspeed=H.ds_config(**lomo), use_cpu=use_cpu,
                                   **BF16_TRAINER)
            trainer = H.lomo_trainer_class()(model=tiny_llama(4), args=args, train_dataset=data)
            trainer.train()
            runs[name] = H.full_params(trainer)
            runs[f"{name}_losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if runs["no_master"] is None:
        return None
    start = {n: p.detach().to(torch.bfloat16) for n, p in tiny_llama(4).named_parameters()}
    a, b = runs["no_master"], runs["fp32_master"]
    return {"ulps": max(bf16_ulps(a[n], b[n]).max().item() for n in a),
            "moved_ulps": torch.cat([bf16_ulps(b[n], start[n]).reshape(-1) for n in b]).median().item(),
            "max_abs_diff": max((a[n].float() - b[n].float()).abs().max().item() for n in a),
            "steps": BF16_TRAINER["max_steps"], "dtype": str(next(iter(a.values())).dtype),
            "losses": runs["no_master_losses"], "master_losses": runs["fp32_master_losses"]}
