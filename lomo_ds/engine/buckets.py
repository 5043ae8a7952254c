"""Reduce-scatter buckets: ready gradients in, this rank's reduced slices out, overlapped with the backward.

Layout. Every rank must issue the same collectives, of the same sizes, in the same order: else
ranks hang, or sum one parameter's gradient into another's. So the bucket layout is fixed and
shared: an ordered list of buckets, each an ordered list of parameters, identical on every rank.
The first backward uses the reverse of the parameter order (roughly the order gradients arrive);
after it, the group's first rank broadcasts the order its gradients really arrived in and every
rank re-plans on that (once, as torch's DDP rebuilds its buckets). A bucket is sent once all its
parameters' gradients are in, buckets strictly in layout order; at the end of the backward the
rest are sent, with zeros for any parameter that got no gradient on this rank (a mixture-of-experts
expert that none of this rank's tokens reached).

Parameters without a gradient. Such a parameter would hold its bucket, and every later one, on
the rank that lacks it until the end of the backward, while its peers send them mid-backward:
ranks would interleave these collectives with ZeRO-3's all-gathers in different orders (a hang or
mixed data on one communicator), and the lacking rank would hold every later gradient. So the
re-plan also sums over the ranks which parameters arrived: one missing on any rank goes into
buckets of their own at the end of the layout that every rank sends only at the end of the
backward; those given as `sparse` (lomo.sparse_params) are there from the first backward on. A
parameter that had a gradient everywhere in the first backward and lacks one later is an error
naming it, raised before this rank sends anything out of order.

Payload. The reduce-scatter input is rank-major: row r of a [world, width + 1] matrix holds, for
every parameter of the bucket, the elements rank r owns (zero-padded to `part`), then one flag
element: 0 when this rank's gradients in the bucket, and every reduced slice it has received in
this pass, are all finite; NaN otherwise (and, packed by the fused CPU kernels, when the payload's
sum of |elements| exceeds FLT_MAX / world, so that no element's sum over the ranks can overflow:
such a gradient is no step, as a sum that overflows in `all_finite`). The collective sums the
flags with the gradients, so every rank receives the same verdict on the bucket with no extra
collective. A sum that overflows only inside the reduction (fp16, or any transport without the
kernels' bound) shows in the received slice of one rank alone: that rank drops
the bucket at once, and its next flag tells the others (the engine agrees on the last bucket once
the pass ends). The verdict is a device flag (PassStats.finite): no host sync per bucket. The
gradient bytes are those of DeepSpeed's own ZeRO-3 path, half an all-reduce's. One rank uses the
same path (a one-rank collective), so the path a single GPU runs is the one many GPUs run.

Overlap. Each bucket's reduce-scatter is started asynchronously (on an accelerator, packed on a
side stream) and the backward goes on; the bucket is handed to `on_bucket` just before the next
bucket is sent, or at the end of the backward: the same point of the backward on every rank,
never "as soon as it happens to be done", because an update may itself be a collective
(AdaLomo's row and column statistics) and ranks must issue collectives in one order. At most
`max_in_flight` collectives are outstanding, so memory stays O(bucket).

Transports (`lomo.grad_reduction`):
  reduce_scatter  the collective above: NCCL on GPUs, gloo between CPU nodes.
  shared_memory   CPU ranks all on one node: the same rank-major payload, packed straight into
                  this rank's shared-memory buffer and reduced by each rank reading its own row
                  of every rank's payload when the bucket is due (shm_reduce_scatter.py). gloo's
                  reduce-scatter through TCP loopback costs several times as long on a CPU. An
                  fp32 payload is packed and summed for its flag in one read, and the plain SGD
                  pass steps each shard as it sums the ranks' rows (`on_rows`), the reduced
                  slice never stored (cpu_kernels.py): on a CPU every pass over the gradient's
                  bytes costs memory bandwidth.
  auto            shared_memory where the ranks can, else reduce_scatter.
  all_reduce      the public reference implementation's way (all-reduce each whole gradient,
                  synchronously, keep this rank's slice): twice the bytes. A baseline for
                  experiments/bench_comm.py only.
"""
from __future__ import annotations

import math
import typing
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from lomo_ds.config.lomo import GradReduction
from lomo_ds.engine import shm_reduce_scatter
from lomo_ds.engine.comm_stats import StepTimers
from lomo_ds.engine.fused_update import PassStats, geometry
from lomo_ds.runtime import ds_compat
from lomo_ds.runtime.device import group_device
from lomo_ds.runtime.dist import all_reduce_sum

OnBucket = Callable[[list[tuple[torch.nn.Parameter, torch.Tensor]], PassStats], None]
# A bucket as every rank's row of it, the pass's stats, and the kernels to step with; False: declined.
OnRows = Callable[[list[tuple[torch.nn.Parameter, list[torch.Tensor]]], PassStats, object], bool]


def part_of(param: torch.nn.Parameter, world: int) -> int:
    """Elements of the parameter each rank owns, padding included (ZeRO-3's partition size)."""
    return geometry(param, world, 0).part


def all_finite(t: torch.Tensor) -> torch.Tensor:
    """Whether every element of `t` is finite, as a device bool (no host sync), from its fp32 sum:
    a NaN, or an infinity, makes the sum non-finite (inf - inf is NaN). On a CPU torch.isfinite
    tests element by element: 47 ms for the 14.5M-element slice a rank of a 29M model receives
    each step, against 2.2 ms for torch.aminmax and 1.2 ms for the sum. A sum of finite elements
    that overflows fp32 (elements of 1e32 and more) reads as non-finite: the step is skipped, the
    safe side, and such a gradient is no gradient to step on."""
    return torch.isfinite(_sum32(t))


def _sum32(t: torch.Tensor) -> torch.Tensor:
    """The sum of `t` as a finiteness test, without an fp32 copy of `t`: torch's sum(dtype=fp32) of
    a bf16 tensor on a CPU converts the whole tensor first (twice the largest gradient's bytes).
    bf16 has fp32's exponent range, so its own sum (accumulated in fp32) overflows where an fp32
    sum would; fp16's does not, so an fp16 tensor is summed in fp32 a bounded piece at a time."""
    if t.dtype in (torch.float32, torch.bfloat16):
        return t.sum().float()
    flat = t.reshape(-1)
    total = torch.zeros((), dtype=torch.float32, device=t.device)
    for a in range(0, flat.numel(), SUM_PIECE):
        total += flat[a:a + SUM_PIECE].sum(dtype=torch.float32)
    return total


SUM_PIECE = 1 << 22  # elements of an fp16 tensor converted to fp32 at once by _sum32


def nonfinite_marker(t: torch.Tensor, finite_so_far: torch.Tensor | None = None) -> torch.Tensor:
    """0 when every element of `t` is finite (and `finite_so_far` holds), NaN otherwise: 0 * sum
    (inf * 0 and NaN * 0 are NaN). A device tensor, so building the flag costs no host sync. A sum
    rather than a min and a max: `t` is the packed payload, a strided view (the flag column sits
    between its rows), which aminmax reads about 3x slower than the sum does in the engine's step."""
    marker = _sum32(t).mul_(0.0)
    if finite_so_far is not None:
        marker = torch.where(finite_so_far, marker, math.nan)
    return marker


@dataclass
class _InFlight:
    work: object  # the collective's handle
    send: torch.Tensor  # kept alive until the collective has read it
    received: torch.Tensor  # this rank's reduced slices, then the summed flag
    params: list[torch.nn.Parameter]


TRANSPORTS = typing.get_args(GradReduction)


def resolve_transport(requested: str, params: list[torch.nn.Parameter], world: int) -> str:
    """The transport `requested` (lomo.grad_reduction) comes to on these ranks: "auto" picks
    shared memory where the ranks can use it; asking for it where they cannot is an error."""
    if requested not in TRANSPORTS:
        raise ValueError(f"lomo.grad_reduction: expected one of {TRANSPORTS}, got {requested!r}")
    if world == 1 and requested == "auto":
        # Nothing to reduce: each gradient is applied as it arrives (one gradient alive, no payload
        # copy). Asked for by name, a transport runs as a one-rank collective (the GPU suite's path).
        return "direct"
    if requested in ("reduce_scatter", "all_reduce"):
        return requested
    # Named on one rank too: one GPU has no shared-memory transport, whatever the world size.
    possible = all(shm_reduce_scatter.available(ds_compat.process_group(p)) for p in params)
    if requested == "shared_memory" and not possible:
        raise ValueError(f"lomo.grad_reduction: 'shared_memory' needs CPU (gloo) ranks all on one x86-64 node, "
                         f"sharded over every rank (LOCAL_SIZE or LOCAL_WORLD_SIZE, as the launcher sets them, = "
                         f"world size = {world}); use 'auto' or 'reduce_scatter'")
    return "shared_memory" if possible else "reduce_scatter"


class GradientBuckets:
    """Collects ready gradients of `params` and reduces them in buckets of `capacity` per-rank
    elements, calling `on_bucket([(param, this rank's reduced slice)])` per bucket."""

    def __init__(self, params: list[torch.nn.Parameter], group, world: int, rank: int, capacity: int,
                 reduce_dtype: torch.dtype | None, on_bucket: OnBucket, device: torch.device,
                 transport: str = "auto", max_in_flight: int = 1, timers: StepTimers | None = None,
                 timeout_s: float | None = None, sparse: list[torch.nn.Parameter] = (),
                 on_rows: OnRows | None = None):
        from deepspeed.accelerator import get_accelerator

        self.group, self.world, self.rank = group, world, rank
        self.params = list(params)
        self.capacity = capacity
        self.reduce_dtype = reduce_dtype
        # Called once per reduced bucket with every parameter of the bucket at once, so an update
        # rule that needs a collective per bucket (AdaLomo's row/column statistics) can batch it.
        self.on_bucket = on_bucket
        # Optional: a bucket as every rank's row of it (shared memory with the fused kernels), to
        # apply while summing them; returns False when this pass needs the reduced slices instead.
        self.on_rows = on_rows
        self.device = device
        self.tracker = None  # a MemoryTracker, once track_memory() is called
        if max_in_flight < 1:
            raise ValueError(f"lomo.max_in_flight: expected >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.transport = resolve_transport(transport, self.params, world)
        self.shm = (shm_reduce_scatter.SharedMemoryReduceScatter(group, world, rank, in_flight=max_in_flight,
                                                                 timeout_s=timeout_s)
                    if self.transport == "shared_memory" else None)
        self.timers = timers or StepTimers()
        self.accelerator = get_accelerator()
        # Gradients are produced on the current stream; packing and sending them on a side stream
        # lets the next layer's backward kernels start at once.
        self.stream = self.accelerator.Stream() if device.type != "cpu" else None
        self.in_flight: deque[_InFlight] = deque()
        self._check_groups()
        # The all-reduce baseline and one rank's direct path go one parameter at a time: no buckets.
        bucketed = self.transport not in ("all_reduce", "direct")
        self.declared_sparse = {id(p) for p in sparse}
        self._plan(self.params[::-1] if bucketed else [], self.declared_sparse)
        self._relayout_pending = bucketed
        self.reset(PassStats(device))

    @property
    def kernels(self):
        """The fused CPU passes (cpu_kernels.py), where every rank has them: shared memory only."""
        return self.shm.kernels if self.shm is not None else None

    def abandon(self) -> None:
        """This rank's backward raised: peers waiting on it through shared memory fail at once,
        naming this rank (gloo and NCCL peers fail by the process group's timeout)."""
        if self.shm is not None:
            self.shm.abandon()

    def track_memory(self, tracker) -> None:
        """Report the bytes held in buckets to `tracker` (a MemoryTracker) from now on."""
        self.tracker = tracker

    # ----------------------------------------------------------------- layout
    def _check_groups(self) -> None:
        """Each parameter is reduced in its own `ds_process_group`, but the shard update assumes one
        partitioning (`world` ranks, this one `rank`): refuse any group that partitions differently."""
        groups = {id(g): g for g in map(ds_compat.process_group, self.params)}
        for g in groups.values():
            size, index = torch.distributed.get_world_size(g), torch.distributed.get_rank(g)
            if (size, index) != (self.world, self.rank):
                ids = [ds_compat.param_id(p) for p in self.params if ds_compat.process_group(p) is g]
                raise ValueError(f"parameters ds_id={ids[:5]} are partitioned over a process group of {size} ranks "
                                 f"(this rank {index}), the others over {self.world} (this rank {self.rank}): "
                                 "lomo_ds updates shards of one partitioning only")

    def _plan(self, order: list[torch.nn.Parameter], sparse: set[int] | None = None) -> None:
        """Buckets of at most `capacity` per-rank elements, in `order`; parameters partitioned over
        different process groups never share a bucket (each bucket is reduced in its own group).
        The parameters in `sparse` (ids) go last, into flush-only buckets of their own."""
        self.layout: list[list[torch.nn.Parameter]] = []
        self.bucket_groups = []  # the process group each bucket is reduced in
        self.flush_only = set()  # buckets sent only at the end of the backward, on every rank
        sparse = sparse or set()
        for params, at_end in (([p for p in order if id(p) not in sparse], False),
                               ([p for p in order if id(p) in sparse], True)):
            first = len(self.layout)
            self._fill(params)
            if at_end:
                self.flush_only.update(range(first, len(self.layout)))
        self.slot_of = {id(p): (b, i) for b, bucket in enumerate(self.layout) for i, p in enumerate(bucket)}
        if self.shm is not None and self.layout:  # every rank plans alike, at the same moment
            self.shm.reserve(max(self.world * (self._width(b) + 1) * self._dtype(b).itemsize
                                 for b in range(len(self.layout))))

    def _fill(self, order: list[torch.nn.Parameter]) -> None:
        filling: dict[int, tuple[object, list, int]] = {}  # id(group) -> (group, params, elements)

        def close(key):
            group, bucket, _ = filling.pop(key)
            self.layout.append(bucket)
            self.bucket_groups.append(group)

        for p in order:
            group = ds_compat.process_group(p)
            part = part_of(p, self.world)
            if id(group) in filling and filling[id(group)][2] + part > self.capacity:
                close(id(group))
            _, bucket, elems = filling.setdefault(id(group), (group, [], 0))
            bucket.append(p)
            filling[id(group)] = (group, bucket, elems + part)
            if elems + part >= self.capacity:
                close(id(group))
        for key in list(filling):
            close(key)

    def _width(self, b: int) -> int:
        """Per-rank gradient elements of bucket `b` (its payload rows carry one flag more)."""
        return sum(part_of(p, self.world) for p in self.layout[b])

    def _dtype(self, b: int) -> torch.dtype:
        return self.reduce_dtype or self.layout[b][0].dtype

    def _relayout(self) -> None:
        """Re-plan every rank on the order gradients arrived in on the group's first rank."""
        index = {id(p): i for i, p in enumerate(self.params)}
        # Built on the host, broadcast on the group's device (NCCL: the GPU; gloo: the CPU).
        order = torch.full((len(self.params),), -1, dtype=torch.int64, device="cpu")
        order[:len(self.arrived)] = torch.tensor([index[id(p)] for p in self.arrived], dtype=torch.int64,
                                                 device="cpu")
        order = order.to(group_device(self.group))
        ds_compat.broadcast_from_first(order, self.group)
        first = [self.params[i] for i in order.tolist() if i >= 0]
        seen = {id(p) for p in first}
        # Which parameters got a gradient on how many ranks: one missing anywhere is flush-only.
        arrived_here = {id(p) for p in self.arrived}
        counts = torch.tensor([float(id(p) in arrived_here) for p in self.params], dtype=torch.float32, device="cpu")
        counts = all_reduce_sum(counts, self.world, self.group, name="parameters with a gradient")
        sparse = self.declared_sparse | {id(p) for p, n in zip(self.params, counts.tolist(), strict=True)
                                         if n < self.world}
        # Parameters the first rank got no gradient for keep their place relative to each other.
        self._plan(first + [p for bucket in self.layout for p in bucket if id(p) not in seen], sparse)
        self._relayout_pending = False

    # ----------------------------------------------------------------- one backward
    def reset(self, stats: PassStats) -> None:
        """Start a backward: no bucket sent, no gradient in; `stats` (the updater's, for this pass)
        collects whether everything stayed finite."""
        while self.in_flight:  # left by a backward that raised: finish it, apply nothing
            self.in_flight.popleft().work.wait()
        self.stats = stats
        self.slots: list[list[torch.Tensor | None]] = [[None] * len(b) for b in self.layout]
        self.missing = [len(b) for b in self.layout]
        self.next_bucket = 0  # the next bucket to send, in layout order
        self.arrived: list[torch.nn.Parameter] = []
        self.pending_bytes = 0  # gradients waiting for their bucket to be sent

    def add(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        if self.transport == "direct":
            self.arrived.append(param)
            flat = grad.reshape(-1)
            self.stats.finite.logical_and_(all_finite(flat))  # on the device: no host sync
            with self.timers.span("update"):
                self.on_bucket([(param, flat)], self.stats)
            return
        if self.transport == "all_reduce":
            self._all_reduce_one(param, grad)
            return
        b, i = self.slot_of[id(param)]
        if b < self.next_bucket:
            raise RuntimeError(f"parameter ds_id={ds_compat.param_id(param)} {tuple(ds_compat.full_shape(param))}: "
                               "a second gradient arrived after its bucket was sent in this backward")
        held = self.slots[b][i]
        if held is None:
            self.slots[b][i] = grad
            self.missing[b] -= 1
            self.arrived.append(param)
            self.pending_bytes += grad.numel() * grad.element_size()
        else:
            held.add_(grad)  # a second accumulation (reentrant checkpointing): ours to sum into
        if self.tracker is not None:
            self.tracker.note_bucket(self._held_bytes())
        while (self.next_bucket < len(self.layout) and self.missing[self.next_bucket] == 0
               and self.next_bucket not in self.flush_only):
            self._send_next()

    def flush(self) -> None:
        """End of the backward: send what is left (zeros for gradients that never came), apply all."""
        if not self._relayout_pending and self.world > 1:  # one rank has no peer to be out of order with
            late = [p for b in range(self.next_bucket, len(self.layout)) if b not in self.flush_only
                    for p, g in zip(self.layout[b], self.slots[b], strict=True) if g is None]
            if late:
                raise RuntimeError(
                    f"parameters ds_id={[ds_compat.param_id(p) for p in late[:5]]} got no gradient on rank {self.rank} "
                    "in this backward, though every rank had one in the first: their buckets would be sent here at "
                    "the end of the backward and mid-backward on the other ranks (collectives in different orders): "
                    "list the parameters that may lack a gradient (mixture-of-experts experts) in lomo.sparse_params")
        while self.next_bucket < len(self.layout):
            self._send_next()
        while self.in_flight:
            self._complete_oldest(timer="wait at end")
        if self._relayout_pending:
            self._relayout()

    # ----------------------------------------------------------------- one bucket
    def _send_next(self) -> None:
        b = self.next_bucket
        params, grads = self.layout[b], self.slots[b]
        self.slots[b] = None
        self.next_bucket += 1
        if len(self.in_flight) >= self.max_in_flight:
            self._complete_oldest()
        dtype, width = self._dtype(b), self._width(b)
        if self.stream is not None:
            self.stream.wait_stream(self.accelerator.current_stream())
        with self.accelerator.stream(self.stream):
            with self.timers.span("pack"):
                send = (self.shm.payload(width + 1, dtype) if self.shm is not None
                        else torch.empty(self.world, width + 1, dtype=dtype, device=self.device))
                packed_l1 = self._pack(send, params, grads)
            with self.timers.span("flag"):
                if packed_l1 is None:
                    send[:, width] = nonfinite_marker(send[:, :width], self.stats.finite)
                else:  # summed while packing, in host memory (shared memory joins CPU ranks only)
                    # Within FLT_MAX / world (NaN compares false), every element is: no sum over
                    # the ranks can overflow, so a bucket whose flags are all 0 stays finite once
                    # summed, and can be stepped on as it is summed (on_rows).
                    clean = packed_l1 <= torch.finfo(torch.float32).max / self.world and bool(self.stats.finite)
                    send[:, width] = 0.0 if clean else math.nan
            if self.tracker is not None:
                self.tracker.note_bucket(self._held_bytes() + send.numel() * send.element_size())
            # The gradients are packed: let them go before the receive buffer exists.
            for g in grads:
                if g is not None:
                    self.pending_bytes -= g.numel() * g.element_size()
                    if self.stream is not None:
                        g.record_stream(self.stream)  # read by the side stream: not to be reused before
            grads.clear()
            received = torch.empty(width + 1, dtype=dtype, device=self.device)
            with self.timers.span("launch"):
                work = (self.shm.post(received) if self.shm is not None
                        else ds_compat.reduce_scatter_async(received, send.view(-1), self.bucket_groups[b]))
        self.in_flight.append(_InFlight(work, send, received, params))

    def _pack(self, send: torch.Tensor, params, grads) -> float | None:
        """Fill the rank-major payload `send`; its last column (the flag) is left for the caller.
        Returns the sum of |what was packed| where the fused CPU kernel packed it (the flag then
        needs no second read of the payload), else None."""
        kernels = self.kernels if self.kernels is not None and self.kernels.usable(send) else None
        total = 0.0 if kernels is not None else None
        for (_, cols), g in zip(self._columns(params), grads, strict=True):
            if g is None:
                send[:, cols].zero_()  # no gradient on this rank: it contributes zeros
                continue
            flat, part = g.reshape(-1), cols.stop - cols.start
            full_rows = g.numel() // part
            if kernels is not None:
                flat = flat.to(torch.float32)  # a bf16 gradient into an fp32 payload (lomo.reduce_dtype)
                for r in range(full_rows):  # row by row: each row of a parameter is contiguous on both sides
                    total += kernels.copy_abs_sum(send[r, cols], flat[r * part:(r + 1) * part])
            else:  # one copy for every full row (one kernel launch on an accelerator)
                send[:full_rows, cols].copy_(flat[:full_rows * part].view(full_rows, part))
            if full_rows < self.world:
                send[full_rows:, cols].zero_()
                tail, run = g.numel() - full_rows * part, flat[full_rows * part:]
                if tail and kernels is not None:
                    total += kernels.copy_abs_sum(send[full_rows, cols.start:cols.start + tail], run)
                elif tail:
                    send[full_rows, cols.start:cols.start + tail].copy_(run)
        return total

    def _complete_oldest(self, timer: str = "wait") -> None:
        done = self.in_flight.popleft()
        if self.kernels is not None and self.on_rows is not None and self._apply_rows(done, timer):
            return
        with self.timers.span(timer):
            done.work.wait()  # on an accelerator: the current stream waits for the collective
        if self.stream is not None:
            done.received.record_stream(self.accelerator.current_stream())
        # The summed flag (0, or NaN when some rank's part of the bucket or an earlier received
        # slice was not finite: the same on every rank) and this rank's reduced slices (an fp16
        # sum may overflow inside the reduction). On the device: from here on nothing is applied.
        if self.shm is not None:
            # Shared memory joins CPU ranks only: its verdict (read while reducing) is in host
            # memory, and reading the pass's flag is free.
            if not done.work.finite:
                self.stats.finite.fill_(False)
            self.stats.finite_on_host = bool(self.stats.finite)
        else:
            self.stats.finite.logical_and_(all_finite(done.received))
        items = [(p, done.received[cols]) for p, cols in self._columns(done.params)]
        with self.timers.span("update"):
            self.on_bucket(items, self.stats)

    def _apply_rows(self, done: _InFlight, timer: str) -> bool:
        """Shared memory with the fused kernels: hand `on_rows` every rank's row of the bucket, to
        step on as it sums them (no reduced slice stored, no second read of it). The flags decide
        first: all 0 means every payload was finite and within FLT_MAX / world (_pack), so the sum
        is finite too. False, with nothing consumed or changed: `on_rows` cannot take this pass
        (the measuring pass, AdaLomo, accumulation), and the bucket is reduced as usual."""
        with self.timers.span(timer):
            rows = done.work.rows()
        width = done.received.numel() - 1
        clean = math.isfinite(sum(float(row[width]) for row in rows))  # flags: 0, or NaN from some rank
        items = [(p, [row[cols] for row in rows]) for p, cols in self._columns(done.params)]
        # What the update reads: whether anything may move (the reduced path sets it again).
        self.stats.finite_on_host = clean and bool(self.stats.finite)
        with self.timers.span("update"):
            if not self.on_rows(items, self.stats, self.kernels):
                return False
        if not clean:
            self.stats.finite.fill_(False)
        done.work.release()
        return True

    def _columns(self, params: list[torch.nn.Parameter]) -> list[tuple[torch.nn.Parameter, slice]]:
        """Each parameter of a bucket with its columns in the payload's rows and the received slice."""
        spans, col = [], 0
        for p in params:
            part = part_of(p, self.world)
            spans.append((p, slice(col, col + part)))
            col += part
        return spans

    def _all_reduce_one(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        full = grad.reshape(-1).to(self.reduce_dtype or grad.dtype)
        ds_compat.all_reduce(full, group=ds_compat.process_group(param))
        # Every rank holds the same summed gradient: a local check is already agreed.
        self.stats.finite.logical_and_(all_finite(full))
        part = part_of(param, self.world)
        self.on_bucket([(param, full[self.rank * part:(self.rank + 1) * part])], self.stats)

    def _held_bytes(self) -> int:
        return self.pending_bytes + sum(f.send.numel() * f.send.element_size()
                                        + f.received.numel() * f.received.element_size() for f in self.in_flight)
