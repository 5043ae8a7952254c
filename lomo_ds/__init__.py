"""lomo_ds: LOMO (fused backward + update) on DeepSpeed ZeRO-3 shards."""
from importlib import metadata as _metadata

from lomo_ds.config.engine_config import load_config
from lomo_ds.config.engine_sections import EngineConfig
from lomo_ds.config.errors import ConfigError
from lomo_ds.config.lomo_section import LomoConfig
from lomo_ds.engine.lomo_engine import LomoEngine, initialize
from lomo_ds.methods import Engine, build_engine
from lomo_ds.runtime.dist import init_distributed

__all__ = ["initialize", "init_distributed", "LomoEngine", "EngineConfig", "LomoConfig", "ConfigError", "load_config",
           "Engine", "build_engine"]
try:  # the one version is pyproject.toml's, as installed
    __version__ = _metadata.version("lomo_ds")
except _metadata.PackageNotFoundError:  # a source tree on the path, not installed
    __version__ = "0+unknown"
