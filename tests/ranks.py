"""Multi-rank checks, declared beside their assertions and run in ONE launch per world size.

Rank start-up (torch, DeepSpeed and transformers imported on every rank) is the slow part on a
CPU, so every check of a world size shares one `torchrun` launch of this module. A check is a
function that runs on every rank of that launch and returns rank 0's figures (JSON); the test
beside it asserts on them.

How to add a multi-rank check
-----------------------------
In the test module that asserts on it (tests/<package>/test_*.py; tests/comm/test_buckets.py is an example):

    from tests.ranks import multi_rank, ok

    @multi_rank(worlds=(1, 2, 3))
    def sgd_matches():                  # on every rank; the same collectives in the same order on each
        engine = ...                    # build its own engine (nothing carries over between checks)
        return {"max_abs_diff": d}      # JSON figures; rank 0's are kept

    @pytest.mark.parametrize("world", [1, 2, 3])
    def test_sgd(rank_results, world):  # rank_results: the fixture in tests/conftest.py
        assert ok(rank_results(world), sgd_matches)["max_abs_diff"] <= 1e-6

- Many similar checks at once: `CHECKS = multi_rank_checks((1, 2, 3), plain=lambda: ..., tied=lambda: ...)`,
  a list to parametrize over (`ids=str`).
- `first=True` runs a check before the others of its launch (the planner's memory is measured in a
  process no check has used yet). `work_dir()` is a folder the launch may write into.
- A check that raises is recorded with its traceback; `ok` fails the test with it, the others still run.
- Keep each check to a few seconds: the launch records what each took under "_seconds" (wall) and
  "_cpu_seconds" (rank 0's CPU: the figure to compare on a busy machine).
- A test that needs a run of the training program (or another program's main) runs it inside the
  launch with `run_here(main, argv)` from a check, unless the test is about the command line or
  the launcher themselves: a launch of its own costs every rank's start-up again.
- `pytest tests/comm/test_buckets.py` launches only that module's checks; LOMO_CHECKS=key,key (keys
  "test_buckets/sgd_shared_memory", or a module "test_buckets/") narrows any launch further.

The launch (`python -m tests.ranks OUT.json MODULE...`) imports the modules that declared checks
for its world size, so a module with checks must import without side effects (the GPU-only
modules skip themselves before their checks are declared).
"""
from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANK_ABORT = "terminate called without an active exception"
LAUNCH_ERROR = "_launch_error"  # a world size's results when its launch failed: why


@dataclass(frozen=True)
class Check:
    key: str  # "<test module>/<name>": what LOMO_CHECKS and the results use
    module: str
    fn: Callable[[], Any] = field(compare=False)
    worlds: tuple[int, ...]
    first: bool = False
    two_in_ci_only: bool = False  # declared on 1, 2 and 3 ranks: 2 runs with the long checks only

    def __str__(self) -> str:
        return self.key.split("/", 1)[1]


# The long checks (launch after launch, or many runs in a launch) run where LOMO_DS_LONG_TESTS=1: in CI
# (.ci/run), not in a newcomer's `make test`, whose six minutes on two cores they would pass. A long
# multi-rank check is declared only where they run, so that no launch spends their time otherwise.
LONG_TESTS = os.environ.get("LOMO_DS_LONG_TESTS") == "1"

REGISTRY: dict[str, Check] = {}  # in declaration order
_work_dir: str | None = None


def _declaring_module() -> str:
    """The module that declares a check: the first caller outside this one (it is what the launch imports)."""
    frame = sys._getframe(1)
    while frame.f_globals.get("__name__") in (__name__, "tests.ranks"):
        frame = frame.f_back
    return frame.f_globals["__name__"]


def _register(name: str, fn: Callable[[], Any], worlds: Iterable[int], first: bool) -> Check:
    module = _declaring_module()
    worlds = tuple(worlds)
    # A check declared on 1, 2 and 3 ranks runs on 1 (one process) and 3 (uneven shards) in a
    # newcomer's suite; 2 adds no case they lack, and the 2-rank launch is the suite's longest (its
    # tests are skipped as long checks). CI (LOMO_DS_LONG_TESTS=1) runs all three.
    thinned = not LONG_TESTS and {1, 2, 3} <= set(worlds)
    if thinned:
        worlds = tuple(w for w in worlds if w != 2)
    check = Check(f"{module.rsplit('.', 1)[-1]}/{name}", module, fn, worlds, first, thinned)
    if check.key in REGISTRY and REGISTRY[check.key].fn is not fn:
        raise ValueError(f"multi-rank check {check.key!r} declared twice")
    REGISTRY[check.key] = check
    return check


def multi_rank(worlds: Iterable[int], first: bool = False, name: str | None = None):
    """Decorator: declare the function a multi-rank check on each of `worlds` (its ranks)."""
    return lambda fn: _register(name or fn.__name__, fn, worlds, first)


def multi_rank_checks(worlds: Iterable[int], **fns: Callable[[], Any]) -> list[Check]:
    """Declare several checks at once (name=function), each on every one of `worlds`."""
    worlds = tuple(worlds)
    return [_register(name, fn, worlds, False) for name, fn in fns.items()]


def long_unless_declared(check: Check, world: int | None = None) -> list:
    """The marks of a test of `check` on `world` (on any rank count if None): long where this suite
    did not declare the check there (a long check is declared only where the long checks run)."""
    import pytest  # the pytest side only: ranks import this module too

    declared = bool(check.worlds) if world is None else world in check.worlds
    return [] if declared else [pytest.mark.long]


def work_dir() -> str:
    """A folder of this launch that the pytest side can read after it (the results file's)."""
    if _work_dir is None:
        raise RuntimeError("work_dir() is only known inside a launch of tests.ranks")
    return _work_dir


def run_here(main: Callable[[list[str]], int], argv: list[str], env: dict | None = None) -> dict:
    """Collective: a program's main(argv) (the training program's, lomo_ds.recipe.train.main) on every
    rank of this launch, in this process, as a launch of its own would run it without its ranks'
    start-up (seconds of imports per rank on a CPU): {"rc": its return code, "stdout": what rank 0
    printed}. For a check about what the program does, not about its command line or launcher.

    What the program sets for its whole process is put back after it, so that the checks after it
    run as they would without it: warning filters, the libraries' loggers and progress bars, torch's
    threads and random generators (numpy's, Python's), and the environment. `env` is set for the
    call only; LOMO_DS_KEEP_FREED_MEMORY=0 unless it says otherwise (glibc's malloc, once told to
    keep freed memory, cannot be told back, and later checks measure resident memory)."""
    import io
    import logging
    import random

    import numpy as np
    import torch
    import tqdm

    env = {"LOMO_DS_KEEP_FREED_MEMORY": "0", **(env or {})}
    saved_env = {k: os.environ.get(k) for k in env}
    loggers = [logging.getLogger(n) for n in ("DeepSpeed", "torch", "transformers", "datasets")]
    saved_loggers = [(lg.level, list(lg.filters)) for lg in loggers]
    saved_tqdm = vars(tqdm.tqdm).get("__init__")
    saved_rng = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    threads = torch.get_num_threads()
    out = io.StringIO()
    os.environ.update(env)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(out):
            rc = main(argv)
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for lg, (level, filters) in zip(loggers, saved_loggers, strict=True):
            lg.setLevel(level)
            lg.filters[:] = filters
        tqdm.tqdm.__init__ = saved_tqdm
        torch.set_rng_state(saved_rng[0])
        np.random.set_state(saved_rng[1])
        random.setstate(saved_rng[2])
        torch.set_num_threads(threads)
    return {"rc": rc, "stdout": out.getvalue()}


def ok(results: dict, check: Check | str) -> Any:
    """One check's figures, failing with its traceback if it raised on the ranks."""
    key = check.key if isinstance(check, Check) else check
    assert LAUNCH_ERROR not in results, f"the launch failed: {results[LAUNCH_ERROR]}"
    if key not in results and isinstance(check, Check) and check.two_in_ci_only:
        import pytest  # the pytest side only: ranks import this module too

        pytest.skip("on 2 ranks a long check (1 and 3 ranks run here): LOMO_DS_LONG_TESTS=1 runs it (CI does)")
    assert key in results, f"multi-rank check {key} did not run in this launch (LOMO_CHECKS?)"
    r = results[key]
    assert not (isinstance(r, dict) and "error" in r), r["error"]
    return r


def assert_matches_reference(r: dict, tol: float, label: str) -> None:
    """A training check's figures against its single-process reference: the parameters within
    `tol`, the loss of every step the reference's (the global batch's, as the reference computes
    it), and training having moved."""
    import pytest  # the pytest side only: ranks import this module too

    print(f"{label}: max |LOMO - reference| = {r['max_abs_diff']:.2e}")
    assert r["max_abs_diff"] <= tol
    assert r["loss"] == pytest.approx(r["ref_loss"], abs=1e-5)
    assert r["loss"][-1] != r["loss"][0]  # training moved


# ----------------------------------------------------------------------------- the pytest side
def launch(program: list[str], nproc: int, timeout: float = 600, env: dict | None = None, cpu: bool = True):
    """Run `program` (a script, or "-m" and a module) on `nproc` ranks (CPU ranks unless `cpu` is
    False: one GPU each); fail with its log if it fails."""
    from devkit.launch_local import run_local

    def run():
        return run_local(program, nproc, timeout=timeout, env=env, cwd=ROOT, cpu=cpu)

    proc = run()
    if proc.returncode != 0 and RANK_ABORT in proc.stderr:
        # A rank has (rarely, not reproduced in isolation) died in C++ with this message under a
        # loaded CI machine; it is an open bug, so it is reported, and the launch is retried once:
        # a second abort, or any other failure, fails the test.
        warnings.warn(f"{program[:2]} on {nproc} ranks: a rank aborted ({RANK_ABORT!r}); retrying once", stacklevel=2)
        proc = run()
    if proc.returncode != 0:
        raise AssertionError(f"{program} on {nproc} ranks failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-8000:]}")
    return proc


def run_world(world: int, out_dir: str) -> dict:
    """Every declared check of `world` in one launch: their figures by key (and "_seconds")."""
    modules = sorted({c.module for c in REGISTRY.values() if world in c.worlds})
    if not modules:
        return {}
    out = os.path.join(out_dir, "results.json")
    # One thread per rank, whatever the world size: the checks' models are tiny (a second thread
    # only adds its synchronisation), and while the 1-rank launch runs, the other pytest-xdist
    # worker runs single-process tests on the other core; two threads then wait on each other
    # across a core that is not theirs.
    # The timeout: several times what the launch of every check takes on 2 idle cores.
    launch(["-m", "tests.ranks", out, *modules], world, timeout=1800, env={"OMP_NUM_THREADS": "1"})
    with open(out) as f:
        return json.load(f)


# ----------------------------------------------------------------------------- the ranks' side
def run_checks(checks: dict[str, Callable[[], Any]], out_path: str, only: str | None = None) -> None:
    """Run `checks` (a subset: the comma-separated keys or "module/" prefixes in `only`) in order
    on every rank; a check that raises is recorded as {"error": traceback} so the others still run."""
    wanted = [w for w in (only or "").split(",") if w]
    results, seconds, cpu_seconds = {}, {}, {}
    import torch

    for name, fn in checks.items():
        if wanted and not any(name == w or (w.endswith("/") and name.startswith(w)) for w in wanted):
            continue
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            results[name] = fn()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        torch.distributed.barrier()
        seconds[name] = round(time.perf_counter() - t0, 2)
        cpu_seconds[name] = round(time.process_time() - c0, 2)
    # What each check costs, to keep the suite's launches short: wall seconds, and rank 0's CPU
    # seconds (comparable on a busy machine, where the wall seconds are not).
    results["_seconds"], results["_cpu_seconds"] = seconds, cpu_seconds
    if torch.distributed.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


def main(out_path: str, modules: list[str]) -> None:
    global _work_dir
    import torch

    import lomo_ds

    lomo_ds.init_distributed()
    world = torch.distributed.get_world_size()
    _work_dir = os.path.dirname(os.path.abspath(out_path))
    for module in modules:
        importlib.import_module(module)
    # DeepSpeed's ZeRO-3 optimizer calls gc.collect() in every engine it builds; what the imports
    # left (torch, transformers, DeepSpeed: millions of objects) never becomes garbage, so it is
    # moved out of the collector's sight once, here.
    gc.collect()
    gc.freeze()
    mine = [c for c in REGISTRY.values() if world in c.worlds]
    ordered = [c for c in mine if c.first] + [c for c in mine if not c.first]
    run_checks({c.key: c.fn for c in ordered}, out_path, only=os.environ.get("LOMO_CHECKS"))
    # Close the process group before the interpreter exits, so no gloo thread outlives it.
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    # Run as `python -m tests.ranks`: the registry is the imported module's, which the test modules fill.
    from tests import ranks

    ranks.main(sys.argv[1], sys.argv[2:])
