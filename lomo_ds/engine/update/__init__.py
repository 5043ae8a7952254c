"""The update of this rank's shards from their reduced gradient slices.

  updater.py       ShardUpdater: one pass at a time (measure, or update by the rule), and the
                   resumable state (the shard's weights, the rule's state under its name, and which
                   tensors are per-rank pieces)
  shard.py         where a slice lies (ShardGeometries; ShardGeometry itself is
                   runtime/shard_geometry.py's), chunks, and ShardWeights: fp32 masters,
                   stochastic rounding, weights read and written back chunk by chunk
  int8.py          8-bit shards (memory.int8_shards): chunks read dequantized and written back
                   requantized with keyed noise, cut blocks' scales settled per bucket
  rule.py          the Rule every update rule implements (built by Rule.build(BuildContext), chosen
                   by name from config/rules.py's registry); PassSettings, PassStats
  sgd.py           SGD, LOMO's rule
  adalomo.py       AdaLomo's rule: its state, its three phases, the host-update worker's part
  adalomo_math.py  AdaLomo's arithmetic on a slice
"""
from lomo_ds.engine.update.adalomo import AdaLomo
from lomo_ds.engine.update.rule import BuildContext, PassSettings, PassStats, Rule
from lomo_ds.engine.update.sgd import SGD
from lomo_ds.engine.update.shard import ShardGeometries, ShardGeometry, ShardWeights, chunk_bounds, geometry
from lomo_ds.engine.update.updater import ShardUpdater, build_updater

__all__ = ["SGD", "AdaLomo", "BuildContext", "PassSettings", "PassStats", "Rule", "ShardGeometries", "ShardGeometry",
           "ShardUpdater", "ShardWeights", "build_updater", "chunk_bounds", "geometry"]
