"""What the command groups share: provenance, result files, list and JSON flags, config paths. (The
decode flags are reranker.decoding's add_decode_flags.)"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

from candidate_gen.files import parse_json_object, write_result

from ..config import retrieval_settings, section


def command_line() -> str:
    """This invocation, shell-quoted: the provenance every results file records."""
    return "dgr2 " + shlex.join(sys.argv[1:])


def save_results(path, doc: dict, command: str | None = None) -> int:
    """Write `doc` as a docs/results file at `path`, when a path was given, and say so; the command
    recorded is this invocation unless another is given. Returns 0, a command's exit status."""
    if path:
        write_result(path, doc, command if command is not None else command_line())
        print(f"results written to {path}")
    return 0


def ints(s: str) -> tuple[int, ...]:
    """A comma-separated CLI list ("1,8"; "" is empty)."""
    return tuple(int(x) for x in s.split(",") if x.strip())


def floats(s: str) -> tuple[float, ...]:
    return tuple(float(x) for x in s.split(",") if x.strip())


def json_arg(text: str, flag: str) -> dict:
    """A flag's JSON object of settings; anything else exits with a message naming the flag and its text."""
    try:
        return parse_json_object(text, flag)
    except ValueError as e:
        raise SystemExit(f"{e}: {text!r}") from None


def data_paths(cfg: dict, data: str | None):
    """(retrieval artifacts dir, items file, re-ranking data dir) for a config."""
    from candidate_gen.atomic import find_atomic_file

    rs = retrieval_settings(cfg, data, None)
    src = rs.data_dir if rs.data_dir is not None else Path(rs.out) / "source"
    dcfg = section(cfg, "rerank_data")
    items = dcfg.get("items_path") or find_atomic_file(src, "item")
    return rs.out, Path(items), Path(cfg["out"]) / "rerank_data"

