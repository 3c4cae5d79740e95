"""Shared file I/O for every package: atomic writes (a text file, a JSON document, a directory),
UTF-8 text and JSON-lines reading, JSON-lines writing, and the docs/results files.

It sits at the bottom of the import graph and imports nothing of the project, so any module can
use it. Atomic means a reader sees the old complete file (or directory) or the new one, never
half of one: everything is written beside its destination, then renamed into place; what a
writer killed mid-directory-save leaves there is removed by the next write. Reading errors name
the file and the line.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

RESULTS_DIR = Path("docs/results")


# ---------------------------------------------------------------- atomic writes
def atomic_write(path: str | os.PathLike, write: Callable[[str], object]) -> Path:
    """Run ``write(tmp)`` on a temp file beside `path`, then rename it into place: readers never
    see half a file. For writers that want a file name (safetensors' save_file, ...)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a result or data file is for everyone to read
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write text to a temp file beside `path`, then rename: readers never see half a file."""
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    return atomic_write(path, write)


def atomic_write_json(path: str | os.PathLike, obj) -> Path:
    """`obj` as indented JSON with sorted keys, written atomically."""
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _sibling(path: Path, kind: str) -> Path:
    # The writer's pid is in the name so that a later writer can tell a killed writer's leftovers
    # from a directory another live process is still writing.
    return path.parent / f".{path.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def sweep_stale_siblings(path: str | os.PathLike) -> list[Path]:
    """Remove the temp (`.<name>.tmp-*`) and moved-aside (`.<name>.old-*`) directories that a
    writer killed mid-save left beside `path` (nothing else ever removes them), except those of a
    process still running on this machine. Returns what was removed."""
    path = Path(path)
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(?:tmp|old)-(?:(\d+)-)?[0-9a-f]{{8}}")
    if not path.parent.is_dir():
        return []
    removed = []
    for p in path.parent.iterdir():
        m = pattern.fullmatch(p.name)
        # A name without a pid was written before names carried one: its writer is long gone.
        if m is None or (m.group(1) and _alive(int(m.group(1)))):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def replace_dir(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Rename directory `src` to `dst`, replacing an existing `dst` (moved aside first, then
    removed, so at every instant `dst` is either the old or the new complete directory).

    Stale temp directories of killed writers of either name are removed on the way: once `src`
    has become `dst`, a half-written save into `src` (a stage's best model in `<out>.partial`)
    has no later save that would sweep it."""
    src, dst = Path(src), Path(dst)
    old = None
    if dst.exists():
        old = _sibling(dst, "old")
        os.rename(dst, old)
    os.rename(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    sweep_stale_siblings(src)
    sweep_stale_siblings(dst)
    return dst


def write_dir_atomically(path: str | os.PathLike, save: Callable[[Path], object]) -> Path:
    """Run ``save(tmp_dir)`` on a sibling temp directory, then swap it into place at `path`.
    A save that raises leaves no temp directory; one killed mid-save leaves one that the next
    write of `path` (or a replace_dir of it) removes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale_siblings(path)
    tmp = _sibling(path, "tmp")
    try:
        save(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return replace_dir(tmp, path)


# ---------------------------------------------------------------- text files
_BOM = b"\xef\xbb\xbf"


def read_text_lines(path: str | os.PathLike, error: type[Exception] = ValueError) -> list[str]:
    """The lines of a UTF-8 text file, newline-terminated as `open(...).readlines()` gives them.

    A UTF-8 byte-order mark at the start is dropped (spreadsheet exports write one, and it would
    glue itself to the first column's name). Bytes that are not UTF-8 raise `error` naming the
    file, the line and the column, where the decoder alone names only a byte offset."""
    data = Path(path).read_bytes()
    if data.startswith(_BOM):
        data = data[len(_BOM):]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        before = io.StringIO(data[:err.start].decode("utf-8"), newline=None).readlines()
        if not before or before[-1].endswith("\n"):  # the bad byte starts a line
            line, column = len(before) + 1, 1
        else:
            line, column = len(before), len(before[-1]) + 1
        raise error(f"{path}: line {line}: column {column}: byte 0x{data[err.start]:02x} is not valid UTF-8 "
                    f"(save the file as UTF-8)") from None
    # Universal newlines, as text-mode reading does ("\r\n" and "\r" end a line too).
    return io.StringIO(text, newline=None).readlines()


# ---------------------------------------------------------------- JSON lines
def parse_json_object(text: str, where: str, error: type[BaseException] = ValueError) -> dict:
    """`text` as a JSON object; text that is not valid JSON or not an object raises `error`,
    its message starting with `where` (a file and line, a command-line flag)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise error(f"{where}: invalid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(value, dict):
        raise error(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def iter_jsonl(path: str | os.PathLike, error: type[Exception] = ValueError) -> Iterator[tuple[int, dict]]:
    """(line number, JSON object) for each non-blank line of `path`. A line that is not valid JSON
    or not an object, or not UTF-8, raises `error` naming file and line; a leading BOM is dropped."""
    # Bytes, decoded line by line: a text-mode read reports a bad byte with neither file nor line.
    with open(path, "rb") as f:
        for lineno, data in enumerate(f, start=1):
            if lineno == 1 and data.startswith(_BOM):
                data = data[len(_BOM):]
            try:
                raw = data.decode("utf-8")
            except UnicodeDecodeError as err:
                column = len(data[:err.start].decode("utf-8")) + 1
                raise error(f"{path}:{lineno}: column {column}: byte 0x{data[err.start]:02x} is not valid UTF-8") \
                    from None
            if raw.strip():
                yield lineno, parse_json_object(raw, f"{path}:{lineno}", error)


def read_jsonl(path: str | os.PathLike, required: dict[str, type] | None = None,
               limit: int | None = None, check=None) -> list[dict]:
    """JSON-lines records; `required` fields are checked by type, then `check(row)` may return an
    error message ("field 'x': ..."). Errors name file, line and field."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: file not found")
    rows: list[dict] = []
    for lineno, row in iter_jsonl(path):
        for name, typ in (required or {}).items():
            if name not in row:
                raise ValueError(f"{path}:{lineno}: field {name!r} is missing")
            value = row[name]
            if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
                raise ValueError(f"{path}:{lineno}: field {name!r}: expected {typ.__name__}, got {value!r:.60}")
        problem = check(row) if check is not None else None
        if problem:
            raise ValueError(f"{path}:{lineno}: {problem}")
        rows.append(row)
        if limit is not None and len(rows) >= limit:
            break
    return rows


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict], ensure_ascii: bool = False) -> Path:
    """One compact JSON object per line, written atomically."""
    return atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=ensure_ascii, separators=(",", ":")) + "\n"
                                           for r in rows))


# ---------------------------------------------------------------- docs/results files
def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def model_sha256(model_dir: str | os.PathLike) -> str:
    """The sha256 of a model directory's weights: of its one safetensors file (what `sha256sum`
    prints), or, for a sharded model, of the `sha256sum`-style lines of its files in name order.
    What a stage table row, a release and an evaluation's cache key name a model by."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors weights")
    if len(files) == 1:
        return file_sha256(files[0])
    return hashlib.sha256("".join(f"{file_sha256(f)}  {f.name}\n" for f in files).encode()).hexdigest()


# What commands compute from does not include these: the docs (results, their rendering, the prose
# around them) and released models (which results name by their sha256). Changes there do not make
# the code "dirty".
OUTPUT_PATHS = ("docs", "README.md", "models")


def current_commit() -> str:
    """The short git commit of the working directory ("-dirty" with uncommitted changes outside
    OUTPUT_PATHS), else "unknown"."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ":(top)",
                                *(f":(top,exclude){p}" for p in OUTPUT_PATHS)],
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_result(path: str | os.PathLike, payload: dict, command: str) -> Path:
    """A docs/results file: `payload` with the command, commit and date that produced it (every
    figure in the docs comes from one of these, so a table can say where its numbers came from)."""
    path = Path(path)
    doc = {"command": command, "commit": current_commit(),
           "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), **payload}
    atomic_write_text(path, json.dumps(doc, indent=2) + "\n")
    return path


def read_results(directory: str | os.PathLike = RESULTS_DIR) -> dict[str, dict]:
    """{file stem: document} of every JSON file in a results directory ({} if there is none)."""
    d = Path(directory)
    return {p.stem: json.loads(p.read_text()) for p in sorted(d.glob("*.json"))} if d.is_dir() else {}
