"""A CPU rank keeps freed memory for reuse (lomo_ds/runtime/host_malloc.py): a block freed and
allocated again is not page-faulted in anew. Each check runs in a fresh interpreter, whose malloc
has not been tuned yet."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

# Allocate, touch and free a 64 MiB block (above glibc's largest mmap threshold) 12 times, as steps
# do; the page faults of the last 4 rounds, and the line keep_freed_memory returned (None: not
# called). The first rounds may grow the heap (a small allocation can land after the freed block,
# which then no longer fits the next request); in 6 runs it had stopped growing by the 5th round.
PROBE = """
import json, resource, sys, torch
line = None
if sys.argv[1] == "keep":
    from lomo_ds.runtime.host_malloc import keep_freed_memory
    line = keep_freed_memory()
faults = []
for _ in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.empty(16 * 2**20)
    block.fill_(1.0)
    del block
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"faults": sum(faults[-4:]), "line": line}))
"""
ROUNDS = 4  # the rounds counted
PAGES = 64 * 2**20 // 4096


def probe(mode: str, **env) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("MALLOC_") and k not in ("LD_PRELOAD", "LOMO_DS_KEEP_FREED_MEMORY")}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env={**clean, **env}, capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_blocks_are_reused_without_page_faults():
    untuned, kept = probe("as is"), probe("keep")
    # As glibc ships: the block is mmapped afresh each round, every page faulted in (and zeroed).
    assert untuned["faults"] >= ROUNDS * PAGES * 0.9, untuned
    # Kept: once the heap has grown to the step's size, its block is reused, no page faulted again.
    assert kept["faults"] < PAGES * 0.05, kept
    assert kept["line"].startswith("freed memory kept for the next step"), kept


def test_the_users_allocator_choice_and_the_switch_are_honoured():
    chosen = probe("keep", MALLOC_ARENA_MAX="2")
    assert chosen["line"] == "malloc as the environment sets it (MALLOC_ARENA_MAX)", chosen
    assert chosen["faults"] >= ROUNDS * PAGES * 0.9, chosen  # mallopt was not called
    switched_off = probe("keep", LOMO_DS_KEEP_FREED_MEMORY="0")
    assert switched_off["line"] == "glibc's malloc as it is (LOMO_DS_KEEP_FREED_MEMORY=0)", switched_off
    assert switched_off["faults"] >= ROUNDS * PAGES * 0.9, switched_off
