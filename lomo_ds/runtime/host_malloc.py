"""The C allocator of a CPU rank: freed memory kept for the next step instead of handed back.

A CPU step allocates the same large tensors every step (gathered parameters, activations,
gradients, logits) and frees them again. glibc's malloc serves a block of 32 MiB or more (and
smaller ones, until its dynamic threshold has grown) with a fresh mmap, and hands it back with
munmap on free; the top of its heap is trimmed as soon as 128 KiB lie free there. Every step then
page-faults its working set in again, and the kernel zeroes each page first: in a profile of the
CPU benchmark's floor (benchmarks/bench_fsdp.py) the zeroing is a visible share of a step's
profile. How much of it a step pays moves with the process's other allocations (glibc's threshold adapts to
the blocks freed last), so step times also jumped between runs.

`keep_freed_memory` turns both off for the process (mallopt): no mmap for any block, and the heap
trimmed only above 2 GiB free. The price is resident memory: it stays at its peak between steps,
and the heap holds holes that a block of another size cannot reuse (`make demo`'s step time and
peak, with and without: docs/results.md). LOMO_DS_KEEP_FREED_MEMORY=0 leaves
malloc as it is; so does a MALLOC_* variable or a preloaded jemalloc / tcmalloc (the user chose),
or a C library other than glibc.
"""
from __future__ import annotations

import ctypes
import os
import platform

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
TRIM_ABOVE = 2**31 - 1  # bytes free at the heap's top before it is trimmed: mallopt takes an int
_PRELOADED = ("jemalloc", "tcmalloc", "mimalloc")
ENV = "LOMO_DS_KEEP_FREED_MEMORY"


def keep_freed_memory() -> str:
    """Keep freed memory in this process for reuse (see the module's docstring). Returns what was
    decided, for the run's `host memory:` line."""
    if os.environ.get(ENV, "1") == "0":
        return f"glibc's malloc as it is ({ENV}=0)"
    chosen = sorted(k for k in os.environ if k.startswith("MALLOC_"))
    preloaded = [lib for lib in _PRELOADED if lib in os.environ.get("LD_PRELOAD", "")]
    if chosen or preloaded:
        return f"malloc as the environment sets it ({', '.join(chosen + preloaded)})"
    if platform.libc_ver()[0] != "glibc":
        return "the C library's malloc, as it is (not glibc)"
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, TRIM_ABOVE)):
        return "glibc's malloc, as it is (mallopt refused)"
    return f"freed memory kept for the next step (glibc malloc: no mmap, trim above 2 GiB; {ENV}=0 to not)"
