"""A single-process AdaLomo written from the paper (arXiv 2310.10195, Algorithm 1), for tests.

Deliberately the paper's form, not lomo_ds's: row and column *sums* of g^2 + eps1 and
v = r c^T / (1^T r), on whole gradients after an ordinary backward. The choices the paper leaves
open follow lomo_ds/engine/update/adalomo.py's docstring: beta_t = 1 - t^decay_rate, weight decay by the
relative step, tensors of 3 or more dimensions (MoE experts stacked [E, R, C]) factored as a stack of
R x C matrices: row sums [E, R], column sums [E, C], each matrix divided by its own 1^T r.
"""
from __future__ import annotations

import torch


def rms(t: torch.Tensor) -> float:
    return (t.norm() / t.numel() ** 0.5).item()


class ReferenceAdaLomo:
    def __init__(self, params, lr: float, clip_threshold: float = 1.0, eps1: float = 1e-30, eps2: float = 1e-3,
                 decay_rate: float = -0.8, weight_decay: float = 0.0):
        self.params = list(params)
        self.lr, self.d, self.eps1, self.eps2 = lr, clip_threshold, eps1, eps2
        self.decay_rate, self.weight_decay = decay_rate, weight_decay
        self.t = 0
        self.moments: dict[int, tuple[torch.Tensor, ...]] = {}

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        beta = 1.0 - self.t ** self.decay_rate
        for p in self.params:
            if p.grad is None:
                continue
            g = p.grad.float()
            sq = g * g + self.eps1
            if p.dim() >= 2:
                r, c = self.moments.get(id(p), (torch.zeros(p.shape[:-1]), torch.zeros((*p.shape[:-2], p.shape[-1]))))
                r = beta * r + (1 - beta) * sq.sum(dim=-1)  # (g^2 + eps1) 1_m, per matrix
                c = beta * c + (1 - beta) * sq.sum(dim=-2)  # 1_n^T (g^2 + eps1), per matrix
                self.moments[id(p)] = (r, c)
                v = r.unsqueeze(-1) * c.unsqueeze(-2) / r.sum(dim=-1)[..., None, None]
            else:
                (v,) = self.moments.get(id(p), (torch.zeros_like(g),))
                v = beta * v + (1 - beta) * sq
                self.moments[id(p)] = (v,)
            u = g / v.sqrt()
            u = u / max(1.0, rms(u) / self.d)
            step = self.lr * max(self.eps2, rms(p.float()))
            p.mul_(1 - step * self.weight_decay).sub_(step * u)

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for m in self.moments.values() for t in m)
