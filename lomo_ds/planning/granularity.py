"""The fetch granularities the planner weighs (one decoder layer per gather, or DeepSpeed's one
module's own parameters): LOMO's estimate under each, and the coarsest that fits."""
from __future__ import annotations

from dataclasses import dataclass, replace

from lomo_ds.planning.estimate import Estimate, estimate, gathered_param_bytes
from lomo_ds.planning.fetch_units import fetch_units, largest_fetch_unit
from lomo_ds.planning.specs import AUTO, GIB, ModelSpec, RunSpec, resolve_auto

# The fetch granularities the planner weighs, coarsest first: one decoder layer per gather (as
# PyTorch FSDP2 wraps a layer), then DeepSpeed's default of one module's own parameters.
GRANULARITIES = {"per decoder layer": {"leaf_classes": AUTO, "granularity_threshold": 0},
                 "per module": {"leaf_classes": (), "granularity_threshold": 0}}


@dataclass(frozen=True)
class GranularityRow:
    name: str
    run: RunSpec
    units: int  # gathers per pass over the model
    largest: tuple[str, int]  # (module, elements) of the largest unit
    gathered: float  # bytes per GPU: persistent + the working set W (0 on one GPU in the compute dtype)
    estimate: Estimate
    fits: bool


def granularity_rows(m: ModelSpec, run: RunSpec, gpus: int, gpu_mem_gib: float, method: str = "lomo"
                     ) -> list[GranularityRow]:
    """`method` on `gpus` GPUs under each fetch granularity, coarsest first; the run's own
    granularity is added when it is neither."""
    run = resolve_auto(m, run)
    options = {name: resolve_auto(m, replace(run, **fields)) for name, fields in GRANULARITIES.items()}
    if all(o.fetch_label != run.fetch_label for o in options.values()):
        options = {f"this config: {run.fetch_label}": run, **options}
    rows = []
    for name, r in options.items():
        est = estimate(m, method, gpus, r)
        gathered = gathered_param_bytes(m, r, gpus)
        rows.append(GranularityRow(name, r, len(fetch_units(m, r)), largest_fetch_unit(m, r), float(gathered), est,
                                   est.total <= gpu_mem_gib * GIB))
    return rows


def coarsest_fitting(m: ModelSpec, run: RunSpec, gpus: int, gpu_mem_gib: float) -> GranularityRow | None:
    """The coarsest of GRANULARITIES under which LOMO fits on `gpus` GPUs (None: not even per module)."""
    return next((row for row in granularity_rows(m, run, gpus, gpu_mem_gib)
                 if row.name in GRANULARITIES and row.fits), None)
