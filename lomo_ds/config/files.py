"""Reading a config file: YAML or JSON, a top-level object, or a ConfigError naming the file."""
from __future__ import annotations

import json
import os

import yaml

from lomo_ds.config.errors import ConfigError


def read_config_file(path: str | os.PathLike) -> dict:
    """A config file's top-level object: YAML for .yaml/.yml, JSON otherwise; or a ConfigError
    naming the file and what is wrong with it."""
    path = os.fspath(path)
    fmt = "YAML" if path.endswith((".yaml", ".yml")) else "JSON"
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) if fmt == "YAML" else json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, expected a JSON or YAML file") from None
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: not valid {fmt} ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a {fmt} object at the top level, got {type(raw).__name__}")
    return raw

