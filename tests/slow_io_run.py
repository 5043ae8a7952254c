"""The training recipe with rank 0's export files and checkpoint seals written slowly, as on a slow
or shared disk, and collectives that time out after a short while:
`python -m tests.slow_io_run WRITE_SECONDS TIMEOUT_SECONDS [train.py's arguments]` under a launcher.

The ranks start under the config's lomo.collective_timeout (a loaded machine may start them seconds
apart); once every rank is up, the default group's timeout becomes TIMEOUT_SECONDS. With
TIMEOUT_SECONDS shorter than WRITE_SECONDS the run passes only if the other ranks wait for rank 0's
writes under output.io_timeout (lomo_ds.runtime.dist.io_barrier), not in a collective.
tests/recipe/test_train.py runs it on 2 CPU ranks, tests/gpu on GPUs."""
from __future__ import annotations

import os
import sys
import time
from datetime import timedelta


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
    if os.environ.get("RANK", "0") == "0":
        import safetensors.torch

        from lomo_ds.storage import checkpoint

        def slowed(fn, only=None):
            def run(*args, **kwargs):
                if only is None or str(args[0]).endswith(only):
                    time.sleep(delay)
                return fn(*args, **kwargs)
            return run

        # Every export file (export_hf writes with safetensors' save_file), and each checkpoint's
        # seal (meta.json: the other ranks have written theirs and wait for it).
        safetensors.torch.save_file = slowed(safetensors.torch.save_file)
        checkpoint.write_atomic = slowed(checkpoint.write_atomic, only="meta.json")
    from lomo_ds.recipe.train import main as train

    return train(argv)


if __name__ == "__main__":
    sys.exit(main())
