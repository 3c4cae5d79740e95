"""GR2's collaborative context: co-purchase counts and content matches per candidate.

The headroom study found co-purchase counts ("users who bought X right after the
user's last item") carry most of the re-ranking signal, then category and brand.
The prompt states this evidence for every candidate so the LM need not memorise
the co-purchase graph. Counts come from the training split only, and a user's own
pairs are subtracted when describing that user's candidates: otherwise a training
example would show the model its own answer as "collaborative evidence".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np


class ItemMeta(NamedTuple):
    title: str
    brand: str
    categories: tuple[str, ...]

    @property
    def leaf_category(self) -> str:
        """Last category of the flattened path list ("" when the item has none)."""
        return self.categories[-1] if self.categories else ""


def _clean(value) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return ""
    return str(value).strip()


ITEM_FIELDS = ("title", "brand", "categories")


class ItemCatalog(dict):
    """item_id -> ItemMeta, knowing which metadata fields no item has (``absent``).

    Many RecBole datasets have no brand column, or empty titles: a field absent from the whole
    catalog is left out of the prompt lines instead of writing "no brand" on every one of them.
    A plain mapping works wherever a catalog does, with nothing absent."""

    def __init__(self, entries=(), absent=frozenset()):
        super().__init__(entries)
        self.absent = frozenset(absent)


def absent_fields(items_meta: Mapping) -> frozenset[str]:
    """The ITEM_FIELDS that no item of the catalog has (none for a plain mapping)."""
    return getattr(items_meta, "absent", frozenset())


def absent_fields_note(items_meta: Mapping, source) -> str | None:
    """One line saying what an absent field changes downstream, or None when nothing is absent."""
    absent = [f for f in ITEM_FIELDS if f in absent_fields(items_meta)]
    if not absent:
        return None
    effects = {"title": "semantic IDs and prompts use no title words",
               "brand": "prompts leave brand names and brand counts out; the brand features and the "
                        "baselines' brand tie-break are 0 for every candidate",
               "categories": "prompts leave category names and matches out; the category features are 0"}
    return (f"{source}: no item has a {' / '.join(absent)}: "
            + "; ".join(effects[f] for f in absent))


def item_meta_lookup(items) -> ItemCatalog:
    """item_id -> ItemMeta from the items DataFrame (build once, reuse for every prompt)."""
    missing = [c for c in ("item_id", "title", "brand", "categories") if c not in items.columns]
    if missing:
        raise ValueError(f"items table lacks column(s) {missing}; has {list(items.columns)}")
    out: dict[str, ItemMeta] = {}
    for item, title, brand, cats in zip(items["item_id"], items["title"], items["brand"], items["categories"]):
        if isinstance(cats, str):
            cats = cats.split()
        elif cats is None or (isinstance(cats, float) and cats != cats):
            cats = ()
        out[str(item)] = ItemMeta(_clean(title), _clean(brand), tuple(str(c) for c in cats))
    present = {"title": any(m.title for m in out.values()), "brand": any(m.brand for m in out.values()),
               "categories": any(m.categories for m in out.values())}
    return ItemCatalog(out, (f for f in ITEM_FIELDS if not present[f]))


def save_item_catalog(path, catalog: Mapping, items) -> Path:
    """The prompt fields (title, brand, categories) of `items`, and which fields the whole catalog
    lacks (its `absent`, which a subset could not recompute), as JSON written atomically."""
    from candidate_gen.files import atomic_write_json

    empty = ItemMeta("", "", ())
    rows = {str(i): catalog.get(str(i), empty)._asdict() for i in items}
    for row in rows.values():
        row["categories"] = list(row["categories"])
    return atomic_write_json(path, {"format": "diffusion-gr2/item-fields/v1",
                                    "absent": [f for f in ITEM_FIELDS if f in absent_fields(catalog)],
                                    "items": rows})


def load_item_catalog(path) -> ItemCatalog:
    """An ItemCatalog saved by `save_item_catalog`; a missing file or field is an error naming it."""
    import json

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; the item fields file (`dgr2 release` writes it)")
    doc = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(doc, dict) or not isinstance(doc.get("items"), dict):
        raise ValueError(f"{path}: expected an object with an 'items' mapping (item_id -> fields)")
    out = {}
    for item, row in doc["items"].items():
        missing = [f for f in ITEM_FIELDS if f not in row]
        if missing:
            raise ValueError(f"{path}: item {item!r} lacks field(s) {missing}")
        out[item] = ItemMeta(str(row["title"]), str(row["brand"]), tuple(str(c) for c in row["categories"]))
    return ItemCatalog(out, doc.get("absent") or ())


def as_item_meta(items_meta) -> Mapping[str, ItemMeta]:
    """Accept a ready mapping (cheap) or a DataFrame (converted on every call: convert once instead)."""
    if isinstance(items_meta, Mapping):
        return items_meta
    if hasattr(items_meta, "columns"):
        return item_meta_lookup(items_meta)
    raise TypeError(f"items_meta must be a mapping item_id -> ItemMeta or a DataFrame, got {type(items_meta).__name__}")


class CoPurchaseCounts:
    """Counts of ordered pairs (a, b): b bought within ``window`` positions after a.

    Storage is flat sorted int64 pair keys (a_index * n_items + b_index), globally and
    per user (CSR-style: one slice of the per-user arrays per user), so memory is a few
    arrays of the number of pairs, and excluding a user is one binary search in the
    global keys plus one in that user's short slice.
    """

    def __init__(self, window: int = 1):
        if int(window) < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = int(window)
        self._item_index: dict[str, int] = {}
        self._keys = np.zeros(0, dtype=np.int64)
        self._counts = np.zeros(0, dtype=np.int64)
        self._user_slot: dict[str, int] = {}
        self._user_ptr = np.zeros(1, dtype=np.int64)
        self._user_keys = np.zeros(0, dtype=np.int64)
        self._user_counts = np.zeros(0, dtype=np.int64)

    @classmethod
    def fit(cls, train_sequences: Mapping[str, Sequence[str]], window: int = 1) -> "CoPurchaseCounts":
        """Count pairs over the TRAINING sequences (time-ordered item lists per user)."""
        self = cls(window)
        index = self._item_index
        for seq in train_sequences.values():
            for item in seq:
                index.setdefault(str(item), len(index))
        n = max(len(index), 1)
        ptr = [0]
        user_keys: list[np.ndarray] = []
        user_counts: list[np.ndarray] = []
        for slot, (user, seq) in enumerate(train_sequences.items()):
            self._user_slot[str(user)] = slot
            codes = np.fromiter((index[str(i)] for i in seq), dtype=np.int64, count=len(seq))
            pairs = [codes[:-lag] * n + codes[lag:] for lag in range(1, self.window + 1) if lag < len(codes)]
            keys = np.concatenate(pairs) if pairs else np.zeros(0, dtype=np.int64)
            keys, counts = np.unique(keys, return_counts=True)
            user_keys.append(keys)
            user_counts.append(counts.astype(np.int64))
            ptr.append(ptr[-1] + len(keys))
        self._user_ptr = np.asarray(ptr, dtype=np.int64)
        if user_keys:
            self._user_keys = np.concatenate(user_keys)
            self._user_counts = np.concatenate(user_counts)
            order = np.argsort(self._user_keys, kind="stable")
            sorted_keys = self._user_keys[order]
            sorted_counts = self._user_counts[order]
            self._keys, starts = np.unique(sorted_keys, return_index=True)
            self._counts = np.add.reduceat(sorted_counts, starts) if len(starts) else np.zeros(0, dtype=np.int64)
        return self

    # The arrays of a saved CoPurchaseCounts (`save` / `load`): plain numbers and strings, no objects.
    _ARRAYS = ("keys", "counts", "user_ptr", "user_keys", "user_counts")

    def save(self, path) -> Path:
        """The counts as a compressed .npz of plain arrays (item and user ids as unicode arrays), so a
        release can serve the same evidence without the training sequences; written atomically.
        `load` reads it with allow_pickle=False: no object in the file is ever unpickled."""
        from candidate_gen.files import atomic_write

        arrays = {"window": np.asarray(self.window, dtype=np.int64),
                  "items": np.asarray(list(self._item_index), dtype=str),
                  "users": np.asarray(list(self._user_slot), dtype=str),
                  **{name: getattr(self, "_" + name) for name in self._ARRAYS}}

        def write(tmp: str) -> None:
            with open(tmp, "wb") as f:  # a file object: np.savez would append ".npz" to a name
                np.savez_compressed(f, **arrays)

        return atomic_write(path, write)

    @classmethod
    def load(cls, path) -> "CoPurchaseCounts":
        """Counts saved by `save`; a missing file or array is an error naming it."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing; the co-purchase evidence file (`dgr2 release` writes it)")
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in ("window", "items", "users", *cls._ARRAYS) if k not in z.files]
            if missing:
                raise ValueError(f"{path}: not a co-purchase evidence file, lacks array(s) {missing}")
            self = cls(int(z["window"]))
            self._item_index = {str(item): i for i, item in enumerate(z["items"].tolist())}
            self._user_slot = {str(user): i for i, user in enumerate(z["users"].tolist())}
            for name in cls._ARRAYS:
                setattr(self, "_" + name, z[name].astype(np.int64))
        if len(self._user_ptr) != len(self._user_slot) + 1:
            raise ValueError(f"{path}: user_ptr has {len(self._user_ptr)} entries for {len(self._user_slot)} users")
        return self

    @property
    def n_pairs(self) -> int:
        """Distinct ordered pairs seen in training."""
        return int(len(self._keys))

    def _key(self, a: str, b: str) -> int | None:
        ia = self._item_index.get(str(a))
        ib = self._item_index.get(str(b))
        if ia is None or ib is None:
            return None
        return ia * max(len(self._item_index), 1) + ib

    @staticmethod
    def _lookup(keys: np.ndarray, counts: np.ndarray, key: int) -> int:
        pos = int(np.searchsorted(keys, key))
        if pos < len(keys) and keys[pos] == key:
            return int(counts[pos])
        return 0

    def count(self, a: str, b: str, exclude_user: str | None = None) -> int:
        """How often b followed a (within the window) in training, minus ``exclude_user``'s own pairs.

        Items never seen in training count 0; an unknown ``exclude_user`` subtracts nothing.
        """
        key = self._key(a, b)
        if key is None:
            return 0
        total = self._lookup(self._keys, self._counts, key)
        if exclude_user is not None and total:
            slot = self._user_slot.get(str(exclude_user))
            if slot is not None:
                lo, hi = self._user_ptr[slot], self._user_ptr[slot + 1]
                total -= self._lookup(self._user_keys[lo:hi], self._user_counts[lo:hi], key)
        return total


RECENT_FOR_COPURCHASE = 3


def candidate_evidence(
    history: Sequence[str],
    candidate: str,
    items_meta,
    copurchase: CoPurchaseCounts,
    user: str | None,
) -> dict:
    """Evidence for one candidate given the user's time-ordered history.

    copurchase_recent[i] = count(history[-1 - i], candidate) for the last 3 items, most
    recent first (shorter when the history is); the user's own training pairs excluded.
    Brand/category matches are against the whole ``history`` passed in; empty brands and
    categories never match.
    """
    meta = as_item_meta(items_meta)
    empty = ItemMeta("", "", ())
    cand = meta.get(candidate, empty)
    recent = [copurchase.count(h, candidate, exclude_user=user) for h in reversed(history[-RECENT_FOR_COPURCHASE:])]
    hist_meta = [meta.get(h, empty) for h in history]
    brand_matches = sum(1 for m in hist_meta if cand.brand and m.brand == cand.brand)
    leaf_matches = sum(1 for m in hist_meta if cand.leaf_category and m.leaf_category == cand.leaf_category)
    hist_cats = set().union(*(m.categories for m in hist_meta)) if hist_meta else set()
    cand_cats = set(cand.categories)
    union = hist_cats | cand_cats
    return {
        "copurchase_recent": recent,
        "copurchase_after_last": recent[0] if recent else 0,
        "copurchase_max": max(recent, default=0),
        "copurchase_sum": sum(recent),
        "brand_match_count": brand_matches,
        "brand_match": brand_matches > 0,
        "leaf_category_match_count": leaf_matches,
        "leaf_category_match": leaf_matches > 0,
        "category_jaccard": (len(hist_cats & cand_cats) / len(union)) if union else 0.0,
        "leaf_category": cand.leaf_category,
        "brand": cand.brand,
        "window": copurchase.window,
    }


def candidates_evidence(history, candidates, items_meta, copurchase, user) -> list[dict]:
    """:func:`candidate_evidence` for every candidate, in candidate order."""
    meta = as_item_meta(items_meta)
    return [candidate_evidence(history, c, meta, copurchase, user) for c in candidates]
