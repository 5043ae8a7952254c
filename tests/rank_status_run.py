"""The training program with each rank's exit status written down, for the tests of what a launcher
does to the ranks (tests/recipe/test_launcher_preemption.py):
`python -m tests.rank_status_run STATUS_DIR SLOW_SEAL_SECONDS [train.py's arguments]` under a launcher.

A launcher reports one rank's status at most; this writes every rank's, STATUS_DIR/rank_<RANK>.json,
at the moment the process ends: the program's return, or its os._exit (the preemption watcher's
75 and 76). A rank killed by a signal writes none, and the test says so. SLOW_SEAL_SECONDS > 0: rank
0's checkpoint seal takes that long (tests/slow_io_run.py's slow_writes), so that a signal lands
during the write."""
from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    # DeepSpeed's launcher puts --local_rank=N first (the training program takes it anywhere).
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    status_dir, slow, argv = args[0], float(args[1]), args[2:]
    rank = os.environ.get("RANK", "0")
    real_exit = os._exit

    def record_and_exit(code: int) -> None:
        path = os.path.join(status_dir, f"rank_{rank}.json")
        with open(f"{path}.tmp", "w") as f:
            json.dump({"status": code, "time": time.time()}, f)
        os.replace(f"{path}.tmp", path)
        real_exit(code)

    os._exit = record_and_exit
    from tests.slow_io_run import slow_writes

    with slow_writes(slow):
        from lomo_ds.recipe.train import main as train

        code = train(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    record_and_exit(code)  # at once: the status written is the one the launcher sees


if __name__ == "__main__":
    main()
