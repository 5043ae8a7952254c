"""Every multi-rank check of the engine, its buckets and AdaLomo, in ONE launch per world size.

    torchrun --nproc_per_node N tests/dist_checks.py OUT.json

Rank start-up (importing torch, DeepSpeed and transformers on every rank) is the slow part on a
CPU, so the three families share it; results are keyed "<family>/<check>" and tests/conftest.py
hands each test module its family's. LOMO_CHECKS=name,name runs a subset (full keys).
"""
import os
import sys

import torch

import lomo_ds
from dist_adalomo_checks import adalomo_checks
from dist_bucket_checks import bucket_checks
from dist_engine_checks import engine_checks
from dist_harness import run_checks

FAMILIES = {"engine": engine_checks, "buckets": bucket_checks, "adalomo": adalomo_checks}


def main(out_path: str) -> None:
    lomo_ds.init_distributed()
    world = torch.distributed.get_world_size()
    checks = {f"{family}/{name}": fn for family, build in FAMILIES.items() for name, fn in build(world).items()}
    run_checks(checks, out_path, only=os.environ.get("LOMO_CHECKS"))


if __name__ == "__main__":
    main(sys.argv[1])
