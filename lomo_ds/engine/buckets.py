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
backward; those given as `sparse` (comm.sparse_params) are there from the first backward on. A
parameter that had a gradient everywhere in the first backward and lacks one later is an error
naming it, raised before this rank sends anything out of order.

Payload. Each bucket travels as the rank-major payload of lomo_ds/comm/payload.py: this rank's
gradients of the bucket, row r what rank r receives, plus one non-finite flag the reduction sums
with them, so every rank receives the same verdict on the bucket with no extra collective. A sum
that overflows only inside the reduction (fp16) shows in the received slice of one rank alone:
that rank drops the bucket at once, and its next flag tells the others (the engine agrees on the
last bucket once the pass ends). The verdict folds into PassStats.finite, where the transport's
handle leaves it (a device flag on an accelerator: no host sync per bucket).

Overlap. Each bucket's reduce-scatter is started asynchronously (on an accelerator, packed on a
side stream) and the backward goes on; the bucket is handed to `on_bucket` just before the next
bucket is sent, or at the end of the backward: the same point of the backward on every rank,
never "as soon as it happens to be done", because an update may itself be a collective
(AdaLomo's row and column statistics) and ranks must issue collectives in one order. At most
`max_in_flight` collectives are outstanding, so memory stays O(bucket).

How the bytes move (`comm.grad_reduction`) is the transport's (lomo_ds/comm/grad.py): the buckets
fill its payload, post it, and wait on its handle for the reduced slices and the verdict. A
transport that carries gradients one at a time (one rank's direct path, the all-reduce baseline)
gets no buckets.
"""
from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from lomo_ds.comm import open_grad_transport
from lomo_ds.engine.update.rule import PassStats
from lomo_ds.engine.update.shard import geometry
from lomo_ds.runtime import ds_compat
from lomo_ds.runtime.device import group_device
from lomo_ds.runtime.dist import all_reduce_sum

OnBucket = Callable[[list[tuple[torch.nn.Parameter, torch.Tensor]], PassStats], None]

_OFF = contextlib.nullcontext()


class NoSpans:
    """Where a profiler hooks in (lomo_ds.profiling.attach_timers): by default a span is free."""

    @staticmethod
    def span(name: str):
        return _OFF


def part_of(param: torch.nn.Parameter, world: int) -> int:
    """Elements of the parameter each rank owns, padding included (ZeRO-3's partition size)."""
    return geometry(param, world, 0).part


@dataclass
class _InFlight:
    work: object  # the transport's handle
    send: torch.Tensor  # kept alive until the collective has read it
    received: torch.Tensor  # this rank's reduced slices, then the summed flag
    params: list[torch.nn.Parameter]


class GradientBuckets:
    """Collects ready gradients of `params` and reduces them in buckets of `capacity` per-rank
    elements, calling `on_bucket([(param, this rank's reduced slice)])` per bucket."""

    def __init__(self, params: list[torch.nn.Parameter], group, world: int, rank: int, capacity: int,
                 reduce_dtype: torch.dtype | None, on_bucket: OnBucket, device: torch.device,
                 transport: str = "auto", max_in_flight: int = 1, timers=None,
                 timeout_s: float | None = None, sparse: list[torch.nn.Parameter] = ()):
        from deepspeed.accelerator import get_accelerator

        self.group, self.world, self.rank = group, world, rank
        self.params = list(params)
        self.capacity = capacity
        self.reduce_dtype = reduce_dtype
        # Called once per reduced bucket with every parameter of the bucket at once, so an update
        # rule that needs a collective per bucket (AdaLomo's row/column statistics) can batch it.
        self.on_bucket = on_bucket
        self.device = device
        self.tracker = None  # a MemoryTracker, once track_memory() is called
        if max_in_flight < 1:
            raise ValueError(f"comm.max_in_flight: expected >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.transport = open_grad_transport(transport, group, [ds_compat.process_group(p) for p in self.params],
                                             world, rank, device, in_flight=max_in_flight, timeout_s=timeout_s,
                                             reduce_dtype=reduce_dtype)
        self.timers = timers or NoSpans()
        self.accelerator = get_accelerator()
        # Gradients are produced on the current stream; packing and sending them on a side stream
        # lets the next layer's backward kernels start at once.
        self.stream = self.accelerator.Stream() if device.type != "cpu" else None
        self.in_flight: deque[_InFlight] = deque()
        self._check_groups()
        bucketed = self.transport.bucketed
        self.declared_sparse = {id(p) for p in sparse}
        self._plan(self.params[::-1] if bucketed else [], self.declared_sparse)
        self._relayout_pending = bucketed
        self.reset(PassStats(device))

    @property
    def route(self):
        """Where the bytes go (lomo_ds.comm.GradRoute)."""
        return self.transport.route

    def abandon(self) -> None:
        """This rank's backward raised: peers waiting on it fail at once where the transport can
        tell them."""
        self.transport.abandon()

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
        if self.layout:  # every rank plans alike, at the same moment
            self.transport.reserve(max(self.world * (self._width(b) + 1) * self._dtype(b).itemsize
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
        if not self.transport.bucketed:  # one gradient at a time, reduced as it arrives
            self.arrived.append(param)
            reduced, finite = self.transport.reduce_one(param, grad, part_of(param, self.world))
            self.stats.fold(finite)  # on the device: no host sync
            with self.timers.span("update"):
                self.on_bucket([(param, reduced)], self.stats)
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
                    "list the parameters that may lack a gradient (mixture-of-experts experts) in comm.sparse_params")
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
                send = self.transport.payload(width + 1, dtype)
                self.transport.pack(send, [cols for _, cols in self._columns(params)], grads)
            with self.timers.span("flag"):
                self.transport.flag(send, width, self.stats.finite)
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
                work = self.transport.post(received, send, self.bucket_groups[b])
        self.in_flight.append(_InFlight(work, send, received, params))

    def _complete_oldest(self, timer: str = "wait") -> None:
        done = self.in_flight.popleft()
        with self.timers.span(timer):
            finite = done.work.wait()
        if self.stream is not None:
            done.received.record_stream(self.accelerator.current_stream())
        # From the first non-finite bucket on, nothing is applied (the updater reads the flag).
        self.stats.fold(finite)
        items = [(p, done.received[cols]) for p, cols in self._columns(done.params)]
        with self.timers.span("update"):
            self.on_bucket(items, self.stats)

    def _columns(self, params: list[torch.nn.Parameter]) -> list[tuple[torch.nn.Parameter, slice]]:
        """Each parameter of a bucket with its columns in the payload's rows and the received slice."""
        spans, col = [], 0
        for p in params:
            part = part_of(p, self.world)
            spans.append((p, slice(col, col + part)))
            col += part
        return spans

    def _held_bytes(self) -> int:
        return self.pending_bytes + sum(f.send.numel() * f.send.element_size()
                                        + f.received.numel() * f.received.element_size() for f in self.in_flight)
