"""Every multi-rank check, in ONE launch per world size: the engine's, its buckets' and AdaLomo's on
1, 2 and 3 ranks; on 1 and 2 the memory the planner predicts; on 2 every training method's, the
Hugging Face export's and the benchmarks' smoke runs; on 3 the evaluation's rank split.

    torchrun --nproc_per_node N tests/dist_checks.py OUT.json

Rank start-up (importing torch, DeepSpeed and transformers on every rank) is the slow part on a
CPU, so the families share it; results are keyed "<family>/<check>" and tests/conftest.py
hands each test module its family's. LOMO_CHECKS=name,name runs a subset (full keys).
"""
import os
import sys

import torch

import lomo_ds
from dist_adalomo_checks import adalomo_checks
from dist_bucket_checks import bucket_checks
from dist_engine_checks import engine_checks
from dist_evaluation_checks import evaluation_checks
from dist_export_checks import export_checks
from dist_harness import run_checks
from dist_methods_checks import methods_checks
from dist_planner_checks import planner_checks
from dist_smoke_checks import smoke_checks

# family -> build(world, work_dir) -> {check name: check}; work_dir holds what a check writes.
FAMILIES = {"engine": lambda world, _: engine_checks(world), "buckets": lambda world, _: bucket_checks(world),
            "adalomo": lambda world, _: adalomo_checks(world)}
ON_ONE_RANK = {"planner": lambda world, _: planner_checks(world)}
ON_TWO_RANKS = {"planner": lambda world, _: planner_checks(world), "methods": lambda world, _: methods_checks(world), "export": export_checks,
                "smoke": lambda world, _: smoke_checks(world)}
ON_THREE_RANKS = {"evaluation": lambda world, _: evaluation_checks(world)}  # 7 examples split 3/2/2


def main(out_path: str) -> None:
    lomo_ds.init_distributed()
    world = torch.distributed.get_world_size()
    # The world's own families first: the planner's memory is measured in a process no check has used.
    families = {**{1: ON_ONE_RANK, 2: ON_TWO_RANKS, 3: ON_THREE_RANKS}.get(world, {}), **FAMILIES}
    work_dir = os.path.dirname(os.path.abspath(out_path))
    checks = {f"{family}/{name}": fn for family, build in families.items() for name, fn in build(world, work_dir).items()}
    run_checks(checks, out_path, only=os.environ.get("LOMO_CHECKS"))
    # Close the process group before the interpreter exits, so no gloo thread outlives it.
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
