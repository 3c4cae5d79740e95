"""Done markers of the pipeline's steps: a step is skipped when its marker holds the hash of the
settings (and upstream hashes) it would be made from."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from candidate_gen.files import atomic_write_text


def step_hash(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def step_done(marker: Path, h: str) -> bool:
    return marker.exists() and json.loads(marker.read_text()).get("hash") == h


def mark_step(marker: Path, h: str, **info) -> None:
    """Write the marker (temp file, then rename); `info` rides along (e.g. the step's seconds)."""
    atomic_write_text(marker, json.dumps({"hash": h, **info}, indent=2))
