import glob
import json
import os
import socket
import subprocess
import sys
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What pytest.ini's pythonpath gives the tests (and pytest's own rootdir insertion, tests/gpu),
# given to the ranks they launch too.
HELPER_PATH = os.pathsep.join([os.path.join(ROOT, d) for d in ("tests", "experiments", os.path.join("tests", "gpu"))])


RANK_ABORT = "terminate called without an active exception"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: str, nproc: int, args: list[str], timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `script` on `nproc` ranks (gloo on this CPU) and fail with its log if it fails."""
    # LOCAL_SIZE as DeepSpeed's launcher sets it, so the launch starts as a `deepspeed` one does:
    # DeepSpeed then creates its /dev/shm all-reduce files (which lomo_ds must clean up), and
    # lomo's shared_memory transport is what "auto" picks.
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "LOCAL_SIZE": str(nproc),
                "PYTHONPATH": os.pathsep.join(filter(None, [HELPER_PATH, os.environ.get("PYTHONPATH")])), **(env or {})}

    def run() -> subprocess.CompletedProcess:
        port = free_port()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_addr", "127.0.0.1", "--master_port", str(port), script, *args]
        try:
            return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
        finally:
            # DeepSpeed's CPU shared-memory all-reduce buffers (68 MB per rank in /dev/shm, named by
            # address, port and rank): lomo_ds.init_distributed removes their names once every rank
            # has started, but a launch that failed before then leaves them: remove this launch's.
            for leftover in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_127.0.0.1_{port}_*"):
                os.remove(leftover)

    proc = run()
    if proc.returncode != 0 and RANK_ABORT in proc.stderr:
        # A rank has (rarely, not reproduced in isolation) died in C++ with this message on the
        # 2-core CI machine; it is an open bug, so it is reported, and the launch is retried once:
        # a second abort, or any other failure, fails the test.
        warnings.warn(f"{os.path.basename(script)} on {nproc} ranks: a rank aborted ({RANK_ABORT!r}); retrying once")
        proc = run()
    if proc.returncode != 0:
        raise AssertionError(f"{script} on {nproc} ranks failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def results_per_world(tmp_path_factory, script: str):
    """get(world): the figures of every check in tests/<script>, from one launch per world size
    (rank start-up is the slow part on a CPU), cached for the session."""
    cache = {}

    def get(world: int) -> dict:
        if world not in cache:
            out = tmp_path_factory.mktemp(f"{os.path.splitext(script)[0]}{world}") / "results.json"
            launch(os.path.join(ROOT, "tests", script), world, [str(out)])
            cache[world] = json.loads(out.read_text())
        return cache[world]

    return get


def ok(results: dict, name: str) -> dict:
    """One check's figures, failing with its traceback if it raised on the ranks."""
    r = results[name]
    assert r is not None and "error" not in r, r and r.get("error")
    return r


@pytest.fixture(scope="session")
def dist_results(tmp_path_factory):
    """tests/dist_checks.py: the engine, bucket and AdaLomo checks in one launch per world size."""
    return results_per_world(tmp_path_factory, "dist_checks.py")


def family(get, name: str):
    """get(world) narrowed to one family of tests/dist_checks.py ("engine", "buckets", "adalomo")."""
    prefix = name + "/"
    return lambda world: {k[len(prefix):]: v for k, v in get(world).items() if k.startswith(prefix)}


@pytest.fixture(scope="session")
def engine_results(dist_results):
    return family(dist_results, "engine")
