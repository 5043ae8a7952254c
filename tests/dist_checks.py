"""Every multi-rank check, in ONE launch per world size: the engine's, its buckets' and AdaLomo's on
1, 2 and 3 ranks; on 1 and 2 the memory the planner predicts; on 2 every training method's, the
Hugging Face export's and the benchmarks' smoke runs; on 3 the evaluation's rank split.

    torchrun --nproc_per_node N tests/dist_checks.py OUT.json

Rank start-up (importing torch, DeepSpeed and transformers on every rank) is the slow part on a
CPU, so the families share it; results are keyed "<family>/<check>" and tests/conftest.py
hands each test module its family's. LOMO_CHECKS=name,name runs a subset (full keys).
"""
import functools
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

# family -> build(world) -> {check name: check}
FAMILIES = {"engine": engine_checks, "buckets": bucket_checks, "adalomo": adalomo_checks}


def families_on(world: int, work_dir: str) -> dict:
    """This world size's own families (first: the planner's memory is measured in a process no
    check has used yet), then the ones every world size runs. `work_dir` holds what a check writes."""
    own = {1: {"planner": planner_checks},
           2: {"planner": planner_checks, "methods": methods_checks, "smoke": smoke_checks,
               "export": functools.partial(export_checks, work_dir=work_dir)},
           3: {"evaluation": evaluation_checks}}  # 7 examples split 3/2/2
    return {**own.get(world, {}), **FAMILIES}


def main(out_path: str) -> None:
    lomo_ds.init_distributed()
    world = torch.distributed.get_world_size()
    families = families_on(world, work_dir=os.path.dirname(os.path.abspath(out_path)))
    checks = {f"{family}/{name}": fn for family, build in families.items() for name, fn in build(world).items()}
    run_checks(checks, out_path, only=os.environ.get("LOMO_CHECKS"))
    # Close the process group before the interpreter exits, so no gloo thread outlives it.
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
