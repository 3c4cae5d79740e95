"""k-core filtering and the leave-one-out split by time (TIGER / S3-Rec protocol).

Each user's sequence is sorted by (timestamp, file order): equal timestamps (day-granular stamps,
a file where every row has one timestamp, or no timestamp column at all) keep the order of the
rows in the file, so the split of a given file is deterministic. The last item is the test target, the
second-to-last the validation target, and every earlier position t >= 1 is a training example
(prefix s[:t] -> s[t]).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .atomic import Interactions


@dataclass
class Sequences:
    """Time-ordered item sequences per user (raw ids), after filtering."""

    by_user: dict[str, list[str]]
    items: list[str]  # every item that occurs, in first-seen order

    @property
    def n_interactions(self) -> int:
        return sum(len(s) for s in self.by_user.values())


def build_sequences(inter: Interactions) -> dict[str, list[str]]:
    order = sorted(range(len(inter)), key=lambda k: (inter.users[k], inter.timestamps[k], k))
    seqs: dict[str, list[str]] = {}
    for k in order:
        seqs.setdefault(inter.users[k], []).append(inter.items[k])
    return seqs


def k_core(seqs: dict[str, list[str]], user_k: int = 5, item_k: int = 5) -> dict[str, list[str]]:
    """Iteratively drop users with < user_k and items with < item_k interactions until stable."""
    seqs = {u: list(s) for u, s in seqs.items()}
    while True:
        item_count = Counter(i for s in seqs.values() for i in s)
        bad_items = {i for i, c in item_count.items() if c < item_k}
        if bad_items:
            seqs = {u: [i for i in s if i not in bad_items] for u, s in seqs.items()}
        bad_users = [u for u, s in seqs.items() if len(s) < user_k]
        for u in bad_users:
            del seqs[u]
        if not bad_items and not bad_users:
            return seqs


def filter_sequences(inter: Interactions, user_k: int = 5, item_k: int = 5) -> Sequences:
    """Sequences after the k-core filter. Users need >= 3 items for leave-one-out in any case."""
    seqs = k_core(build_sequences(inter), max(user_k, 3), item_k)
    if not seqs:
        raise ValueError(
            f"{inter.source}: no user survives the {user_k}-core / {item_k}-core filter "
            f"({len(set(inter.users))} users before); lower k_core in the config"
        )
    seen: dict[str, None] = {}
    for s in seqs.values():
        for i in s:
            seen.setdefault(i, None)
    return Sequences(seqs, list(seen))


@dataclass(frozen=True)
class Example:
    """One next-item example: the user's items before `position` predict the item at `position`."""

    user: str
    position: int
    split: str  # "train" | "valid" | "test"


def leave_one_out(seqs: dict[str, list[str]]) -> dict[str, list[Example]]:
    """Examples per split. Test = last item, valid = second-to-last, train = positions 1..n-3."""
    out: dict[str, list[Example]] = {"train": [], "valid": [], "test": []}
    for u, s in seqs.items():
        n = len(s)
        if n < 3:
            raise ValueError(f"user {u!r} has {n} interactions; leave-one-out needs at least 3")
        out["test"].append(Example(u, n - 1, "test"))
        out["valid"].append(Example(u, n - 2, "valid"))
        out["train"].extend(Example(u, t, "train") for t in range(1, n - 2))
    return out


def train_sequences(seqs: dict[str, list[str]]) -> dict[str, list[str]]:
    """The part of every sequence a model may train on (validation and test items removed)."""
    return {u: s[:-2] for u, s in seqs.items()}
