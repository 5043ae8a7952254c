"""The sharded engine: DeepSpeed ZeRO-3 for the parameters, lomo_ds for the gradients. The engine
(lomo_engine.py) hooks every parameter; its gradients go into reduce-scatter buckets (buckets.py,
through shm_reduce_scatter.py on one CPU node), whose reduced slices the fused update
(fused_update.py: SGD, or adalomo.py) applies to this rank's shard in place. On one CPU node
ZeRO-3's parameter all-gathers also go through shared memory (shm_all_gather.py; both transports
share shm_transport.py)."""
from lomo_ds.engine.lomo_engine import LomoEngine, initialize

__all__ = ["LomoEngine", "initialize"]
