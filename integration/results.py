"""Result files under docs/results/: every figure in the docs comes from one of these.

Each file records the command and the commit that produced it, so a table can say where its
numbers came from.
"""
from __future__ import annotations

import datetime as _dt
import json
import subprocess
from pathlib import Path

from candidate_gen.atomic import atomic_write_text

RESULTS_DIR = Path("docs/results")


def current_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_result(path: str | Path, payload: dict, command: str) -> Path:
    path = Path(path)
    doc = {"command": command, "commit": current_commit(),
           "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), **payload}
    atomic_write_text(path, json.dumps(doc, indent=2) + "\n")
    return path


def read_results(directory: str | Path = RESULTS_DIR) -> dict[str, dict]:
    d = Path(directory)
    return {p.stem: json.loads(p.read_text()) for p in sorted(d.glob("*.json"))} if d.is_dir() else {}
