"""Gradient accumulation on shards: this rank's running sum of its reduced gradient slices.

LOMO never keeps a gradient, so accumulation cannot be the usual "sum into .grad" (a whole
model's gradient on every rank). On ZeRO-3 it does not have to be: after each bucket's
reduce-scatter a rank holds the summed gradient of its own slice of every parameter of the bucket,
and that slice is all the update of its shard ever reads. So each rank keeps one accumulator of
its real shard elements (1/N of the model, fp32 by default) and adds every micro-batch's slices
into it; a step is taken from the accumulated sum once per window of K micro-batches:

  fused      (no norm clipping, no loss scaling, accumulator not fp16) the K-th backward adds each
             bucket's slices and applies the update from the sum at once, bucket by bucket: the
             accumulator is read once more than a K = 1 step reads its gradient, no extra pass.
  one pass   (norm clipping, loss scaling, an fp16 accumulator) the K-th backward only adds, and
             measures the sum of squares of each completed accumulator slice; after it, one
             all-reduce of per-rank sums gives the exact global norm of the accumulated gradient
             (non-finite on overflow), and the update runs as one pass over the accumulated
             shards, bucket by bucket in the shared layout (AdaLomo's statistics collectives then
             come in the same order on every rank). No second backward: a K = 1 step needs one
             only because it has nowhere to keep the gradient while the norm is being learnt.

`accumulate_on: cpu` keeps the sums in pinned host memory, for models where even 1/N in fp32 does
not fit beside the activations: each slice is copied over without blocking the backward (the add
happens once its copy has finished: polled at the next buckets, waited for only when too many
bytes are in flight), and at the update the sum is copied back without blocking. The device reads
those copies after the host has moved on, so a buffer is zeroed only once every copy read from it
is done (an event per copy, waited for in zero()). On a CPU rank host memory is the device, and
with `offload_param: cpu` the shards (and so the accumulator, which lives with them) are in host
memory already.
"""
from __future__ import annotations

import threading

import torch

from lomo_ds.runtime import ds_compat
from lomo_ds.runtime.device import record_event

ACCUMULATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Staged device-to-host slices not yet added: past this, add() waits for the oldest copy instead of
# letting pinned staging grow (a few buckets' worth keeps the backward from ever waiting on one).
MAX_PENDING_BYTES = 256 << 20


def read_async(buf: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, object | None]:
    """`buf` as fp32 on `device`, copied without blocking when it lives elsewhere; the event after
    the copy (None: no copy in flight). `buf` must not be written before that event has passed."""
    out = buf.to(device, torch.float32, non_blocking=True)
    return out, (record_event(device) if buf.device != device else None)


def check_window(micro_batches: int, accumulation_steps: int, accumulated: int) -> None:
    """start_window's rule, for every engine: a window of 1..accumulation_steps micro-batches, set
    before its first (`accumulated`: micro-batches of the current window already taken)."""
    if accumulated:
        raise RuntimeError(f"start_window: {accumulated} micro-batch(es) of the current window are "
                           "already accumulated; call it before a window's first micro-batch")
    if not 1 <= micro_batches <= accumulation_steps:
        raise ValueError(f"start_window: expected 1..{accumulation_steps} micro-batches, got {micro_batches}")


def accumulator_for(memory, accumulation_steps: int, params: list[torch.nn.Parameter], local_elements
                    ) -> "ShardAccumulator | None":
    """The engine's accumulator by its `memory` section (accumulate_dtype, accumulate_on); None for
    windows of one micro-batch, which accumulate nothing."""
    if accumulation_steps <= 1:
        return None
    return ShardAccumulator(params, local_elements, ACCUMULATE_DTYPES[memory.accumulate_dtype],
                            memory.accumulate_on == "cpu")


class ShardAccumulator:
    """One buffer of this rank's real elements per parameter, in `dtype`, zero between windows."""

    def __init__(self, params: list[torch.nn.Parameter], local_elements, dtype: torch.dtype, on_host: bool):
        """`local_elements(param)`: the real elements of the parameter on this rank (its shard
        geometry); `on_host`: pinned host memory instead of the shard's device."""
        self.dtype = dtype
        self.buffers: dict[int, torch.Tensor] = {}
        for p in params:
            shard_device = ds_compat.shard(p).device
            device = torch.device("cpu") if on_host else shard_device
            # Pinned only where there is a device to copy from (pinning needs an accelerator).
            pin = on_host and shard_device.type != "cpu"
            self.buffers[ds_compat.param_id(p)] = torch.zeros(local_elements(p), dtype=dtype, device=device,
                                                              pin_memory=pin)
        # Host copies of slices still in flight: (buffer, staged copy, event), added once done.
        self._pending: list[tuple[torch.Tensor, torch.Tensor, object]] = []
        self._pending_bytes = 0
        # Events after the device copies that read the buffers (AccumulatedSlice.chunk): zero() waits for them.
        self._reads: list[object] = []
        # With offloaded shards the host-update worker adds and totals their buffers while the
        # backward's thread may stage slices of shards on the device (host_updates.py).
        self._lock = threading.Lock()

    def nbytes(self, device: torch.device | None = None) -> int:
        """The buffers' bytes (those on `device`, when given)."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values() if device in (None, b.device))

    def buffer(self, param: torch.nn.Parameter) -> torch.Tensor:
        return self.buffers[ds_compat.param_id(param)]

    def add(self, param: torch.nn.Parameter, grad_shard: torch.Tensor) -> None:
        """Add a reduced slice (padding included) into the parameter's buffer."""
        buf = self.buffer(param)
        if buf.numel() == 0:
            return
        real = grad_shard[:buf.numel()]
        if real.device == buf.device:
            buf.add_(real)
            return
        # Device slice, host buffer: copy without blocking; the add happens once the copy is done,
        # polled here at later buckets (no host sync), so the copy overlaps the backward's kernels.
        with self._lock:
            self._settle(block=False)
            staged = real.to(buf.device, non_blocking=True)
            self._pending.append((buf, staged, record_event(real.device)))
            self._pending_bytes += staged.numel() * staged.element_size()

    def settle(self) -> None:
        """Finish the host adds whose copies were still in flight."""
        with self._lock:
            self._settle()

    def _settle(self, block: bool = True) -> None:
        """Add the staged slices whose copies are done, oldest first: all of them (block), or those
        finished by now plus the oldest while more than MAX_PENDING_BYTES are in flight."""
        while self._pending:
            buf, staged, event = self._pending[0]
            if event is not None and not event.query():
                if not block and self._pending_bytes <= MAX_PENDING_BYTES:
                    return
                event.synchronize()
            buf.add_(staged)
            self._pending.pop(0)
            self._pending_bytes -= staged.numel() * staged.element_size()

    def lazy_total(self, param: torch.nn.Parameter, device: torch.device, grad_shard: torch.Tensor | None = None
                   ) -> "AccumulatedSlice":
        """The accumulated gradient of the parameter's real elements, fp32 on `device`, plus
        `grad_shard` (the last micro-batch's slice) when given, read chunk by chunk by the update
        (update/shard.py grad_chunk): no fp32 copy of the whole slice where the buffer is not fp32 on
        `device`. The last slice is added once, whoever reads the sum how often: into an fp32
        buffer on `device` at once (the buffer is zeroed after the step), else to each chunk read
        (not into a bf16 buffer, whose rounding would take the sum's last bits, nor across devices)."""
        self.settle()
        buf = self.buffer(param)
        extra = None if grad_shard is None else grad_shard[:buf.numel()]
        if extra is not None and buf.dtype == torch.float32 and buf.device == device:
            buf.add_(extra)
            extra = None
        return AccumulatedSlice(buf, extra, device, self)

    def note_read(self, event) -> None:
        """A copy that reads a buffer is in flight until `event`: zero() waits for it."""
        if event is not None:
            with self._lock:
                self._reads.append(event)

    def sum_of_squares(self, params) -> torch.Tensor:
        """This rank's share of the squared global norm of the accumulated gradient (fp32 per
        tensor, summed in fp64 as torch's clip_grad_norm_ does; inf when something overflowed), as
        a CPU fp64 scalar. Summed on each buffer's device and read once per device at the end, not
        once per tensor (each read of a device tensor waits for the device)."""
        self.settle()
        totals: dict[torch.device, torch.Tensor] = {}
        for p in params:
            buf = self.buffer(p)
            if buf.numel():
                sq = torch.linalg.vector_norm(buf, dtype=torch.float32).to(torch.float64) ** 2
                totals[buf.device] = totals[buf.device] + sq if buf.device in totals else sq
        total = torch.zeros((), dtype=torch.float64, device="cpu")
        for t in totals.values():
            total += t.cpu()
        return total

    def zero(self) -> None:
        """Zero every buffer for the next window, once the device has finished reading them: a
        copy the step's update started may still be in flight when the host gets here (nothing else waits
        for it on the path that applies the step after the backward)."""
        self.settle()
        with self._lock:
            reads, self._reads = self._reads, []
        for event in reads:
            event.synchronize()
        for b in self.buffers.values():
            b.zero_()


class AccumulatedSlice:
    """A parameter's accumulated gradient slice (plus the window's last slice, when given), as
    the chunked update reads it: `chunk(a, b, device)` is elements [a, b) of the sum, fp32 on
    `device`; `in_place` the whole of it without a copy, where the buffer is fp32 on the device."""

    def __init__(self, buffer: torch.Tensor, extra: torch.Tensor | None, device: torch.device,
                 accumulator: ShardAccumulator | None = None):
        """`accumulator`: the buffer's owner, told of every copy that reads the buffer (its zero()
        waits for them)."""
        self.buffer, self.extra, self.device, self.accumulator = buffer, extra, device, accumulator

    def chunk(self, a: int, b: int, device: torch.device, fresh: bool = False) -> torch.Tensor:
        """Elements [a, b) of the sum; never writes the buffer. `fresh`: a new tensor (else, where
        the buffer is fp32 on `device` and no last slice is pending, a view of it: read only)."""
        total, event = read_async(self.buffer[a:b], device)
        if self.accumulator is not None:
            self.accumulator.note_read(event)  # the buffer is zeroed only once the copy has read it
        if self.extra is not None:
            return total + self.extra[a:b].to(device, torch.float32)  # a new tensor: the buffer is not written
        if fresh and total.data_ptr() == self.buffer[a:b].data_ptr():
            return total.clone()  # fp32 on `device` already, so a view of the buffer: the caller writes it
        return total

    def resident(self, device: torch.device) -> bool:
        """Whether reading the sum on `device` copies nothing across devices."""
        return self.buffer.device == device and (self.extra is None or self.extra.device == device)

    def in_place(self, n: int, device: torch.device) -> torch.Tensor | None:
        """The buffer itself, where it is fp32 on `device` and holds the whole sum (lazy_total
        added the last slice into it); else None (read it by chunks)."""
        if self.buffer.dtype != torch.float32 or self.buffer.device != device or self.extra is not None:
            return None
        return self.buffer[:n]
