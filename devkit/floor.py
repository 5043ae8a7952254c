"""The floor of a ZeRO-3 step: what no optimizer fused into the backward can beat. The step-time
benchmarks (benchmarks/bench_step.py, bench_fsdp.py) and the GPU suite's timing checks measure LOMO
against it; the parameter all-gather tests check it takes the same route as LOMO's engines."""
from __future__ import annotations


class FloorEngine:
    """ZeRO-3 forward + backward of the model with each gradient dropped the moment it is ready: no
    reduction, no update. No optimizer fused into the backward can step faster."""

    def __init__(self, model, ds_config: dict, param_gather: str = "auto"):
        import deepspeed

        from lomo_ds.comm import configure_param_gather
        from lomo_ds.config import leaf_module
        from lomo_ds.runtime import ds_compat
        from lomo_ds.runtime.device import accelerator_device

        # The parameter fetch LOMO's engines get by default (comm.param_gather): a fair floor.
        self.param_gather = configure_param_gather(param_gather)
        self.ds_engine, *_ = deepspeed.initialize(model=model, config=leaf_module.resolve(ds_config, model),
                                                  model_parameters=None, optimizer=None)
        self.module = self.ds_engine.module
        self.offload = ds_compat.offload_of(self.ds_engine)
        self.device = accelerator_device()
        self._hooks = [p.register_post_accumulate_grad_hook(self._discard) for p in self.module.parameters()]
        self._spans = None  # the last step's forward and backward (a two-pass step pays one more backward)

    @staticmethod
    def _discard(param) -> None:
        param.grad = None

    def train_step(self, batch: dict) -> dict:
        from lomo_ds.profiling import StepTimers
        from lomo_ds.runtime import ds_compat
        from lomo_ds.runtime.dist import loss_of

        self.module.train()
        # On an accelerator the spans are events on the stream, read after the step (no host sync
        # inside it); a fresh set per step keeps the last step's alone.
        self._spans = StepTimers(enabled=True, device=self.device)
        with self._spans.span("forward"):
            loss = loss_of(self.module(**batch))
        with self._spans.span("backward"):
            loss.backward()
        ds_compat.release_all(self.offload)
        return {}

    def last_step_seconds(self) -> dict[str, float]:
        """The last step's forward and backward, in seconds (on an accelerator: waits for them)."""
        return self._spans.take() if self._spans is not None else {}
