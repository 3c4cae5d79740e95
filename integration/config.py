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


def retrieval_settings(cfg: dict, data: str | None, out: str | None):
    """The config's data and retrieval sections as RetrievalSettings (`data` and `out` override them)."""
    from candidate_gen.retrieve import RetrievalSettings

    d = section(cfg, "data")
    r = section(cfg, "retrieval")
    data_dir = data or d.get("dir")
    return RetrievalSettings(
        out=Path(out or r.get("out") or Path(cfg["out"]) / "retrieval"),
        data_dir=Path(data_dir) if data_dir else None,
        synthetic=d.get("synthetic") or {},
        user_k=int(d.get("user_k", 5)),
        item_k=int(d.get("item_k", 5)),
        seed=int(cfg.get("seed", 0)),
        n_candidates=int(r.get("n_candidates", 10)),
        crossfit_folds=int(r.get("crossfit_folds", 2)),
        index=r.get("index", "flat"),
        sasrec=r.get("sasrec") or {},
        fold_sasrec=r.get("fold_sasrec") or {},
        agreement_users=int(r.get("agreement_users", 0)),
    )
