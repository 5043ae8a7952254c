"""The training recipe with rank 0's export files and checkpoint seals written slowly, as on a slow
or shared disk, and collectives that time out after a short while:
`python -m tests.slow_io_run WRITE_SECONDS TIMEOUT_SECONDS [train.py's arguments]` under a launcher,
or `slow_io(WRITE_SECONDS, TIMEOUT_SECONDS)` around the program run inside a launch that is up.

The ranks start under the config's train.collective_timeout (a loaded machine may start them seconds
apart); once every rank is up, the default group's timeout becomes TIMEOUT_SECONDS. With
TIMEOUT_SECONDS shorter than WRITE_SECONDS the run passes only if the other ranks wait for rank 0's
writes under output.io_timeout (lomo_ds.runtime.dist.io_barrier), not in a collective.
tests/recipe/test_train.py runs it in the 2-rank launch of the CPU checks, tests/gpu on GPUs."""
from __future__ import annotations

import contextlib
import os
import sys
import time
from datetime import timedelta


@contextlib.contextmanager
def slow_writes(delay: float):
    """On rank 0: every export file (export_hf writes with safetensors' save_file) and each
    checkpoint's seal (meta.json: the other ranks have written theirs and wait for it) takes `delay`
    seconds longer to write."""
    if os.environ.get("RANK", "0") != "0":
        yield
        return
    import safetensors.torch

    from lomo_ds.storage import checkpoint

    def slowed(fn, only=None):
        def run(*args, **kwargs):
            if only is None or str(args[0]).endswith(only):
                time.sleep(delay)
            return fn(*args, **kwargs)
        return run

    saved = safetensors.torch.save_file, checkpoint.write_atomic
    safetensors.torch.save_file = slowed(saved[0])
    checkpoint.write_atomic = slowed(saved[1], only="meta.json")
    try:
        yield
    finally:
        safetensors.torch.save_file, checkpoint.write_atomic = saved


@contextlib.contextmanager
def slow_io(delay: float, timeout: float):
    """Collective, in a launch whose process group is up: rank 0's writes slowed (slow_writes), and
    the default group's timeout `timeout` seconds until the block ends (then DeepSpeed's default)."""
    import torch
    from deepspeed.constants import default_pg_timeout

    torch.distributed.barrier()
    torch.distributed.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout))
    try:
        with slow_writes(delay):
            yield
    finally:
        torch.distributed.distributed_c10d._set_pg_timeout(default_pg_timeout)


def main() -> int:
    delay, timeout, argv = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
    import torch

    from lomo_ds.runtime import dist

    start = dist.init_distributed

    def init_then_shorten(timeout_s=None):
        start(timeout_s=timeout_s)
        torch.distributed.barrier()
        torch.distributed.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout))

    dist.init_distributed = init_then_shorten
    with slow_writes(delay):
        from lomo_ds.recipe.train import main as train

        return train(argv)


if __name__ == "__main__":
    sys.exit(main())
