"""AdaLomo (arXiv 2310.10195) on ZeRO-3 shards: `lomo.optimizer: "adalomo"`.

The rule, per parameter θ with gradient g at its t-th update (t counts the updates applied):

    beta_t = 1 - t^decay_rate                                  (decay_rate -0.8: beta_1 = 0)
    matrix (2-D, R x C):  r = beta r + (1-beta) rowmean(g^2 + eps1)      [R]
                          c = beta c + (1-beta) colmean(g^2 + eps1)      [C]
                          v = outer(r, c) / mean(r)            (Adafactor's factorisation)
    anything else:        v = beta v + (1-beta) (g^2 + eps1)   (the full second moment)
    u = g / sqrt(v);  u = u / max(1, RMS(u) / clip_threshold)
    step = lr * max(eps2, RMS(θ))
    θ = θ * (1 - step * weight_decay) - step * u

On ZeRO-3 each rank holds a flat slice of θ that may start and end mid-row, and receives the
summed gradient of just that slice from the reduce-scatter. Per reduced bucket the rule makes at
most two small all-reduces (none on one rank), each carrying every parameter of the bucket:
  1. this rank's partial row and column sums of g^2 (R + C floats per matrix) and its partial
     sum of θ^2 (one float per parameter): every rank then holds the same full r and c;
  2. its partial sum of u^2 (one float per parameter), for RMS(u).
The row and column vectors are replicated on every rank (R + C fp32 per matrix); the full
second moment of a vector parameter is kept for this rank's slice only. No gradient beyond the
bucket and no whole parameter ever exist on a rank.

Where the paper, the public `lomo-optim` code and this module differ, and which one it follows:
- Rows/columns: the paper accumulates row and column *sums* of g^2 + eps1 and divides
  outer(r, c) by sum(r); the code keeps *means* and divides by mean(r). The two give the same v
  (the factors R and C cancel). We keep means, as the code (Adafactor's convention).
- beta: Adafactor's schedule 1 - t^decay_rate, as the code. Its `step_num == 0` branch is never
  reached (the counter is raised before the first backward); here t starts at 1 as well, so
  beta_1 = 0 and v starts at g^2 + eps1.
- Weight decay: not in the paper. The code decays by the relative step, θ *= 1 - lr *
  max(eps2, RMS(θ)) * weight_decay (as Adafactor does); we follow the code.
- Tensors of 3 or more dimensions: the code factors them over the last two dimensions, the paper
  only treats matrices and vectors. We factor 2-D tensors only and keep the full second moment for
  the others (a LLaMA has only 1-D and 2-D parameters).
- Clipping order: the code clamps values first and then applies the norm-clipping coefficient;
  we apply the coefficient first and then clamp, as torch's clip_grad_norm_ + clip_grad_value_
  (and this project's LOMO update) do. With only one kind of clipping they agree.
- Loss scale: the code multiplies every loss by a fixed 2^10 and divides the gradients back
  (a power of two: exact in fp32); here it is the engine's dynamic loss scale, unscaled first.
- ZeRO-3: the code all-reduces each full gradient (twice the bytes of the reduce-scatter) and
  needs the whole gradient on every rank; here the statistics are reduced from the slices.
- t: the code counts backward calls; here each parameter counts the updates applied to it, so a
  skipped step (fp16 overflow) does not advance beta.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from lomo_ds.config.lomo import AdaLomoConfig
from lomo_ds.engine.fused_update import ShardGeometry
from lomo_ds.runtime import ds_compat
from lomo_ds.runtime.device import group_device


def row_pieces(start: int, n: int, cols: int) -> list[tuple[int, int, int, int, int]]:
    """Split the flat slice [start, start + n) of a row-major matrix with `cols` columns into at
    most three rectangles: a partial first row, whole rows, a partial last row.
    Each piece is (offset in the slice, first row, first column, rows, width)."""
    pieces, pos = [], 0
    while pos < n:
        row, col = divmod(start + pos, cols)
        if col == 0 and n - pos >= cols:
            rows, width = (n - pos) // cols, cols
        else:
            rows, width = 1, min(cols - col, n - pos)
        pieces.append((pos, row, col, rows, width))
        pos += rows * width
    return pieces


def is_factored(shape: torch.Size) -> bool:
    return len(shape) == 2


class _Slice(NamedTuple):
    """One parameter of a reduced bucket, as this rank sees it."""

    param: torch.nn.Parameter
    geo: ShardGeometry
    shape: torch.Size
    pieces: list | None  # row_pieces of a matrix slice; None for a parameter with a full second moment
    g: torch.Tensor  # the real gradient elements (fp32, ours to overwrite: becomes u)
    weights: torch.Tensor  # fp32 weights to update (the master, or the shard or a copy of it)


def _ema_where(state: torch.Tensor, new: torch.Tensor, beta: torch.Tensor, keep: torch.Tensor) -> None:
    """state = beta state + (1 - beta) new where `keep`, else left as it was (`new` may be NaN)."""
    state.copy_(torch.where(keep, state * beta + new * (1.0 - beta), state))


class AdaLomo:
    """AdaLomo's second-moment state and update for this rank's shards; ShardUpdater calls
    `apply_bucket` with each reduced bucket of the update pass."""

    def __init__(self, cfg: AdaLomoConfig, module: torch.nn.Module, params: list, group, geometry):
        """`geometry(param)`: this rank's ShardGeometry of a parameter (the updater's, per group);
        `group`: where the bucket statistics are reduced (every parameter's shard group spans it)."""
        self.cfg = cfg
        self.group, self.geometry = group, geometry
        self.world = torch.distributed.get_world_size(group) if torch.distributed.is_initialized() else 1
        names = {id(p): n for n, p in module.named_parameters()}
        self.names = {ds_compat.param_id(p): names[id(p)] for p in params}
        # ds_id -> {"step": updates applied, "row", "col"} (matrices, replicated) or {"step", "sq"}
        # (this rank's slice), on the shard's device: fp32 moments, an fp64 step count (a device
        # tensor, so that a skipped bucket leaves it where it was without a host sync).
        self.state: dict[int, dict[str, Any]] = {}
        for p in params:
            shape, device = ds_compat.full_shape(p), ds_compat.shard(p).device
            if is_factored(shape):
                moments = {"row": torch.zeros(shape[0], dtype=torch.float32, device=device),
                           "col": torch.zeros(shape[1], dtype=torch.float32, device=device)}
            else:
                moments = {"sq": torch.zeros(geometry(p).local, dtype=torch.float32, device=device)}
            self.state[ds_compat.param_id(p)] = {"step": torch.zeros((), dtype=torch.float64, device=device),
                                                 **moments}

    # ----------------------------------------------------------------- the update
    def apply_bucket(self, updater, items: list[tuple[torch.nn.Parameter, torch.Tensor]],
                     finite: torch.Tensor) -> None:
        """Update every parameter of a reduced bucket, unless `finite` (a device flag: every bucket
        of the pass so far was finite) or the bucket's reduced statistics say otherwise. Decided
        on the device: nothing here reads a number back to the host."""
        cfg = self.cfg
        slices = []
        for param, grad_shard in items:
            geo = self.geometry(param)
            shape = ds_compat.full_shape(param)
            slices.append(_Slice(param, geo, shape,
                                 row_pieces(geo.start, geo.local, shape[1]) if is_factored(shape) else None,
                                 updater.unscale_and_clip(updater.real_grad(param, grad_shard)),
                                 updater.weights(param)))

        # 1. Partial row/column sums of g^2 and partial sums of θ^2 for the whole bucket in one
        #    buffer on the group's device: [rows, cols] of each matrix, then one θ^2 per parameter.
        #    Each slice's sums are taken where its shard lives (they need not all be on one device).
        device = group_device(self.group) if torch.distributed.is_initialized() else slices[0].g.device
        width = sum(s.shape[0] + s.shape[1] for s in slices if s.pieces is not None)
        sums = torch.zeros(width + len(slices), dtype=torch.float32, device=device)
        at = 0
        for i, s in enumerate(slices):
            if s.pieces is not None:
                cols_at = at + s.shape[0]
                for pos, row, col, rows, w in s.pieces:
                    block = s.g[pos:pos + rows * w].view(rows, w)
                    sums[at + row:at + row + rows] += torch.linalg.vector_norm(block, dim=1).square_().to(device)
                    sums[cols_at + col:cols_at + col + w] += torch.linalg.vector_norm(block, dim=0).square_().to(device)
                at += s.shape[0] + s.shape[1]
            sums[width + i] = torch.linalg.vector_norm(s.weights).square().to(device)
        self._all_reduce(sums)
        # Every rank's g^2 is in the reduced sums: a non-finite slice anywhere makes them
        # non-finite on every rank, so every rank keeps or drops this bucket alike.
        keep = finite.to(device) & torch.isfinite(sums).all()

        # 2. Second moments, then u = g / sqrt(v) in place of g, and partial sums of u^2.
        u_sq = torch.zeros(len(slices), dtype=torch.float32, device=device)
        at = 0
        for i, s in enumerate(slices):
            state = self.state[ds_compat.param_id(s.param)]
            here = keep.to(state["step"].device)
            state["step"].add_(here.double())
            beta = 1.0 - state["step"].clamp(min=1.0).pow(cfg.decay_rate)  # fp64, as a Python float was
            if s.pieces is not None:
                rows, cols = s.shape
                row_mean = sums[at:at + rows].div(cols).add_(cfg.eps1).to(state["row"].device)
                col_mean = sums[at + rows:at + rows + cols].div(rows).add_(cfg.eps1).to(state["col"].device)
                at += rows + cols
                _ema_where(state["row"], row_mean, beta, here)
                _ema_where(state["col"], col_mean, beta, here)
                row_factor = (state["row"] / state["row"].mean()).rsqrt_()
                col_factor = state["col"].rsqrt()
                for pos, row, col, n_rows, w in s.pieces:
                    block = s.g[pos:pos + n_rows * w].view(n_rows, w)
                    block.mul_(row_factor[row:row + n_rows, None]).mul_(col_factor[col:col + w])
            else:
                _ema_where(state["sq"], s.g.square().add_(cfg.eps1), beta, here)
                s.g.mul_(state["sq"].rsqrt())
            u_sq[i] = torch.linalg.vector_norm(s.g).square().to(device)
        self._all_reduce(u_sq)
        keep &= torch.isfinite(u_sq).all()

        # 3. θ -= lr * max(eps2, RMS(θ)) * u / max(1, RMS(u) / clip_threshold), every coefficient
        #    a device tensor; a dropped bucket gets coefficient 0 and a zeroed u.
        numels = torch.tensor([float(max(s.geo.numel, 1)) for s in slices], dtype=torch.float32, device="cpu")
        numels = numels.to(device, non_blocking=True)
        step = sums[width:].div(numels).sqrt_().clamp_(min=cfg.eps2).mul_(updater.rule.lr)
        clip = u_sq.div(numels).sqrt_().div_(cfg.clip_threshold).clamp_(min=1.0)
        coef = torch.where(keep, step / clip, 0.0)
        decay = torch.where(keep, 1.0 - step * updater.rule.weight_decay, 1.0)
        for i, s in enumerate(slices):
            if s.geo.local == 0:
                continue
            here = keep.to(s.g.device)
            s.g.masked_fill_(~here, 0.0)
            if updater.rule.weight_decay:
                s.weights.mul_(decay[i].to(s.weights.device))
            s.weights.sub_(s.g.mul_(coef[i].to(s.g.device)))
            updater.write_back(s.param, s.weights)

    def _all_reduce(self, t: torch.Tensor) -> None:
        if self.world > 1:
            ds_compat.all_reduce(t, group=self.group, name="AdaLomo bucket statistics")

    # ----------------------------------------------------------------- state
    def state_bytes(self) -> int:
        """Bytes this rank holds: the replicated row/column vectors and its slices of the rest."""
        return sum(t.numel() * t.element_size() for s in self.state.values() for t in s.values()
                   if torch.is_tensor(t))

    def state_dict(self) -> dict[str, dict[str, Any]]:
        return {self.names[i]: {k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in s.items()}
                for i, s in self.state.items()}

    def load_state_dict(self, state: dict[str, dict[str, Any]]) -> None:
        by_name = {name: i for i, name in self.names.items()}
        if set(state) != set(by_name):
            missing, extra = sorted(set(by_name) - set(state)), sorted(set(state) - set(by_name))
            raise ValueError(f"AdaLomo state does not match the model: missing {missing[:3]}, unexpected {extra[:3]}")
        for name, saved in state.items():
            mine = self.state[by_name[name]]
            for key, value in saved.items():
                if torch.is_tensor(value):
                    if value.shape != mine[key].shape:
                        raise ValueError(f"AdaLomo state {name}.{key}: shape {tuple(value.shape)}, "
                                         f"expected {tuple(mine[key].shape)}")
                    mine[key].copy_(value)
                elif torch.is_tensor(mine[key]):  # a step count saved as a number
                    mine[key].fill_(value)
                else:
                    mine[key] = value
