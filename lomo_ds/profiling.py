"""Instrumentation that hooks into a run from the outside: counts the collectives each rank issues
and the bytes it sends (count_comm), and times the parts of a LOMO step (StepTimers, attached to
an engine by `attach_timers`, for benchmarks/bench_step.py and bench_fsdp.py). Nothing in the
engine or the transports depends on it.

Three paths carry collectives, and `count_comm` sees all of them, each call once:
  deepspeed.comm's backend object: ZeRO-3's parameter all-gathers (through lomo_ds's shared-memory
      all-gather, lomo_ds/comm/shm_all_gather.py, when comm.param_gather routes them there: the route sits on
      that object, so each is counted here as the all-gather it replaces), lomo_ds's reduce-scatters
      and all-reduces, and DeepSpeed's CPU all-reduce, which goes through shared memory and never
      reaches torch.distributed;
  torch.distributed itself: what calls it directly (PyTorch FSDP2 in benchmarks/bench_fsdp.py);
      a call made from inside a DeepSpeed one is that one, not a second;
  lomo_ds's shared-memory transports (lomo_ds/comm), which report each send through comm.observe.
Bytes are counted as a ring algorithm sends them per rank, the usual cost model:
all-gather and reduce-scatter of an n-element result/input: (w-1)/w * n elements;
all-reduce of n elements: 2 (w-1)/w * n; broadcast: n from the root.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class CommCounts:
    bytes_by_op: dict = field(default_factory=lambda: defaultdict(int))
    calls_by_op: dict = field(default_factory=lambda: defaultdict(int))

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_op.values())

    def as_dict(self) -> dict:
        return {op: {"bytes": self.bytes_by_op[op], "calls": self.calls_by_op[op]} for op in sorted(self.bytes_by_op)}


def _world(group):
    import torch.distributed as dist

    return dist.get_world_size(group=group)


def ring_part(tensor, group) -> int:
    """Bytes a rank sends in a ring all-gather (of `tensor`, the output) or reduce-scatter (the input)."""
    w = _world(group)
    return tensor.numel() * tensor.element_size() * (w - 1) // w


@contextlib.contextmanager
def count_comm():
    """Within the block, count every collective this rank issues and the bytes it sends."""
    import deepspeed.comm.comm as dscomm
    import torch.distributed as tdist

    from lomo_ds.comm import observe

    counts = CommCounts()
    restore = []
    depth = [0]  # > 0 inside a counted call: the calls it makes are part of it

    def wrap(owner, name, elems_sent, op=None):
        fn = getattr(owner, name, None)
        if fn is None:  # not in this torch / DeepSpeed release
            return
        restore.append((owner, name, fn))
        op = op or name

        def counted(*args, **kwargs):
            if depth[0] == 0:
                counts.bytes_by_op[op] += int(elems_sent(*args, **kwargs))
                counts.calls_by_op[op] += 1
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        setattr(owner, name, counted)

    def arg(args, kwargs, index, names):
        """The argument at `index`, or passed by one of `names` (callers spell them differently)."""
        if len(args) > index:
            return args[index]
        return next((kwargs[n] for n in names if n in kwargs), None)

    def ring(tensor_at, names, group_at, factor=1):
        """Bytes sent: `factor` x the ring share of the tensor at `tensor_at` (all-gather: the
        output; reduce-scatter: the input; all-reduce: twice the tensor)."""
        return lambda *a, **k: factor * ring_part(arg(a, k, tensor_at, names), arg(a, k, group_at, ("group",)))

    def scattered_list(*a, **k):
        inputs, group = arg(a, k, 1, ("input_list",)), arg(a, k, 3, ("group",))
        return sum(t.numel() * t.element_size() for t in inputs) * (_world(group) - 1) // _world(group)

    def gathered_list(*a, **k):
        tensor, group = arg(a, k, 1, ("tensor",)), arg(a, k, 2, ("group",))
        return tensor.numel() * tensor.element_size() * (_world(group) - 1)

    def broadcast(*a, **k):
        tensor = arg(a, k, 0, ("tensor",))
        return tensor.numel() * tensor.element_size()

    gathered = ring(0, ("output_tensor", "output"), 2)
    scattered = ring(1, ("input_tensor", "input"), 3)
    # Both forms of each collective (flat tensor, list of per-rank chunks), and torch's newer
    # names (FSDP2 calls these), count as one op.
    for owner in (dscomm.cdb, tdist):
        wrap(owner, "all_gather_into_tensor", gathered)
        wrap(owner, "reduce_scatter_tensor", scattered, op="reduce_scatter")
        wrap(owner, "reduce_scatter", scattered_list)
        wrap(owner, "all_reduce", ring(0, ("tensor",), 2, factor=2))
        wrap(owner, "all_gather", gathered_list)
        wrap(owner, "broadcast", broadcast)
    wrap(tdist, "all_gather_single", gathered, op="all_gather_into_tensor")
    wrap(tdist, "reduce_scatter_single", scattered, op="reduce_scatter")
    wrap(tdist, "barrier", lambda *a, **k: 0)
    # DeepSpeed's CPU all-reduce through shared memory, which never reaches torch.distributed.
    wrap(dscomm.cdb, "inference_all_reduce", ring(0, ("tensor",), 2, factor=2), op="all_reduce")
    def reported(op: str, nbytes: int) -> None:  # a shared-memory transport's send
        counts.bytes_by_op[op] += int(nbytes)
        counts.calls_by_op[op] += 1

    observe.subscribe(reported)
    try:
        yield counts
    finally:
        observe.unsubscribe(reported)
        for owner, name, fn in reversed(restore):
            setattr(owner, name, fn)


_OFF = contextlib.nullcontext()


class StepTimers:
    """Seconds spent in named parts of a step (the LOMO overhead breakdown).

    Code under measurement asks `span(name)`; with timing off (`enabled = False`, the default)
    that is a shared no-op context, so the hot paths pay one attribute test and nothing else;
    `enable()` turns it on.
    On a CPU a span is wall-clock time. On an accelerator the host only queues work (a collective's
    `wait()` returns at once and makes the stream wait), so a span records accelerator events on
    the current stream around the work it queued, and `take()` reads their elapsed times once.
    """

    def __init__(self, enabled: bool = False, device=None):
        self.enabled = enabled
        self.on_accelerator = device is not None and getattr(device, "type", str(device)) != "cpu"
        self.seconds: dict[str, float] = defaultdict(float)
        self._events: list[tuple[str, object, object]] = []  # (name, start, end), read at take()

    def enable(self) -> None:
        self.enabled = True

    def span(self, name: str):
        if not self.enabled:
            return _OFF
        return self._evented(name) if self.on_accelerator else self._timed(name)

    @contextlib.contextmanager
    def _timed(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0

    @contextlib.contextmanager
    def _evented(self, name: str):
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        start, end = accelerator.Event(enable_timing=True), accelerator.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end.record()
            self._events.append((name, start, end))

    def take(self) -> dict[str, float]:
        """The totals since the last take, then start again from zero (on an accelerator: waits
        for the recorded events, one host sync)."""
        for name, start, end in self._events:
            end.synchronize()
            self.seconds[name] += start.elapsed_time(end) / 1000.0  # milliseconds
        self._events.clear()
        out, self.seconds = dict(self.seconds), defaultdict(float)
        return out


def attach_timers(engine, enabled: bool = True) -> StepTimers:
    """Time the parts of `engine`'s steps (a LomoEngine: its spans are no-ops until this is
    called) from now on; returns the timers (`take()` reads them)."""
    timers = StepTimers(enabled=enabled, device=getattr(engine, "device", None))
    engine.timers = timers
    return timers
