"""What every multi-rank check script shares: run its checks in one launch, record each one's
figures (or its traceback), and let rank 0 write them for the pytest side to assert on."""
from __future__ import annotations

import json
import time
import traceback
from typing import Any, Callable

import torch


def run_checks(checks: dict[str, Callable[[], Any]], out_path: str, only: str | None = None) -> None:
    """Run `checks` (a subset: the comma-separated names in `only`) in order on every rank; a check
    that raises is recorded as {"error": traceback} so the others still run."""
    results, seconds = {}, {}
    for name, fn in checks.items():
        if only and name not in only.split(","):
            continue
        t0 = time.perf_counter()
        try:
            results[name] = fn()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        torch.distributed.barrier()
        seconds[name] = round(time.perf_counter() - t0, 2)
    results["_seconds"] = seconds  # what each check costs, to keep the suite's launches short
    if torch.distributed.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
