"""Updates of shards in host memory (`offload_param: cpu`) on a worker thread, overlapped with the backward.

With `offload_param: {device: cpu}` each rank's shards live in host memory while the backward runs
on the accelerator. Updating them inside the gradient hook makes the backward wait, bucket by
bucket, for a blocking copy of every slice into pageable memory and then for the CPU's update.
Instead, for the shards in host memory:

  stage   in the hook, each reduced slice's real elements, and the pass's finite flag as of this
          bucket, are copied without blocking into page-locked host buffers, on a copy stream that
          first waits for the compute stream (the slices were reduced there); an event is
          recorded after the copies. The hook returns at once.
  update  one worker thread, put on the rank's device first (a new thread starts on the first),
          takes the staged buckets first in, first out, waits for each one's event (on its own
          thread: the backward never waits for a copy) and applies the update in host memory. At
          most MAX_STAGED buckets wait for it (host memory stays O(bucket)); beyond that the hook
          waits for the worker.
  join    the engine joins the worker at the end of every backward pass, after the buckets'
          flush: before the pass's statistics are read and before the next forward gathers the
          updated shards. An error raised in the worker is raised there, naming the parameter.

The worker issues no collective: ranks must issue theirs in one order, from the thread that runs
ZeRO-3's gathers. So only work without one goes to it: SGD's update, the accumulator's adds and
the fused update from the accumulated sum, and the host part of AdaLomo's update. AdaLomo makes
two small all-reduces per bucket: they, its statistics and its coefficients stay in the hook, on
the device where the reduced slices are, and the worker gets each slice's normalised update u
with its two coefficients and applies θ = θ * decay - coef * u (update/adalomo.py). The measuring pass
of norm clipping stays in the hook too (it never touches a shard: it sums squares on the device).

On a CPU rank the slices are in host memory already: nothing is staged, and no pinned memory is
asked for (page-locked memory is for an accelerator to copy into). The worker still runs when
`memory.host_update` is "thread", which is how the CPU tests exercise this path.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, NamedTuple

import torch

from lomo_ds.runtime import ds_compat

# Buckets staged ahead of the worker. Each holds one bucket's slices in pinned host memory; four
# let the worker fall a few buckets behind a burst of small ones without making the hook wait.
MAX_STAGED = 4

Apply = Callable[[torch.nn.Parameter, torch.Tensor, torch.Tensor], None]


def host_buffer(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A staging buffer in host memory; page-locked when an accelerator copies into it (a
    non_blocking copy into pageable memory is a synchronous one)."""
    return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pin)


def _can_pin() -> bool:
    """Whether this accelerator's torch gives page-locked host memory. One that does not still
    works, its non_blocking copies into pageable buffers then being synchronous."""
    try:
        host_buffer(1, torch.uint8, pin=True)
    except RuntimeError:
        return False
    return True


def use_thread(mode: str, device: torch.device, int8_shards: bool = False) -> bool:
    """memory.host_update: "thread", "inline", or "auto": a thread when the ranks compute on an
    accelerator (the host is idle while the backward runs there), inline on CPU ranks (the shards
    are already where the backward runs, and a thread would compete with it for the same cores)
    and with 8-bit shards (a block cut between ranks needs a collective, which the worker cannot
    issue: engine/update/int8.py)."""
    if mode == "auto":
        return device.type != "cpu" and not int8_shards
    return mode == "thread"


class _Job(NamedTuple):
    items: list[tuple[torch.nn.Parameter, torch.Tensor]]  # (parameter, its real elements in host memory)
    finite: torch.Tensor  # the pass's finite flag as of this bucket, in host memory
    event: object | None  # recorded after the copies (None: nothing was copied)
    apply: Apply


class HostUpdates:
    """One backward pass's updates of shards in host memory, on one worker thread, in order.
    `name_of(param)` names a parameter in errors."""

    def __init__(self, device: torch.device, name_of: Callable[[torch.nn.Parameter], str],
                 max_staged: int = MAX_STAGED):
        self.device = device
        self.name_of = name_of
        self.max_staged = max_staged
        # Staging, pinned buffers and the copy stream exist only where an accelerator computes.
        self.staged = device.type != "cpu"
        self.pin = False
        self.device_index: int | None = None
        if self.staged:
            from deepspeed.accelerator import get_accelerator

            self.accelerator = get_accelerator()
            self.stream = self.accelerator.Stream()
            self.pin = _can_pin()
            # An accelerator's current device is per thread, and a new thread starts on the first
            # one: the worker sets this rank's first (_run), or the first call it makes without
            # naming a device (an event's wait) would open a context on another rank's GPU, memory
            # no allocator statistic of this rank shows. Read here, on the thread that set it.
            self.device_index = device.index if device.index is not None else self.accelerator.current_device()
        self._jobs: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._failure: tuple[torch.nn.Parameter | None, BaseException] | None = None
        self.applied = 0  # slices the worker has applied (a figure for tests and benchmarks)

    @staticmethod
    def holds(param: torch.nn.Parameter) -> bool:
        """Whether this parameter's update goes to the worker: its shard is in host memory."""
        return ds_compat.shard(param).device.type == "cpu"

    def submit(self, items: list[tuple[torch.nn.Parameter, torch.Tensor]], finite: torch.Tensor,
               apply: Apply) -> None:
        """Queue `apply(param, slice, finite)` for each (param, real elements of its reduced slice,
        or AdaLomo's u and coefficients for it) of one bucket, `finite` being the pass's flag as of
        this bucket; returns once the copies are issued, before anything is applied."""
        job = self._stage(items, finite, apply)
        if self._thread is None:
            self._jobs = queue.Queue(maxsize=self.max_staged)
            # One thread per pass, joined at its end: the updates of a pass run in the order the
            # buckets came (the stochastic-rounding draws included, as inline), and no thread
            # outlives the pass that started it.
            self._thread = threading.Thread(target=self._run, args=(self._jobs,), name="lomo-host-update",
                                            daemon=True)
            self._thread.start()
        self._jobs.put(job)  # waits while max_staged buckets are staged: host memory stays bounded

    def _stage(self, items, finite: torch.Tensor, apply: Apply) -> _Job:
        if not self.staged:
            # Already in host memory: the slices are views of this bucket's receive buffer, which
            # nothing else reads; the flag is copied, since later buckets fold into it in place.
            return _Job(list(items), finite.clone(), None, apply)
        accelerator = self.accelerator
        # Cloned on the compute stream, in order: later buckets fold into `finite` in place there,
        # and the copy stream must not read it after they did.
        flag = finite.clone()
        self.stream.wait_stream(accelerator.current_stream())
        sizes: dict[torch.dtype, int] = {}
        for _, g in items:
            sizes[g.dtype] = sizes.get(g.dtype, 0) + g.numel()
        staged = []
        with accelerator.stream(self.stream):
            buffers = {dtype: host_buffer(n, dtype, pin=self.pin) for dtype, n in sizes.items()}
            at = dict.fromkeys(buffers, 0)
            for param, g in items:
                dst = buffers[g.dtype][at[g.dtype]:at[g.dtype] + g.numel()]
                at[g.dtype] += g.numel()
                dst.copy_(g.reshape(-1), non_blocking=True)
                staged.append((param, dst))
            host_flag = host_buffer(1, torch.bool, pin=self.pin)
            host_flag.copy_(flag.reshape(1), non_blocking=True)
            event = accelerator.Event()
            event.record(self.stream)
        for t in [g for _, g in items] + [flag]:
            if t.device.type != "cpu":
                # Read by the copy stream: the caching allocator must not hand the memory to the
                # compute stream before the copy has read it.
                t.record_stream(self.stream)
        return _Job(staged, host_flag[0], event, apply)

    def _run(self, jobs: queue.Queue) -> None:
        if self.device_index is not None:
            try:
                self.accelerator.set_device(self.device_index)  # this rank's device (__init__)
            except BaseException as error:  # raised by join, on the caller's thread
                self._failure = (None, error)
        while True:
            job = jobs.get()
            if job is None:
                return
            if self._failure is not None:
                continue  # the pass has failed: apply nothing more, join raises
            param = job.items[0][0] if job.items else None
            try:
                if job.event is not None:
                    job.event.synchronize()  # this thread waits for the copies, not the backward
                for param, g in job.items:
                    job.apply(param, g, job.finite)
                    self.applied += 1
            except BaseException as error:  # raised by join, on the caller's thread
                self._failure = (param, error)

    def join(self, raise_failure: bool = True) -> None:
        """Wait until every queued update is applied; raise the worker's error, naming the
        parameter (`raise_failure` False: the caller is already raising an error of its own)."""
        if self._thread is None:
            return
        self._jobs.put(None)
        self._thread.join()
        self._thread = self._jobs = None
        failure, self._failure = self._failure, None
        if failure is not None and raise_failure:
            param, error = failure
            name = self.name_of(param) if param is not None else "?"
            raise RuntimeError(f"the update of {name!r} (shard in host memory) failed on the host-update thread: "
                               f"{type(error).__name__}: {error}") from error
