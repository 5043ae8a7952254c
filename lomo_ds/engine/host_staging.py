"""Where each reduced slice goes: the update, the window's accumulator, or the host-update worker.

The buckets hand every reduced bucket to the engine's SliceRoute, which sends each slice where
the pass now running says (its BucketMode): applied, added into the accumulator, or added and
the window's sum applied (the fused last micro-batch of a window).

With `offload_param: cpu` and a host-update worker (host_updates.py), a bucket's slices of shards
in host memory are staged for the worker instead of applied in the gradient hook; the rest of the
bucket goes on as usual. What the worker does with a slice follows the pass's bucket mode (apply,
add into the accumulator, or add and apply the window's sum). Every pass, and the one pass over
the accumulated shards, joins the worker before its statistics are read.
"""
from __future__ import annotations

import contextlib

import torch

from lomo_ds.engine.window import BucketMode


class HostStaging:
    """The engine's hand-over to the host-update worker: `host` (HostUpdates, or None where the
    shards are updated inline), the `updater` and the window's `accumulator` (None for windows of one)."""

    def __init__(self, host, updater, accumulator):
        self.host, self.updater, self.accumulator = host, updater, accumulator

    def stage(self, items: list[tuple[torch.nn.Parameter, torch.Tensor]], stats, mode: BucketMode):
        """Hand the slices of shards in host memory to the worker (which applies them as `mode`
        says); returns the rest. The updating passes of a rule that takes each bucket whole keep it
        whole (the rule hands the host part over itself, after its collectives); the measuring pass
        touches no shard and sums its squares on the device, in the hook."""
        host = self.host
        whole = self.updater.rule.takes_whole_bucket and mode is not BucketMode.ADD
        if host is None or self.updater.measuring or whole or not any(host.holds(p) for p, _ in items):
            return items
        staged = [(p, g[:self.updater.geometry(p).local]) for p, g in items if host.holds(p)]
        staged = [(p, g) for p, g in staged if g.numel()]  # a rank may hold no real element of one
        if staged:
            host.submit(staged, stats.finite, self.worker_apply(mode))
        return [(p, g) for p, g in items if not host.holds(p)]

    def worker_apply(self, mode: BucketMode):
        """What the worker does with one staged slice (a parameter's real elements in host memory)
        and the pass's finite flag as of its bucket, in the bucket mode of its pass."""
        if mode is BucketMode.ADD:
            return lambda p, g, finite: self.accumulator.add(p, g)
        if mode is BucketMode.FOLD:
            return lambda p, g, finite: self.updater.apply(p, self.accumulator.lazy_total(p, g.device, g), finite)
        return lambda p, g, finite: self.updater.apply(p, g, finite)

    @contextlib.contextmanager
    def joined(self, on_error=()):
        """Around work that hands updates of host-memory shards to the worker: on leaving, every
        one is applied, before the pass's statistics are read and the next forward gathers the
        shards. Every collective of the work is done by then, so a worker's error raised here
        leaves no peer waiting mid-pass. On an error, `on_error` runs first, then the worker is
        joined without raising its own error: no update is left running, and the first error wins."""
        try:
            yield
        except BaseException:
            for abandon in on_error:
                abandon()
            if self.host is not None:
                self.host.join(raise_failure=False)
            raise
        if self.host is not None:
            self.host.join()


class SliceRoute:
    """The buckets' `on_bucket`: each reduced bucket (this rank's summed slice of each of its
    parameters) goes where the pass's `mode` says, the slices of shards in host memory through
    `staging` to the worker."""

    def __init__(self, staging: HostStaging, updater, accumulator):
        self.staging, self.updater, self.accumulator = staging, updater, accumulator
        self.mode = BucketMode.UPDATE  # what the buckets' reduced slices are for in this backward

    def __call__(self, items: list[tuple[torch.nn.Parameter, torch.Tensor]], stats) -> None:
        items = self.staging.stage(items, stats, self.mode)
        if self.mode is BucketMode.ADD:
            for param, grad_shard in items:
                self.accumulator.add(param, grad_shard)
        elif items:
            self.updater.apply_bucket([(p, self.update_grad(p, g)) for p, g in items], stats)

    def update_grad(self, param: torch.nn.Parameter, grad_shard: torch.Tensor):
        """What the update steps by: the reduced slice, or in a FOLD pass the window's sum with it."""
        if self.mode is BucketMode.FOLD:
            return self.accumulator.lazy_total(param, self.updater.slice_device(param), grad_shard)
        return grad_shard
