"""A probe of a process's peak anonymous resident memory over a block of code (Linux): a thread
reads RssAnon from /proc/self/status every millisecond. Anonymous memory is what a process holds
itself (tensors, buffers); file pages a memory map reads count apart and the kernel can drop them."""
from __future__ import annotations

import ctypes
import gc
import threading
import time


def rss_anon_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no RssAnon line")


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 (glibc: both exist)
        return libc
    except (OSError, AttributeError):
        return None


class AnonPeak:
    """`with AnonPeak() as probe: ...`; then probe.above_start: the peak during the block minus the
    value at its start, in bytes. Under glibc, for the block, every allocation of 64 KiB or more is
    its own memory map, given back when freed, so the figure is the memory the block held at once,
    not what the heap's holes kept (with glibc's defaults a heap grown by many freed tensors of
    varied sizes stays grown)."""

    def __init__(self, interval_s: float = 0.001):
        self.interval_s = interval_s
        self.start = self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon_bytes())
            time.sleep(self.interval_s)

    def __enter__(self) -> "AnonPeak":
        # Free memory the allocator kept from earlier work goes back to the system first, or the
        # block could reuse it without its resident memory growing.
        gc.collect()
        libc = _libc()
        if libc is not None:
            libc.mallopt(M_MMAP_THRESHOLD, 64 << 10)
            libc.mallopt(M_TRIM_THRESHOLD, 64 << 10)
            libc.malloc_trim(0)
        self.start = self.peak = rss_anon_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon_bytes())
        libc = _libc()
        if libc is not None:  # glibc's defaults (the thresholds stay fixed from now on)
            libc.mallopt(M_MMAP_THRESHOLD, 128 << 10)
            libc.mallopt(M_TRIM_THRESHOLD, 128 << 10)

    @property
    def above_start(self) -> int:
        return self.peak - self.start


def live_tensor_bytes() -> int:
    """The bytes of every tensor storage Python can reach now (after a collection), each counted once:
    what a process holds, without what its allocator keeps of memory already freed."""
    import torch

    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if torch.is_tensor(obj) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total
