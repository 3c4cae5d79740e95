"""YAML run configs. Precedence: command-line flags > the YAML file > built-in defaults.

Relative paths in a config are resolved against the current directory (run from the repo root).
"""
from __future__ import annotations

from pathlib import Path

import yaml


class ConfigError(ValueError):
    pass


def load_config(path: str | Path) -> dict:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{p}: config file not found")
    try:
        cfg = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{p}: top level must be a mapping, got {type(cfg).__name__}")
    cfg.setdefault("name", p.stem)
    cfg.setdefault("out", f"artifacts/{cfg['name']}")
    return cfg


def section(cfg: dict, name: str) -> dict:
    value = cfg.get(name) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"config section '{name}' must be a mapping, got {value!r}")
    return value
