"""AdaLomo (arXiv 2310.10195) on ZeRO-3 shards: `lomo.optimizer: "adalomo"`.

The rule, per parameter θ with gradient g at its t-th update (t counts the updates applied):

    beta_t = 1 - t^decay_rate                                  (decay_rate -0.8: beta_1 = 0)
    matrix (2-D, R x C):  r = beta r + (1-beta) rowmean(g^2 + eps1)      [R]
                          c = beta c + (1-beta) colmean(g^2 + eps1)      [C]
                          v = outer(r, c) / mean(r)            (Adafactor's factorisation)
    stacked (E x .. x R x C, e.g. a MoE layer's experts): each R x C matrix factored alike,
                          r [E.., R], c [E.., C], mean(r) per matrix
    vector:               v = beta v + (1-beta) (g^2 + eps1)   (the full second moment)
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

A bucket goes through three phases (AdaLomo.apply_bucket), the arithmetic of each in
adalomo_math.py:
  statistics       the row and column sums of g^2 and the sums of θ^2, then all-reduce 1;
  second moments   the moving averages of r and c (or v), u = g / sqrt(v), the sums of u^2, then
                   all-reduce 2;
  apply            each parameter's coefficients, and the update written to the weights (or, for
                   a shard in host memory, handed to the host-update worker: below).

Chunks (memory.update_chunk_elements, shard.py): a slice whose gradient and weights are both
fp32 in place is updated whole, as described, with no temporary. Any other (bf16 weights or
gradient, an accumulator in another dtype) never has an fp32 copy of the whole slice: each of the
three phases reads the gradient chunk by chunk (whole rows of a matrix in one chunk), the first
summing rows, columns and θ^2, the second recomputing u per chunk for the sum of u^2 (and the
vectors' second moments), the third recomputing u per chunk to update the weights chunk by chunk.
Each read is a fresh copy (grad_chunk's `fresh`): a phase writes what it read, and the next one
reads the slice again.

Where the paper, the public `lomo-optim` code and this module differ, and which one it follows:
- Rows/columns: the paper accumulates row and column *sums* of g^2 + eps1 and divides
  outer(r, c) by sum(r); the code keeps *means* and divides by mean(r). The two give the same v
  (the factors R and C cancel). We keep means, as the code (Adafactor's convention).
- beta: Adafactor's schedule 1 - t^decay_rate, as the code. Its `step_num == 0` branch is never
  reached (the counter is raised before the first backward); here t starts at 1 as well, so
  beta_1 = 0 and v starts at g^2 + eps1.
- Weight decay: not in the paper. The code decays by the relative step, θ *= 1 - lr *
  max(eps2, RMS(θ)) * weight_decay (as Adafactor does); we follow the code.
- Tensors of 3 or more dimensions (transformers' MoE experts, stacked into one [E, R, C] tensor):
  the paper only treats matrices and vectors; the code's factorisation (Adafactor's) works over
  the last two dimensions, with mean(r) per matrix. We factor them so: their state is E (R + C)
  floats, not the E R C of a full second moment (twice the bf16 weights).
- Clipping order: the code clamps values first and then applies the norm-clipping coefficient;
  we apply the coefficient first and then clamp, as torch's clip_grad_norm_ + clip_grad_value_
  (and this project's LOMO update) do. With only one kind of clipping they agree.
- Loss scale: the code multiplies every loss by a fixed 2^10 and divides the gradients back
  (a power of two: exact in fp32); here it is the engine's dynamic loss scale, unscaled first.
- ZeRO-3: the code all-reduces each full gradient (twice the bytes of the reduce-scatter) and
  needs the whole gradient on every rank; here the statistics are reduced from the slices.
- t: the code counts backward calls; here each parameter counts the updates applied to it, so a
  skipped step (fp16 overflow) does not advance beta.

Shards in host memory (`offload_param: cpu`) with the host-update worker (host_updates.py): the
worker must issue no collective, and the hook must not wait for the host. So the update of such a
shard is split in two:
  device  in the hook, on the rank's device, where the reduced slice already is: the row/column
          sums of g^2, both all-reduces, the second moments (their state lives on that device,
          not beside the shard), u, and each parameter's coefficients (the relative step over the
          clipping factor, and the decay). u and the two coefficients go into one buffer per
          bucket, staged for the worker without blocking (HostUpdates.submit).
  host    on the worker, in bucket order: θ = θ * decay - coef * u, written back into the shard
          (stochastic rounding or the master, as ShardWeights.write_back does inline).
θ itself is in host memory, and RMS(θ) is needed in the hook: reading it there would make the
hook do a pass over the host shard. Instead the worker, right after it updates a slice, takes its
sum of squares (the slice is still in cache) into a per-parameter table in host memory (pinned on
an accelerator); the hook copies this bucket's entries to the device without blocking. The entry
of a parameter is the value its next update needs: the engine joins the worker at the end of
every pass, so every entry the next pass reads is finished, and the worker only writes the entry
of a parameter whose bucket the hook has already handed over (its next read is a pass later).
An entry is unknown until that parameter's first update, and again after its shard is written by
anything else (a checkpoint load: AdaLomo.load_state_dict forgets them): the hook then takes it
from the host weights itself, once.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import torch

from lomo_ds.config.engine_config import AdaLomoConfig
from lomo_ds.engine import host_updates
from lomo_ds.engine.update import adalomo_math as m
from lomo_ds.engine.update.rule import (
    BuildContext,
    Cut,
    Items,
    PassSettings,
    PassStats,
    Replicated,
    StateLayout,
    unscale_and_clip,
)
from lomo_ds.engine.update.shard import ShardWeights, grad_chunk, grad_in_place
from lomo_ds.runtime import ds_compat
from lomo_ds.runtime.device import group_device
from lomo_ds.runtime.shard_geometry import ShardGeometry


class _Slice(NamedTuple):
    """One parameter of a reduced bucket, as this rank sees it."""

    param: torch.nn.Parameter
    geo: ShardGeometry
    shape: torch.Size
    pieces: list | None  # row_pieces of a matrix slice; None for a parameter with a full second moment
    g: torch.Tensor | None  # the real gradient elements (fp32, ours to overwrite); None: read chunk by chunk
    weights: torch.Tensor | None  # fp32 weights updated in place here; None: copied chunk by chunk, or
                                  # (at set) updated on the host-update worker
    u: torch.Tensor | None  # where u goes: `g` itself, or (worker) its place in the bucket's staged buffer
    at: int | None  # (worker) where its u starts in the staged buffer; None: updated here
    src: object  # the reduced slice as received (a tensor, or the accumulator's sum)

    def pieces_at(self, a: int, n: int) -> list:
        """factored_pieces of elements [a, a + n) of the slice."""
        if a == 0 and n == self.geo.local:
            return self.pieces
        return m.factored_pieces(self.geo.start + a, n, self.shape)


@dataclass
class _Bucket:
    """A reduced bucket on its way through the three phases."""

    slices: list[_Slice]
    staged: torch.Tensor | None  # the worker's slices' u, coef and decay, on the rank's device
    device: torch.device  # where the bucket's statistics are reduced
    width: int = 0  # elements of the row and column sums in `sums`, before one θ^2 per slice
    sums: torch.Tensor | None = None
    keep: torch.Tensor | None = None  # the bucket is applied (every rank agrees, on the device)
    factors: list | None = None  # each slice's (row, column) factors of 1/sqrt(v); None: a full v
    u_sq: torch.Tensor | None = None
    # The last matrix's row and column means, held until the bucket is done: the planner counts a
    # bucket's statistics as its sums, means and factors alive together (planning/estimate.py,
    # adalomo_update_temp_bytes; benchmarks/vocab_memory.py measures it).
    means: tuple | None = None


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    """An index tensor on `device`, built on the host and copied over without blocking."""
    return torch.tensor(values, dtype=torch.int64, device="cpu").to(device, non_blocking=True)


class AdaLomo:
    """AdaLomo's second-moment state and update for this rank's shards (a Rule, rule.py)."""

    name = "adalomo"
    takes_whole_bucket = True

    def __init__(self, cfg: AdaLomoConfig, module: torch.nn.Module, params: list, group, geometry,
                 host=None, device: torch.device | None = None):
        """`geometry(param)`: this rank's ShardGeometry of a parameter (the updater's, per group);
        `group`: where the bucket statistics are reduced (every parameter's shard group spans it).
        `host`: a HostUpdates whose worker updates the shards it holds (in host memory); their
        state then lives on `device` (default: the host's), where their reduced slices arrive."""
        self.cfg = cfg
        self.group, self.geometry = group, geometry
        self.world = torch.distributed.get_world_size(group) if torch.distributed.is_initialized() else 1
        self.host = host
        names = {id(p): n for n, p in module.named_parameters()}
        self.names = {ds_compat.param_id(p): names[id(p)] for p in params}
        self.numels = {ds_compat.param_id(p): ds_compat.full_numel(p) for p in params}  # state_layout's
        # ds_id -> its row in weight_sq, for the parameters whose update the worker applies.
        self.deferred: dict[int, int] = {}
        # ds_id -> {"step": updates applied, "row", "col"} (matrices, replicated) or {"step", "sq"}
        # (this rank's slice): fp32 moments, an fp64 step count (a device tensor, so that a skipped
        # bucket leaves it where it was without a host sync). Beside the shard, or, for a shard
        # the worker updates, on the rank's device: the hook computes with them there.
        self.state: dict[int, dict[str, Any]] = {}
        for p in params:
            device_of_p = ds_compat.shard(p).device
            if host is not None and host.holds(p):
                self.deferred[ds_compat.param_id(p)] = len(self.deferred)
                device_of_p = device if device is not None else host.device
            self.state[ds_compat.param_id(p)] = self._zero_state(p, device_of_p)
        # The worker's table of sum(θ^2) over each deferred parameter's slice (see the module
        # docstring), in host memory: pinned where an accelerator copies from it without blocking.
        self.pin = bool(host is not None and host.pin)
        self.weight_sq = host_updates.host_buffer(len(self.deferred), torch.float32, pin=self.pin).zero_()
        self.weight_sq_known = [False] * len(self.deferred)

    @classmethod
    def build(cls, ctx: BuildContext) -> "AdaLomo":
        """The rule as the engine builds it (ctx.options: the lomo.adalomo section)."""
        return cls(ctx.options, ctx.module, ctx.params, ctx.group, ctx.geometry, host=ctx.host, device=ctx.device)

    def _zero_state(self, p: torch.nn.Parameter, device: torch.device) -> dict[str, torch.Tensor]:
        shape = ds_compat.full_shape(p)
        if m.is_factored(shape):
            moments = {"row": torch.zeros(shape[:-1], dtype=torch.float32, device=device),
                       "col": torch.zeros((*shape[:-2], shape[-1]), dtype=torch.float32, device=device)}
        else:
            moments = {"sq": torch.zeros(self.geometry(p).local, dtype=torch.float32, device=device)}
        return {"step": torch.zeros((), dtype=torch.float64, device=device), **moments}

    def device_of(self, param: torch.nn.Parameter) -> torch.device:
        """Where the hook computes with this parameter's reduced slice (and where its state is)."""
        return self.state[ds_compat.param_id(param)]["step"].device

    def slice_device(self, param: torch.nn.Parameter) -> torch.device:
        """Beside the shard, or, for a shard in host memory whose update the host-update worker
        finishes, on the rank's device (the hook computes its statistics there)."""
        return self.device_of(param)

    def forget_weight_norms(self) -> None:
        """The shards were written outside the update (a checkpoint load): every sum(θ^2) the
        worker recorded is stale, and the hook takes each one afresh at its next update."""
        self.weight_sq_known = [False] * len(self.deferred)

    # ----------------------------------------------------------------- the update
    def apply_bucket(self, shard: ShardWeights, items: Items, stats: PassStats, settings: PassSettings) -> None:
        """Update every parameter of a reduced bucket, unless `stats.finite` (a device flag: every
        bucket of the pass so far was finite) or the bucket's reduced statistics say otherwise.
        Decided on the device: nothing here reads a number back to the host. The shards the worker
        updates (`deferred`) are handed to it at the end, their host part not yet applied: the
        caller joins the worker before it reads the pass or the shards."""
        bucket = self._bucket(shard, items, settings)
        self._statistics(shard, bucket, settings, stats.finite)
        self._second_moments(shard, bucket, settings)
        self._apply(shard, bucket, settings, stats.finite)

    def apply(self, shard, param, grad, finite, settings) -> None:
        raise TypeError("AdaLomo takes each bucket whole (takes_whole_bucket): apply_bucket")

    def _bucket(self, shard: ShardWeights, items: Items, settings: PassSettings) -> _Bucket:
        slices, staged_numel = [], 0
        for param, grad_shard in items:
            s = self._slice(shard, param, grad_shard, settings, staged_numel)
            slices.append(s)
            if s.at is not None:
                staged_numel += s.geo.local + 2
        staged = None
        if staged_numel:
            # One buffer on the rank's device for the whole bucket; the worker's slices are views of it.
            staged = torch.empty(staged_numel, dtype=torch.float32,
                                 device=next(s.g.device for s in slices if s.at is not None))
            slices = [s if s.at is None else s._replace(u=staged[s.at:s.at + s.geo.local]) for s in slices]
        # The statistics of the whole bucket go into one buffer on the group's device.
        device = group_device(self.group) if torch.distributed.is_initialized() else (
            slices[0].g.device if slices[0].g is not None else ds_compat.shard(slices[0].param).device)
        return _Bucket(slices, staged, device)

    def _slice(self, shard: ShardWeights, param: torch.nn.Parameter, grad_shard, settings: PassSettings,
               staged_at: int) -> _Slice:
        geo = self.geometry(param)
        shape = ds_compat.full_shape(param)
        pieces = m.factored_pieces(geo.start, geo.local, shape) if m.is_factored(shape) else None
        if ds_compat.param_id(param) in self.deferred:
            # The slice stays where it arrived (the rank's device); the weights are the worker's.
            # Its u goes into the bucket's staged buffer, then its coef and decay.
            device = self.device_of(param)
            g = grad_in_place(grad_shard, geo.local, device)
            g = unscale_and_clip(g if g is not None else grad_chunk(grad_shard, 0, geo.local, device, fresh=True),
                                 settings)
            return _Slice(param, geo, shape, pieces, g, None, g, staged_at, grad_shard)
        # An fp32 slice beside fp32 weights is updated whole, in place (no temporary: the unchunked
        # arithmetic, bit for bit); otherwise g is read and the weights copied chunk by chunk in
        # each of the three phases.
        g = grad_in_place(grad_shard, geo.local, ds_compat.shard(param).device)
        if g is not None and shard.in_place(param):
            g = unscale_and_clip(g, settings)
            return _Slice(param, geo, shape, pieces, g, shard.weights(param), g, None, grad_shard)
        # Read three times. An accumulated sum kept elsewhere (accumulate_on: cpu) is copied over
        # once, whole, rather than once a phase.
        src, where = grad_shard, ds_compat.shard(param).device
        if not torch.is_tensor(src) and not src.resident(where):
            src = src.chunk(0, geo.local, where, fresh=True)
        return _Slice(param, geo, shape, pieces, None, None, None, None, src)

    def _statistics(self, shard: ShardWeights, b: _Bucket, settings: PassSettings, finite: torch.Tensor) -> None:
        """Phase 1: partial row/column sums of g^2 and partial sums of θ^2 for the whole bucket in
        one buffer: [rows, cols] of each matrix, then one θ^2 per parameter, all-reduced. Each
        slice's sums are taken where its gradient is (they need not all be on one device)."""
        b.width = sum(sum(m.factor_sizes(s.shape)) for s in b.slices if s.pieces is not None)
        b.sums = sums = torch.zeros(b.width + len(b.slices), dtype=torch.float32, device=b.device)
        at = 0
        for i, s in enumerate(b.slices):
            if s.pieces is not None:
                n_rows, n_cols = m.factor_sizes(s.shape)
                for a, g in self._g_chunks(shard, s, settings):
                    m.add_row_col_sums(g, s.pieces_at(a, g.numel()), sums[at:at + n_rows],
                                       sums[at + n_rows:at + n_rows + n_cols])
                    del g  # before the next chunk is read: one chunk at a time
                at += n_rows + n_cols
            if s.at is None:
                sums[b.width + i] = (torch.linalg.vector_norm(s.weights).square() if s.weights is not None
                                     else shard.sum_sq(s.param)).to(b.device)
        deferred_at = [i for i, s in enumerate(b.slices) if s.at is not None]
        if deferred_at:
            # The worker's recorded sum(θ^2) of each slice, copied over without blocking.
            sums.index_copy_(0, _index([b.width + i for i in deferred_at], b.device),
                             self._weight_norms(shard, [b.slices[i].param for i in deferred_at], b.device))
        self._all_reduce(sums)
        # Every rank's g^2 is in the reduced sums: a non-finite slice anywhere makes them
        # non-finite on every rank, so every rank keeps or drops this bucket alike.
        b.keep = finite.to(b.device) & torch.isfinite(sums).all()

    def _second_moments(self, shard: ShardWeights, b: _Bucket, settings: PassSettings) -> None:
        """Phase 2: the second moments, then u = g / sqrt(v) (in place of g, or into the staged
        buffer; a chunked slice's u is recomputed per chunk here and in phase 3) and the partial
        sums of u^2, all-reduced."""
        b.u_sq = torch.zeros(len(b.slices), dtype=torch.float32, device=b.device)
        b.factors = []
        at = 0
        for i, s in enumerate(b.slices):
            state = self.state[ds_compat.param_id(s.param)]
            here = b.keep.to(state["step"].device)
            state["step"].add_(here.double())
            beta = m.beta_at(state["step"], self.cfg.decay_rate)
            if s.pieces is not None:
                n_rows, n_cols = m.factor_sizes(s.shape)
                b.means = m.update_factored(state["row"], state["col"], b.sums[at:at + n_rows],
                                  b.sums[at + n_rows:at + n_rows + n_cols], s.shape, self.cfg.eps1, beta, here)
                at += n_rows + n_cols
                b.factors.append(m.factors_of(state["row"], state["col"]))
            else:
                b.factors.append(None)
            b.u_sq[i] = self._u_sq(shard, s, state, b.factors[i], beta, here, settings, b.device)
        self._all_reduce(b.u_sq)
        b.keep &= torch.isfinite(b.u_sq).all()

    def _u_sq(self, shard: ShardWeights, s: _Slice, state: dict, factors, beta: torch.Tensor, here: torch.Tensor,
              settings: PassSettings, device: torch.device) -> torch.Tensor:
        """A vector's full second moment, u (kept where the slice is whole) and this slice's sum of u^2."""
        eps1 = self.cfg.eps1
        if s.g is not None:
            if s.pieces is None:
                m.ema_where(state["sq"], s.g.square().add_(eps1), beta, here)
            m.u_of(s.g, s.pieces, factors, state.get("sq"), out=s.u)
            return torch.linalg.vector_norm(s.u).square().to(device)
        total = torch.zeros((), dtype=torch.float32, device=device)
        for a, g in self._g_chunks(shard, s, settings):
            sq = None
            if s.pieces is None:
                sq = state["sq"][a:a + g.numel()]
                m.ema_where(sq, g.square().add_(eps1), beta, here)
            u = m.u_of(g, s.pieces_at(a, g.numel()), factors, sq, out=g)
            total += torch.linalg.vector_norm(u).square().to(device)
            del u
            del g
        return total

    def _apply(self, shard: ShardWeights, b: _Bucket, settings: PassSettings, finite: torch.Tensor) -> None:
        """Phase 3: θ -= lr * max(eps2, RMS(θ)) * u / max(1, RMS(u) / clip_threshold), every
        coefficient a device tensor; a dropped bucket gets coefficient 0 and a zeroed u. Chunk by
        chunk here, or handed to the host-update worker."""
        numels = torch.tensor([float(max(s.geo.numel, 1)) for s in b.slices], dtype=torch.float32, device="cpu")
        numels = numels.to(b.device, non_blocking=True)
        coef, decay = m.coefficients(b.sums[b.width:], b.u_sq, numels, b.keep, settings.lr, settings.weight_decay,
                                     self.cfg.eps2, self.cfg.clip_threshold)
        for i, s in enumerate(b.slices):
            if s.geo.local and s.at is None:
                self._write(shard, s, b.factors[i], b.keep, coef[i], decay[i], settings)
        if b.staged is not None:
            self._hand_over(shard, b, coef, decay, settings, finite)

    def _write(self, shard: ShardWeights, s: _Slice, factors, keep: torch.Tensor, coef: torch.Tensor,
               decay: torch.Tensor, settings: PassSettings) -> None:
        """θ = θ decay - coef u over one slice, chunk by chunk, written back into its shard."""
        where = ds_compat.shard(s.param).device
        here, coef, decay = keep.to(where), coef.to(where), decay.to(where)
        sq = self.state[ds_compat.param_id(s.param)].get("sq")
        for a, b in shard.chunks(s.param):  # whole 8-bit blocks where the shard has them
            if s.g is not None:
                u = s.g[a:b]
            else:
                u = m.u_of(self._g_chunk(shard, s, a, b, settings), s.pieces_at(a, b - a), factors,
                           sq[a:b] if sq is not None else None)
            u.masked_fill_(~here, 0.0)
            weights = s.weights[a:b] if s.weights is not None else shard.weights(s.param, a, b)
            if settings.weight_decay:
                weights.mul_(decay)
            weights.sub_(u.mul_(coef))
            shard.write_back(s.param, weights, a, b)
            del u, weights

    def _g_chunk(self, shard: ShardWeights, s: _Slice, a: int, b: int, settings: PassSettings) -> torch.Tensor:
        """Elements [a, b) of a chunked slice's gradient, fp32, unscaled and clipped: a fresh copy
        each time, since each of the three phases reads the slice again and writes what it read."""
        return unscale_and_clip(grad_chunk(s.src, a, b, ds_compat.shard(s.param).device, fresh=True), settings)

    def _g_chunks(self, shard: ShardWeights, s: _Slice, settings: PassSettings):
        """(offset, g) over a slice: its whole g where it has one, else chunk by chunk, whole rows
        of a matrix kept in one chunk."""
        if s.g is not None:
            yield 0, s.g
            return
        align = s.shape[-1] if s.pieces is not None else 1  # whole rows of the stacked matrices
        for a, b in shard.chunks(s.param, align, on_grid=True):
            yield a, self._g_chunk(shard, s, a, b, settings)

    def _all_reduce(self, t: torch.Tensor) -> None:
        if self.world > 1:
            ds_compat.all_reduce(t, group=self.group, name="AdaLomo bucket statistics")

    # ----------------------------------------------------------------- shards in host memory
    def _weight_norms(self, shard: ShardWeights, params: list, device: torch.device) -> torch.Tensor:
        """sum(θ^2) of each parameter's slice (all deferred), on `device` without a blocking copy."""
        rows = [self.deferred[ds_compat.param_id(p)] for p in params]
        for row, p in zip(rows, params, strict=True):
            if not self.weight_sq_known[row]:
                # Not recorded since the shard was last written (the first update, or a checkpoint
                # load): taken here from the host weights, which no one else touches now (their
                # bucket is not handed over yet, and last pass's updates are joined).
                self.weight_sq[row] = shard.sum_sq(p)
                self.weight_sq_known[row] = True
        # Gathered into a buffer of its own (pinned on an accelerator), which the worker never
        # writes: the copy reads it whenever the stream gets there.
        picked = host_updates.host_buffer(len(rows), torch.float32, pin=self.pin)
        torch.index_select(self.weight_sq, 0, torch.tensor(rows, dtype=torch.int64, device="cpu"), out=picked)
        return picked.to(device, non_blocking=True)

    def _hand_over(self, shard: ShardWeights, b: _Bucket, coef: torch.Tensor, decay: torch.Tensor,
                   settings: PassSettings, finite: torch.Tensor) -> None:
        """Finish the staged buffer (a dropped bucket's u zeroed, each slice's coef and decay behind
        its u) and hand its slices to the worker."""
        staged = b.staged
        staged.masked_fill_(~b.keep.to(staged.device), 0.0)
        deferred = [(i, s) for i, s in enumerate(b.slices) if s.at is not None]
        ends = [s.at + s.geo.local for _, s in deferred]  # where each slice's coef goes, decay behind it
        picked = _index([i for i, _ in deferred], coef.device)
        values = torch.cat([coef.index_select(0, picked), decay.index_select(0, picked)]).to(staged.device)
        staged.index_copy_(0, _index(ends + [e + 1 for e in ends], staged.device), values)
        jobs = [(s.param, staged[s.at:s.at + s.geo.local + 2]) for _, s in deferred if s.geo.local]
        if jobs:
            self.host.submit(jobs, finite, partial(self.apply_host, shard, settings))

    def apply_host(self, shard: ShardWeights, settings: PassSettings, param: torch.nn.Parameter,
                   staged: torch.Tensor, finite: torch.Tensor) -> None:
        """The host part of a deferred update, on the worker: `staged` is the slice's u, then its
        coef and decay (a dropped bucket's: u zero, coef 0, decay 1; `finite` is already in them).
        Records the slice's new sum(θ^2) for its next update."""
        n = staged.numel() - 2
        u, coef, decay = staged[:n], staged[n], staged[n + 1]
        for a, b in shard.chunks(param):  # host RAM bounded by the chunk, not the slice
            weights = shard.weights(param, a, b)
            if settings.weight_decay:
                weights.mul_(decay)
            weights.sub_(u[a:b].mul_(coef))
            shard.write_back(param, weights, a, b)
            del weights
        # What the next update's RMS(θ) reads: the weights as stored (after rounding into a bf16
        # shard), as shard.weights gives them then.
        row = self.deferred[ds_compat.param_id(param)]
        self.weight_sq[row] = shard.sum_sq(param)
        self.weight_sq_known[row] = True

    # ----------------------------------------------------------------- state
    def state_layout(self) -> StateLayout:
        """A vector's full second moment `sq` is cut as its parameter is (this rank's slice); a
        matrix's row and column factors and every step count are the same on every rank."""
        return {(self.names[i], key): Cut(self.numels[i]) if key == "sq" else Replicated()
                for i, s in self.state.items() for key in s}

    def state_bytes(self) -> int:
        """Bytes this rank holds: the replicated row/column vectors and its slices of the rest."""
        return sum(t.numel() * t.element_size() for s in self.state.values() for t in s.values()
                   if torch.is_tensor(t))

    def state_dict(self) -> dict[str, dict[str, Any]]:
        return {self.names[i]: {k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in s.items()}
                for i, s in self.state.items()}

    def check_state(self, state: dict[str, dict[str, Any]] | None) -> None:
        """Every parameter's entry, and in each the keys this model's parameter keeps (a matrix's
        step, row, col; a vector's step, sq): a state of another model or another layout is refused
        here, not met later as a missing key."""
        if not state:
            raise ValueError("checkpoint holds no AdaLomo state, which lomo.optimizer 'adalomo' resumes from; "
                             "resume with the optimizer it was written with")
        by_name = set(self.names.values())
        if set(state) != by_name:
            missing, extra = sorted(by_name - set(state)), sorted(set(state) - by_name)
            raise ValueError(f"AdaLomo state does not match the model: missing {missing[:3]}, unexpected {extra[:3]}")
        for i, mine in self.state.items():
            saved = state[self.names[i]]
            if not isinstance(saved, dict) or set(saved) != set(mine):
                got = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
                raise ValueError(f"AdaLomo state of {self.names[i]!r} holds {got}, this model's parameter keeps "
                                 f"{sorted(mine)}: a checkpoint of another model (model.path)")

    def load_state_dict(self, state: dict[str, dict[str, Any]] | None) -> None:
        self.check_state(state)
        by_name = {name: i for i, name in self.names.items()}
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
        # The shards are written by the same load: the sums of squares recorded by the host-update
        # worker describe the weights before it.
        self.forget_weight_norms()
