"""The sharded engine, the algorithm alone: DeepSpeed ZeRO-3 for the parameters, lomo_ds for the
gradients. The engine (lomo_engine.py) hooks every parameter; its gradients go into buckets laid
out and ordered alike on every rank (buckets.py), which a transport of lomo_ds/comm reduces; the
update (update/: the rule, SGD or AdaLomo, on the shard's weights) applies the reduced slices to
this rank's shard in place, or the accumulator (accumulation.py) keeps them for a window's step.
How bytes move between ranks is lomo_ds/comm's alone."""
from lomo_ds.engine.lomo_engine import LomoEngine, initialize

__all__ = ["LomoEngine", "initialize"]
