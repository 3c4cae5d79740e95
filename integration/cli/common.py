"""What the command groups share: provenance, result files, list and JSON flags, config paths, the
diffusion decoder's flags."""
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


def add_diffusion_rule_flags(parser) -> None:
    """The diffusion decoder's commit rule and EOS hold, the same flags for every command that decodes."""
    from reranker.diffusion.rules import COMMIT_RULES

    parser.add_argument("--hold-eos", action="store_true",
                        help="diffusion: commit EOS only as the position a step must commit, not on confidence "
                             "beside the tokens before it")
    parser.add_argument("--commit-rule", default="confidence", choices=COMMIT_RULES,
                        help="diffusion: commit every confident position (the paper's), or only the leftmost "
                             "masked one and the confident run after it")
