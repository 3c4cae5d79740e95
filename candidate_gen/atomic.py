"""RecBole atomic files (`<name>.inter`, `<name>.item`): strict loading, and writing (atomically,
through candidate_gen.files, the shared I/O module).

RecBole itself is forgiving about malformed rows (it lets pandas guess); a retrieval stack is not.
Every problem is reported with the file, the line number and the field, so a user can fix the data
instead of reading a pandas traceback. Duplicate (user, item, timestamp) rows are reported, then
dropped: they are the common artefact of concatenating crawls.

The timestamp column is optional: without one (or when every row has the same timestamp) each
user's sequence is the order of the rows in the file, which is also how ties are broken anywhere
(see candidate_gen.split).
"""
from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .files import atomic_write_text, read_text_lines

log = logging.getLogger(__name__)

INTER_REQUIRED = ("user_id", "item_id")
ITEM_REQUIRED = ("item_id",)
ITEM_OPTIONAL = ("title", "brand", "categories")


class AtomicFormatError(ValueError):
    """A malformed atomic file. The message names file, line and field."""


@dataclass
class Interactions:
    users: list[str]
    items: list[str]
    timestamps: list[float]
    source: str = ""
    dropped_duplicates: int = 0

    def __len__(self) -> int:
        return len(self.users)


@dataclass
class ItemTable:
    """Item metadata keyed by raw item id. Missing columns are empty strings / lists."""

    titles: dict[str, str] = field(default_factory=dict)
    brands: dict[str, str] = field(default_factory=dict)
    categories: dict[str, list[str]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.titles)

    def __contains__(self, item: str) -> bool:
        return item in self.titles

    def to_frame(self):
        import pandas as pd

        ids = list(self.titles)
        return pd.DataFrame(
            {
                "item_id": ids,
                "title": [self.titles[i] for i in ids],
                "brand": [self.brands.get(i, "") for i in ids],
                "categories": [self.categories.get(i, []) for i in ids],
            }
        )


def find_atomic_file(data_dir: str | os.PathLike, suffix: str) -> Path:
    """The single `*.{suffix}` file in `data_dir` (the dataset name is whatever the user chose)."""
    d = Path(data_dir)
    if not d.is_dir():
        raise AtomicFormatError(f"{d}: data directory does not exist")
    found = sorted(d.glob(f"*.{suffix}"))
    if not found:
        raise AtomicFormatError(f"{d}: no *.{suffix} file found (RecBole atomic format expected)")
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise AtomicFormatError(f"{d}: several *.{suffix} files ({names}); pass one directory per dataset")
    return found[0]


def _read_header(path: Path, lines: list[str], required: tuple[str, ...]) -> dict[str, int]:
    if not lines or not lines[0].strip():
        raise AtomicFormatError(f"{path}: line 1: empty file (a header row `name:type` is required)")
    cols = {}
    for pos, spec in enumerate(lines[0].rstrip("\n\r").split("\t")):
        name = spec.split(":", 1)[0].strip()
        cols[name] = pos
    for name in required:
        if name not in cols:
            raise AtomicFormatError(
                f"{path}: line 1: missing required column '{name}' (header has: {', '.join(cols)})"
            )
    return cols


def _read_lines(path: Path) -> list[str]:
    if not path.exists():
        raise AtomicFormatError(f"{path}: file not found")
    return read_text_lines(path, AtomicFormatError)


def _column_names(parts: list[str]) -> set[str] | None:
    """The column names if every field is a `name:type` header spec, else None."""
    if not all(":" in p for p in parts):
        return None
    return {p.split(":", 1)[0].strip() for p in parts}


def _data_rows(path: Path, lines: list[str]) -> Iterator[tuple[int, list[str]]]:
    """(line number, tab-separated fields) of each non-blank row below the header; a row with
    another number of fields than the header, or a second header row, is an error naming the line."""
    header = lines[0].rstrip("\n\r").split("\t")
    n_cols, names = len(header), _column_names(header)
    for lineno, raw in enumerate(lines[1:], start=2):
        line = raw.rstrip("\n\r")
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != n_cols:
            raise AtomicFormatError(
                f"{path}: line {lineno}: expected {n_cols} tab-separated columns, found {len(parts)}"
            )
        # Concatenated files repeat the header; read as data it would become an item (or a user)
        # called "item_id:token".
        if names is not None and _column_names([p.lstrip("\ufeff") for p in parts]) == names:
            raise AtomicFormatError(f"{path}: line {lineno}: repeats the header row (files concatenated?)")
        yield lineno, parts


def load_interactions(path: str | os.PathLike) -> Interactions:
    """Load a `.inter` file; raises AtomicFormatError naming file, line and field."""
    path = Path(path)
    lines = _read_lines(path)
    cols = _read_header(path, lines, INTER_REQUIRED)
    iu, ii, it = cols["user_id"], cols["item_id"], cols.get("timestamp")
    users, items, times = [], [], []
    seen: dict[tuple[str, str, float], int] = {}
    dups = 0
    for lineno, parts in _data_rows(path, lines):
        u, i = parts[iu].strip(), parts[ii].strip()
        if not u:
            raise AtomicFormatError(f"{path}: line {lineno}: field 'user_id' is empty")
        if not i:
            raise AtomicFormatError(f"{path}: line {lineno}: field 'item_id' is empty")
        ts, t = "none", 0.0  # no timestamp column: every row ties, and file order decides
        if it is not None:
            ts = parts[it].strip()
            try:
                t = float(ts)
            except ValueError:
                raise AtomicFormatError(
                    f"{path}: line {lineno}: field 'timestamp': cannot parse {ts!r} as a number"
                ) from None
            if not math.isfinite(t):
                raise AtomicFormatError(f"{path}: line {lineno}: field 'timestamp': {ts!r} is not finite")
        key = (u, i, t)
        if key in seen:
            dups += 1
            if dups <= 5:
                log.warning("%s: line %d duplicates line %d (user %s, item %s, timestamp %s); dropped",
                            path, lineno, seen[key], u, i, ts)
            continue
        seen[key] = lineno
        users.append(u)
        items.append(i)
        times.append(t)
    if not users:
        raise AtomicFormatError(f"{path}: empty file (header only, no interactions)")
    if dups:
        log.warning("%s: %d duplicate (user, item, timestamp) rows dropped", path, dups)
    if it is None:
        log.info("%s: no timestamp column: each user's sequence follows the order of the rows", path)
    elif len(users) > 1 and min(times) == max(times):
        log.info("%s: every row has timestamp %s: each user's sequence follows the order of the rows",
                 path, times[0])
    return Interactions(users, items, times, source=str(path), dropped_duplicates=dups)


def load_items(path: str | os.PathLike) -> ItemTable:
    """Load a `.item` file (item_id required; title, brand, categories optional)."""
    path = Path(path)
    lines = _read_lines(path)
    cols = _read_header(path, lines, ITEM_REQUIRED)
    table = ItemTable()
    for lineno, parts in _data_rows(path, lines):
        item = parts[cols["item_id"]].strip()
        if not item:
            raise AtomicFormatError(f"{path}: line {lineno}: field 'item_id' is empty")
        if item in table.titles:
            raise AtomicFormatError(f"{path}: line {lineno}: field 'item_id': {item!r} listed twice")
        table.titles[item] = parts[cols["title"]].strip() if "title" in cols else ""
        table.brands[item] = parts[cols["brand"]].strip() if "brand" in cols else ""
        table.categories[item] = parts[cols["categories"]].split() if "categories" in cols else []
    if not table.titles:
        raise AtomicFormatError(f"{path}: empty file (header only, no items)")
    return table


def write_interactions(path, users, items, timestamps) -> None:
    """`timestamps` None: a file without a timestamp column (row order is the sequence order)."""
    if timestamps is None:
        rows = ["user_id:token\titem_id:token"] + [f"{u}\t{i}" for u, i in zip(users, items)]
    else:
        rows = ["user_id:token\titem_id:token\ttimestamp:float"]
        rows += [f"{u}\t{i}\t{float(t)!r}" for u, i, t in zip(users, items, timestamps)]
    atomic_write_text(path, "\n".join(rows) + "\n")


_ITEM_TYPES = {"title": "token_seq", "brand": "token", "categories": "token_seq"}


def write_items(path, table: ItemTable, columns: tuple[str, ...] = ITEM_OPTIONAL) -> None:
    """item_id and the optional `columns` (a subset of ITEM_OPTIONAL, written in that order)."""
    unknown = sorted(set(columns) - set(ITEM_OPTIONAL))
    if unknown:
        raise ValueError(f"write_items: unknown column(s) {unknown}; choose from {ITEM_OPTIONAL}")
    columns = tuple(c for c in ITEM_OPTIONAL if c in columns)
    cells = {"title": lambda i: table.titles[i], "brand": lambda i: table.brands.get(i, ""),
             "categories": lambda i: " ".join(table.categories.get(i, []))}
    rows = ["\t".join(["item_id:token"] + [f"{c}:{_ITEM_TYPES[c]}" for c in columns])]
    rows += ["\t".join([item] + [cells[c](item) for c in columns]) for item in table.titles]
    atomic_write_text(path, "\n".join(rows) + "\n")
