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
happens at the next bucket, when the copy is done), and at the update the sum is copied back
without blocking. On a CPU rank host memory is the device, and with `offload_param: cpu` the
shards (and so the accumulator, which lives with them) are in host memory already.
"""
from __future__ import annotations

import threading

import torch

from lomo_ds.runtime import ds_compat

ACCUMULATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_window(micro_batches: int, accumulation_steps: int, accumulated: int) -> None:
    """start_window's rule, for every engine: a window of 1..accumulation_steps micro-batches, set
    before its first (`accumulated`: micro-batches of the current window already taken)."""
    if accumulated:
        raise RuntimeError(f"start_window: {accumulated} micro-batch(es) of the current window are "
                           "already accumulated; call it before a window's first micro-batch")
    if not 1 <= micro_batches <= accumulation_steps:
        raise ValueError(f"start_window: expected 1..{accumulation_steps} micro-batches, got {micro_batches}")


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
        # Host copies of slices still in flight: (buffer, staged copy, event), added at the next bucket.
        self._pending: list[tuple[torch.Tensor, torch.Tensor, object]] = []
        # With offloaded shards the host-update worker adds and totals their buffers while the
        # backward's thread may stage slices of shards on the device (host_updates.py).
        self._lock = threading.Lock()

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

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
        # Device slice, host buffer: copy without blocking; the add waits for the copy at the next
        # bucket (or at settle()), so the copy overlaps the backward's next kernels.
        with self._lock:
            self._settle()
            staged = real.to(buf.device, non_blocking=True)
            event = torch.cuda.Event() if real.device.type == "cuda" else None
            if event is not None:
                event.record()
            self._pending.append((buf, staged, event))

    def settle(self) -> None:
        """Finish the host adds whose copies were still in flight."""
        with self._lock:
            self._settle()

    def _settle(self) -> None:
        for buf, staged, event in self._pending:
            if event is not None:
                event.synchronize()
            buf.add_(staged)
        self._pending.clear()

    def total(self, param: torch.nn.Parameter, device: torch.device, grad_shard: torch.Tensor | None = None
              ) -> torch.Tensor:
        """The accumulated gradient of the parameter's real elements, fp32 on `device`, plus
        `grad_shard` (the last micro-batch's slice) when given. Ours to overwrite: the buffer itself
        when it is fp32 and on `device`, else a copy (the buffer is zeroed after the step anyway)."""
        self.settle()
        buf = self.buffer(param)
        total = buf.to(device, torch.float32, non_blocking=True)
        if grad_shard is not None and buf.numel():
            total.add_(grad_shard[:buf.numel()].to(device, torch.float32))
        return total

    def lazy_total(self, param: torch.nn.Parameter, device: torch.device, grad_shard: torch.Tensor | None = None
                   ) -> "AccumulatedSlice":
        """`total`, read chunk by chunk by the update (fused_update.grad_chunk): no fp32 copy of the
        whole slice where the buffer is not fp32 on `device`."""
        self.settle()
        buf = self.buffer(param)
        return AccumulatedSlice(buf, None if grad_shard is None else grad_shard[:buf.numel()], device)

    def sum_of_squares(self, params) -> float:
        """This rank's share of the squared global norm of the accumulated gradient (fp32 per
        tensor, summed in fp64 as torch's clip_grad_norm_ does); inf when something overflowed."""
        self.settle()
        total = 0.0
        for p in params:
            buf = self.buffer(p)
            if buf.numel():
                total += float(torch.linalg.vector_norm(buf, dtype=torch.float32)) ** 2
        return total

    def zero(self) -> None:
        self.settle()
        for b in self.buffers.values():
            b.zero_()


class AccumulatedSlice:
    """A parameter's accumulated gradient slice (plus the window's last slice, when given), as
    the chunked update reads it: `chunk(a, b, device)` is `total(...)[a:b]`, elementwise the same
    arithmetic; `in_place` the whole of it without a copy, where the buffer is fp32 on the device."""

    def __init__(self, buffer: torch.Tensor, extra: torch.Tensor | None, device: torch.device):
        self.buffer, self.extra, self.device = buffer, extra, device

    def chunk(self, a: int, b: int, device: torch.device) -> torch.Tensor:
        total = self.buffer[a:b].to(device, torch.float32, non_blocking=True)
        if self.extra is not None:
            total.add_(self.extra[a:b].to(device, torch.float32))
        return total

    def in_place(self, n: int, device: torch.device) -> torch.Tensor | None:
        if self.buffer.dtype != torch.float32 or self.buffer.device != device:
            return None
        return self.chunk(0, n, device)  # the buffer itself (zeroed after the step), the last slice added
