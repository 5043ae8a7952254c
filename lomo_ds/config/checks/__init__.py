"""The run config's checks that span sections, one module per feature, run in this order once the
sections are validated, DeepSpeed's keys mapped and the rule's preset applied (lomo_ds/config/
loading.py). A check that concerns one section alone is that section's validator instead
(data_section.py, run.py). Every problem is a ConfigError naming the dotted key and what was
expected; the loader prefixes the file."""
from __future__ import annotations

from lomo_ds.config.checks.context import Loading
from lomo_ds.config.checks.eval_split import check_eval_split
from lomo_ds.config.checks.generation import check_generation
from lomo_ds.config.checks.harness import check_harness
from lomo_ds.config.checks.int8_shards import check_int8_shards
from lomo_ds.config.checks.packing import check_packing
from lomo_ds.config.checks.sequence_memory import check_engine_memory, check_offloaded_checkpoints
from lomo_ds.config.checks.sequence_parallel import check_sequence_parallel
from lomo_ds.config.checks.sources import check_sources
from lomo_ds.config.checks.streaming import check_streaming
from lomo_ds.config.checks.update_method import check_lomo_section

# In order: the first problem found is the one reported.
RUN_CHECKS = (
    check_sources,
    check_streaming,
    check_packing,
    check_engine_memory,
    check_int8_shards,
    check_sequence_parallel,
    check_offloaded_checkpoints,
    check_generation,
    check_eval_split,
    check_harness,
    check_lomo_section,
)
# fp16 on a CPU (DeepSpeed refuses it there) is checked when the accelerator is known: at run time.


def check_run(cfg, loading: Loading) -> None:
    """Every feature's check of a validated run config (a RunConfig)."""
    for check in RUN_CHECKS:
        check(cfg, loading)


__all__ = ["RUN_CHECKS", "Loading", "check_run"]
