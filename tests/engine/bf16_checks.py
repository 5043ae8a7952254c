"""bf16 shards without fp32 masters (the shipped default) against a single-process reference on the
same bf16 weights; tests/engine/test_bf16_updates.py declares the checks and asserts on them.

The reference keeps the model in bf16, as the engine does: each micro-batch's forward and backward
run in bf16, the window's gradients are summed in fp32, the update (torch.optim.SGD or the reference
AdaLomo) is computed in fp32 from the bf16 weights, and the result is rounded to the nearest bf16 (the
engine's write-back with `stochastic_rounding: false`). So the engine may differ from it only by the
order its fp32 sums are taken in and by where those sums are rounded (a bf16 reduce or
accumulator): a bf16 ulp, where the rounding of a result falls on the other side of a tie. A
gradient read after it was overwritten moves a weight by whole steps, hundreds of ulps.
"""
from __future__ import annotations

import copy

import torch

import lomo_ds
from lomo_ds.config.engine_sections import MemoryConfig
from lomo_ds.engine.chunked_loss import causal_lm_loss, head_of
from tests.adalomo_reference import ReferenceAdaLomo
from tests.engine.dist_engine_checks import ds_cfg
from tests.tiny import global_batch, tiny_llama

STEPS = 2
LR = {"sgd": 0.05, "adalomo": 0.01}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def ulps(a: torch.Tensor, b: torch.Tensor, *scale: torch.Tensor) -> torch.Tensor:
    """|a - b| in bf16 ulps (bf16 keeps 8 significant bits) of the largest magnitude of a, b and
    `scale`: the weights before the step, where a result that nearly cancels to 0 was computed from."""
    big = torch.maximum(a.abs(), b.abs())
    for t in scale:
        big = torch.maximum(big, t.abs())
    big = big.clamp(min=torch.finfo(torch.bfloat16).tiny)
    return (a - b).abs() / torch.exp2(torch.floor(torch.log2(big)) - 7)


def window_of(step: int, world: int, k: int) -> list[list[dict]]:
    """Step `step`'s window: k global micro-batches, one micro-batch per rank in each."""
    return [global_batch(step * 8 + i, world) for i in range(k)]


def bf16_cfg(optimizer: str, k: int, reduce_dtype: str, accumulate_dtype: str = "fp32", **lomo) -> dict:
    # The collective reduce-scatter (the GPU's route) unless the check names another.
    lomo.setdefault("grad_reduction", "reduce_scatter")
    cfg = ds_cfg(optimizer=optimizer, accumulation_steps=k, reduce_dtype=reduce_dtype,
                 accumulate_dtype=accumulate_dtype, stochastic_rounding=False, **lomo)
    cfg["lomo"]["lr"] = LR[optimizer]
    cfg["bf16"] = {"enabled": True}
    return cfg


class Bf16Reference:
    """The update of a bf16 model from the sums of its bf16 micro-batch gradients, rounded back.

    The sums are taken as the engine takes them: over the ranks of each micro-batch in the reduce's
    dtype (rank order), then over the window's micro-batches in the accumulator's dtype, the last
    micro-batch added in fp32 (accumulation.py). So only the order of a sum over 3 ranks and the
    rounding of a result that falls near a tie remain between the two."""

    def __init__(self, model: torch.nn.Module, optimizer: str, reduce_dtype: str, accumulate_dtype: str,
                 clip_norm=None, clip_value=None, wd=0.0):
        self.model = model
        self.head = head_of(model, "on")
        self.params = list(model.parameters())
        self.shadow = [torch.nn.Parameter(p.detach().float()) for p in self.params]
        lr = LR[optimizer]
        self.opt = (ReferenceAdaLomo(self.shadow, lr, weight_decay=wd) if optimizer == "adalomo"
                    else torch.optim.SGD(self.shadow, lr=lr, weight_decay=wd))
        self.reduce_dtype, self.accumulate_dtype = DTYPES[reduce_dtype], DTYPES[accumulate_dtype]
        self.clip_norm, self.clip_value = clip_norm, clip_value

    def grads(self, mb: dict) -> list[torch.Tensor]:
        """One micro-batch's bf16 gradient, through the loss the engine takes (its chunked loss):
        a gradient of transformers' own loss differs from it by bf16 roundings of the head's
        backward, and a bf16 reduce or accumulator can carry one of those into an ulp of a weight."""
        self.model.zero_grad()
        causal_lm_loss(self.model, self.head, mb, MemoryConfig().loss_chunk_logits).loss.backward()
        return [p.grad.detach().clone() for p in self.params]

    def step(self, window: list[list[dict]]) -> list[dict[str, torch.Tensor]]:
        """One step from the model's weights, for each rank a sum over the ranks may start from
        (a ring reduction sums each slice in cyclic order from some rank; on 3 ranks in bf16 the
        order moves a rounding): the resulting weights of each, the model left at the first's."""
        grads = [[self.grads(mb) for mb in mbs] for mbs in window]  # [micro-batch][rank][param]
        world = len(window[0])
        self.before = {name: p.detach().float().clone() for name, p in self.model.named_parameters()}
        state = self._state()
        results = []
        for first in reversed(range(world if self.reduce_dtype != torch.float32 else 1)):
            self._restore(state)
            sums = [self.window_sum([[per_rank[r][j] for r in range(world)] for per_rank in grads], first)
                    for j in range(len(self.params))]
            self.update(sums, len(window) * world)
            results.append({name: p.detach().float().clone() for name, p in self.model.named_parameters()})
        return results

    def window_sum(self, grads, first: int) -> torch.Tensor:
        """One parameter's window sum: `grads[i][r]` is micro-batch i's bf16 gradient on rank r."""
        buf = torch.zeros_like(grads[0][0], dtype=self.accumulate_dtype)
        for i, per_rank in enumerate(grads):
            world = len(per_rank)
            reduced = per_rank[first % world].to(self.reduce_dtype)
            for r in range(first + 1, first + world):
                reduced = (reduced.float() + per_rank[r % world].float()).to(self.reduce_dtype)
            if i == len(grads) - 1:
                return buf.float() + reduced.float()  # the last micro-batch is added in fp32
            buf = (buf.float() + reduced.float()).to(buf.dtype)  # one rounding, as buf.add_(slice)

    def update(self, sums: list[torch.Tensor], n: int) -> None:
        for s, p, total in zip(self.shadow, self.params, sums, strict=True):
            s.data.copy_(self.before_of(p))  # the update starts from the stored bf16 weights
            s.grad = total / n
        if self.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.shadow, self.clip_norm)
        if self.clip_value is not None:
            torch.nn.utils.clip_grad_value_(self.shadow, self.clip_value)
        self.opt.step()
        with torch.no_grad():
            for p, s in zip(self.params, self.shadow, strict=True):
                p.copy_(s)  # round to nearest, as the engine's write-back without stochastic rounding

    def before_of(self, p: torch.nn.Parameter) -> torch.Tensor:
        return self._before_by_id[id(p)]

    def _state(self):
        self._before_by_id = {id(p): p.detach().float().clone() for p in self.params}
        return getattr(self.opt, "t", None), dict(getattr(self.opt, "moments", {}))

    def _restore(self, state) -> None:
        if isinstance(self.opt, ReferenceAdaLomo):  # its moments are replaced each step, never written
            self.opt.t, self.opt.moments = state[0], dict(state[1])

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(weights[name])


def against_reference(optimizer: str, k: int, reduce_dtype: str, accumulate_dtype: str = "fp32",
                      clip_norm=None, clip_value=None, wd=0.0, offload=False, **lomo) -> dict:
    """The engine's bf16 run against Bf16Reference, step by step: each step of the reference starts
    from the engine's weights, so the figure is one step's difference, not the drift of a run. The
    largest difference in ulps, and how far a step moved the weights (a comparison of weights that
    never moved would prove nothing)."""
    model = tiny_llama(11).to(torch.bfloat16)
    ref = Bf16Reference(copy.deepcopy(model), optimizer, reduce_dtype, accumulate_dtype, clip_norm, clip_value, wd)
    if clip_norm is not None:
        lomo["clip_grad_norm"] = clip_norm
    if clip_value is not None:
        lomo["clip_grad_value"] = clip_value
    cfg = bf16_cfg(optimizer, k, reduce_dtype, accumulate_dtype, weight_decay=wd, **lomo)
    if offload:
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    engine = lomo_ds.initialize(model, cfg)
    worst = abs_diff = moved = 0.0
    for step in range(STEPS):
        window = window_of(step, engine.world, k)
        for mbs in window:
            out = engine.train_step(mbs[engine.rank])
        assert out["stepped"], "the window's last micro-batch must step"
        full = engine.full_state_dict()
        if engine.rank != 0:
            continue
        results = ref.step(window)
        for name in full:
            mine, before = full[name].float(), ref.before[name]
            # Each element against the closest of the orders a ring may have summed it in.
            off = torch.stack([ulps(mine, r[name], before) for r in results]).min(dim=0).values
            worst = max(worst, off.max().item())
            abs_diff = max(abs_diff, min((mine - r[name]).abs().max().item() for r in results))
            moved = max(moved, ulps(results[0][name], before).max().item())
        ref.load(full)
    if engine.rank != 0:
        return {}
    return {"max_ulps": worst, "max_abs_diff": abs_diff, "moved_ulps": moved,
            "dtype": str(next(iter(full.values())).dtype)}
