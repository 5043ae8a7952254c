"""Counts the bytes each rank sends through DeepSpeed's communication backend, and times the
parts of a LOMO step (StepTimers, for experiments/bench_step.py).

All of ZeRO-3's parameter all-gathers and lomo_ds's own reduce-scatters and all-reduces go
through `deepspeed.comm`'s backend object, so wrapping its methods sees every collective.
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
    import deepspeed.comm as dist

    return dist.get_world_size(group=group)


@contextlib.contextmanager
def count_comm():
    """Within the block, count every collective's bytes sent by this rank."""
    import deepspeed.comm.comm as dscomm

    backend = dscomm.cdb
    counts = CommCounts()
    originals = {}

    def wrap(name, elems_sent, op=None):
        fn = getattr(backend, name)
        originals[name] = fn
        op = op or name

        def counted(*args, **kwargs):
            nbytes = elems_sent(*args, **kwargs)
            counts.bytes_by_op[op] += int(nbytes)
            counts.calls_by_op[op] += 1
            return fn(*args, **kwargs)

        setattr(backend, name, counted)

    def ring_part(tensor, group):
        w = _world(group)
        return tensor.numel() * tensor.element_size() * (w - 1) // w

    wrap("all_gather_into_tensor",
         lambda output_tensor, input_tensor, group=None, async_op=False: ring_part(output_tensor, group))
    # Both forms of the reduce-scatter (flat tensor, list of per-rank chunks) count as one collective.
    wrap("reduce_scatter_tensor",
         lambda output_tensor, input_tensor, op=None, group=None, async_op=False: ring_part(input_tensor, group),
         op="reduce_scatter")
    wrap("reduce_scatter",
         lambda output, input_list, op=None, group=None, async_op=False:
         sum(t.numel() * t.element_size() for t in input_list) * (_world(group) - 1) // _world(group))
    wrap("all_reduce", lambda tensor, op=None, group=None, async_op=False: 2 * ring_part(tensor, group))
    wrap("all_gather",
         lambda tensor_list, tensor, group=None, async_op=False: tensor.numel() * tensor.element_size() * (_world(group) - 1))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(backend, name, fn)


_OFF = contextlib.nullcontext()


class StepTimers:
    """Wall-clock seconds spent in named parts of a step (the LOMO overhead breakdown).

    Code under measurement asks `span(name)`; with timing off (`enabled = False`, the default)
    that is a shared no-op context, so the hot paths pay one attribute test and nothing else.
    """

    def __init__(self, enabled: bool = False):
        self.enabled = enabled
        self.seconds: dict[str, float] = defaultdict(float)

    def span(self, name: str):
        return self._timed(name) if self.enabled else _OFF

    @contextlib.contextmanager
    def _timed(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0

    def take(self) -> dict[str, float]:
        """The totals since the last take, then start again from zero."""
        out, self.seconds = dict(self.seconds), defaultdict(float)
        return out
