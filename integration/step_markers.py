"""Done markers of the pipeline's steps: a step is skipped when its marker holds the hash of the
settings (and upstream hashes) it would be made from."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from candidate_gen.files import atomic_write_text
from reranker.stages.base import NotDoneError


def step_hash(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def step_done(marker: Path, h: str) -> bool:
    return marker.exists() and json.loads(marker.read_text()).get("hash") == h


def mark_step(marker: Path, h: str, **info) -> None:
    """Write the marker (temp file, then rename); `info` rides along (e.g. the step's seconds)."""
    atomic_write_text(marker, json.dumps({"hash": h, **info}, indent=2))


def not_done(what: str, where: Path):
    """Raise NotDoneError: `what` (in `where`) is not done with these settings and this code, and the
    caller only reads a finished run back (`dgr2 pipeline --summary-only`)."""
    raise NotDoneError(f"{what} in {where}: not done with these settings and this code")
