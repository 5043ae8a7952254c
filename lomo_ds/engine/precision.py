"""Loss scaling and rounding: what keeps fp16/bf16 LOMO updates from overflowing or vanishing."""
from dataclasses import dataclass

import torch


@dataclass
class DynamicLossScaler:
    """fp16 dynamic loss scale.

    Halves on an overflow (never below `min_scale`) and doubles after `window` clean steps in a
    row. Unlike the public LOMO code it grows back, so one early overflow does not leave the run
    with a needlessly small scale for ever.
    """

    scale: float = 2.0**16
    window: int = 1000
    min_scale: float = 1.0
    growth_factor: float = 2.0
    clean_steps: int = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.min_scale, self.scale / self.growth_factor)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.window:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])


def stochastic_round_to_bf16(value: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Round an fp32 tensor to bf16, up or down with probability proportional to the distance.

    bf16 keeps the top 16 bits of an fp32 word. Adding a uniform random integer in [0, 2^16) to
    the bit pattern and truncating rounds up exactly with probability (dropped bits)/2^16, so
    the rounded value is unbiased: E[round(x)] = x. Updates far below half a bf16 ulp then still
    move the weight on average instead of being lost every step.
    """
    bits = value.float().contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device, generator=generator)
    finite = torch.isfinite(value)
    rounded = torch.where(finite, (bits + noise) & ~0xFFFF, bits)  # leave inf/nan bit patterns alone
    return rounded.view(torch.float32).to(torch.bfloat16)
