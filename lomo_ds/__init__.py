"""lomo_ds: LOMO (fused backward + update) on DeepSpeed ZeRO-3 shards."""
from .config import ConfigError, LomoConfig, load_config
from .engine import LomoEngine, initialize, init_distributed

__all__ = ["initialize", "init_distributed", "LomoEngine", "LomoConfig", "ConfigError", "load_config"]
__version__ = "0.1.0"
