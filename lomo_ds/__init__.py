"""lomo_ds: LOMO (fused backward + update) on DeepSpeed ZeRO-3 shards."""
from .config import ConfigError, LomoConfig, load_config
from .engine import LomoEngine, initialize, init_distributed
from .methods import Engine, build_engine

__all__ = ["initialize", "init_distributed", "LomoEngine", "LomoConfig", "ConfigError", "load_config",
           "Engine", "build_engine"]
__version__ = "0.1.0"
