"""A deterministic synthetic catalog and purchase log in RecBole atomic format.

The embedded default for `make demo` and the tests. It is built so that both stages have real
signal: items live in a category tree and belong to brands; users prefer a few top categories and
brands; and purchases follow co-purchase chains (each item has a few complements that are often
bought next, frequently on the same day). A sequential retriever can learn the chains; a re-ranker
can additionally use brand/category matches and co-purchase counts that the retriever blurs.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .atomic import ITEM_OPTIONAL, ItemTable, write_interactions, write_items

_TOP = ["Skin_Care", "Makeup", "Hair_Care", "Fragrance", "Bath_&_Body", "Tools_&_Accessories",
        "Nails", "Men's_Grooming"]
_MID = ["Face", "Eyes", "Lips", "Body", "Hands", "Styling", "Cleansing", "Treatments"]
_LEAF = ["Creams", "Serums", "Cleansers", "Masks", "Oils", "Balms", "Sprays", "Gels", "Powders",
         "Liners", "Brushes", "Polishes", "Shampoos", "Conditioners", "Lotions", "Scrubs"]
_ADJ = ["Hydrating", "Gentle", "Daily", "Intense", "Natural", "Ultra", "Matte", "Radiant", "Pure",
        "Repair", "Fresh", "Velvet", "Silk", "Clear", "Deep", "Soft"]
_SYL = ["lu", "ma", "ve", "ri", "so", "ka", "ne", "ol", "zi", "an", "to", "be", "ra", "mi"]


@dataclass
class SyntheticConfig:
    n_users: int = 600
    n_items: int = 0  # 0: derived from n_users
    seed: int = 0
    mean_extra_length: float = 4.0  # sequence length = 5 + geometric(mean_extra_length)
    p_complement: float = 0.45  # next item is a complement of the previous one
    p_brand: float = 0.15  # next item is from a brand the user likes
    p_affinity: float = 0.30  # next item from the user's favourite categories
    # Variants that lack what many RecBole datasets lack, so the pipeline is tested without it.
    # Applied after generation: the purchases (and the default files) do not change.
    brand_column: bool = True  # False: the .item file has no brand column
    titles: bool = True  # False: every title is empty
    timestamps: str = "real"  # "tied": one timestamp for every row; "none": no timestamp column


def _brand_name(rng: np.random.Generator, used: set[str]) -> str:
    while True:
        name = "".join(rng.choice(_SYL, size=rng.integers(2, 4))).capitalize()
        if name not in used:
            used.add(name)
            return name


def generate(cfg: SyntheticConfig):
    """Return (users, items, timestamps, ItemTable); deterministic in cfg.seed."""
    rng = np.random.default_rng(cfg.seed)
    n_items = cfg.n_items or max(120, int(cfg.n_users * 0.5))
    # Category tree: top > mid > leaf, a subset of combinations.
    leaves = []
    for t in _TOP:
        for m in rng.choice(_MID, size=3, replace=False):
            for leaf in rng.choice(_LEAF, size=3, replace=False):
                leaves.append((t, str(m), str(leaf)))
    n_brands = max(8, n_items // 15)
    used: set[str] = set()
    brands = [_brand_name(rng, used) for _ in range(n_brands)]
    brand_tops = [rng.choice(len(_TOP), size=rng.integers(1, 3), replace=False) for _ in brands]

    table = ItemTable()
    item_leaf = np.zeros(n_items, dtype=np.int64)
    item_brand = np.zeros(n_items, dtype=np.int64)
    ids = [f"I{k:05d}" for k in range(n_items)]
    for k in range(n_items):
        b = int(rng.integers(n_brands))
        top = _TOP[int(rng.choice(brand_tops[b]))]
        cand = [j for j, lf in enumerate(leaves) if lf[0] == top]
        lf = int(rng.choice(cand))
        item_leaf[k], item_brand[k] = lf, b
        t, m, leaf = leaves[lf]
        table.titles[ids[k]] = f"{brands[b]} {rng.choice(_ADJ)} {rng.choice(_ADJ)} {leaf.rstrip('s')}"
        table.brands[ids[k]] = brands[b]
        table.categories[ids[k]] = ["Beauty", t, f"{m}", leaf]
    popularity = rng.zipf(1.6, size=n_items).clip(max=200).astype(np.float64)

    # Complements: items in another leaf of the same top category, preferring the same brand.
    leaf_top = np.array([_TOP.index(lf[0]) for lf in leaves])
    complements = []
    for k in range(n_items):
        same_top = np.flatnonzero((leaf_top[item_leaf] == leaf_top[item_leaf[k]])
                                  & (item_leaf != item_leaf[k]))
        if len(same_top) == 0:
            same_top = np.flatnonzero(np.arange(n_items) != k)
        w = popularity[same_top] * np.where(item_brand[same_top] == item_brand[k], 4.0, 1.0)
        complements.append(rng.choice(same_top, size=min(3, len(same_top)), replace=False, p=w / w.sum()))
    by_top = [np.flatnonzero(leaf_top[item_leaf] == t) for t in range(len(_TOP))]
    by_brand = [np.flatnonzero(item_brand == b) for b in range(n_brands)]
    pop_p = popularity / popularity.sum()
    live_tops = [t for t in range(len(_TOP)) if len(by_top[t])]  # small catalogs leave some empty
    live_brands = [b for b in range(n_brands) if len(by_brand[b])]

    users, items, times = [], [], []
    for u in range(cfg.n_users):
        uid = f"U{u:06d}"
        tops = rng.choice(live_tops, size=min(len(live_tops), int(rng.integers(1, 3))), replace=False)
        fav_brands = rng.choice(live_brands, size=min(2, len(live_brands)), replace=False)
        length = 5 + int(rng.geometric(1.0 / (1.0 + cfg.mean_extra_length)) - 1)
        pool = np.concatenate([by_top[t] for t in tops])
        w0 = popularity[pool] * np.where(np.isin(item_brand[pool], fav_brands), 3.0, 1.0)
        seq = [int(rng.choice(pool, p=w0 / w0.sum()))]
        day = float(rng.integers(1_300_000_000 // 86400, 1_400_000_000 // 86400)) * 86400.0
        stamps = [day]
        while len(seq) < length:
            r = rng.random()
            last = seq[-1]
            if r < cfg.p_complement:
                nxt = int(rng.choice(complements[last]))
            elif r < cfg.p_complement + cfg.p_brand:
                nxt = int(rng.choice(by_brand[int(rng.choice(fav_brands))]))
            elif r < cfg.p_complement + cfg.p_brand + cfg.p_affinity:
                nxt = int(rng.choice(pool, p=w0 / w0.sum()))
            else:
                nxt = int(rng.choice(n_items, p=pop_p))
            if nxt in seq:
                continue
            same_day = r < cfg.p_complement and rng.random() < 0.6
            day = day if same_day else day + 86400.0 * float(rng.integers(1, 60))
            seq.append(nxt)
            # Review-day seconds plus position, like the Beauty files: ties break in sequence order.
            stamps.append(day + len(seq))
        users += [uid] * len(seq)
        items += [ids[k] for k in seq]
        times += stamps
    return users, items, times, table


TIMESTAMP_VARIANTS = ("real", "tied", "none")


def write_synthetic(out_dir: str | Path, cfg: SyntheticConfig | None = None, name: str = "synthetic") -> Path:
    """Write `<name>.inter` and `<name>.item` into out_dir and return the directory."""
    cfg = cfg or SyntheticConfig()
    if cfg.timestamps not in TIMESTAMP_VARIANTS:
        raise ValueError(f"SyntheticConfig.timestamps: {cfg.timestamps!r} is not one of {TIMESTAMP_VARIANTS}")
    out = Path(out_dir)
    users, items, times, table = generate(cfg)
    if cfg.timestamps != "real":
        # Rows are written user by user in purchase order, so file order still holds the sequence.
        times = None if cfg.timestamps == "none" else [0.0] * len(times)
    if not cfg.titles:
        table.titles = dict.fromkeys(table.titles, "")
    columns = tuple(c for c in ITEM_OPTIONAL if cfg.brand_column or c != "brand")
    write_interactions(out / f"{name}.inter", users, items, times)
    write_items(out / f"{name}.item", table, columns)
    return out
