"""FAISS inner-product index over item embeddings, with history-excluding top-N search.

Exact (`flat`) is the default because the candidate lists must equal RecBole's full-sort top-N.
`hnsw` and `ivfpq` are there for large catalogues; their recall against exact is measured.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import faiss
import numpy as np

from .files import atomic_write_text

KINDS = ("flat", "hnsw", "ivfpq")


def mips_to_l2(x: np.ndarray) -> tuple[np.ndarray, float]:
    """Append sqrt(M^2 - |x|^2) to each item vector (M = the largest norm): then the L2 nearest
    neighbour of a query padded with 0 is its maximum-inner-product item. Graph indexes (HNSW)
    navigate a metric space far better than raw inner products (0.94 -> 0.99+ recall@10 on Beauty)."""
    norms2 = (x.astype(np.float64) ** 2).sum(1)
    m2 = float(norms2.max()) if len(norms2) else 0.0
    extra = np.sqrt(np.maximum(m2 - norms2, 0.0)).astype(np.float32)[:, None]
    return np.ascontiguousarray(np.hstack([x, extra]), dtype=np.float32), m2


class ItemIndex:
    def __init__(self, index: faiss.Index, item_ids: list[str], kind: str, max_norm2: float = 0.0):
        self.index = index
        self.item_ids = list(item_ids)
        self.kind = kind
        self.max_norm2 = max_norm2  # hnsw: the MIPS -> L2 transform's M^2
        self._pos = {i: k for k, i in enumerate(self.item_ids)}

    @classmethod
    def build(cls, embeddings: np.ndarray, item_ids: list[str], kind: str = "flat",
              hnsw_m: int = 32, ef_construction: int = 200, ef_search: int = 128,
              nlist: int = 0, pq_m: int = 8, nprobe: int = 16) -> "ItemIndex":
        if kind not in KINDS:
            raise ValueError(f"index kind {kind!r} is not one of {KINDS}")
        x = np.ascontiguousarray(embeddings, dtype=np.float32)
        if x.ndim != 2 or len(x) != len(item_ids):
            raise ValueError(f"embeddings shape {x.shape} does not match {len(item_ids)} item ids")
        d = x.shape[1]
        max_norm2 = 0.0
        if kind == "flat":
            index = faiss.IndexFlatIP(d)
        elif kind == "hnsw":
            x, max_norm2 = mips_to_l2(x)
            index = faiss.IndexHNSWFlat(d + 1, hnsw_m)
            index.hnsw.efConstruction = ef_construction
            index.hnsw.efSearch = ef_search
        else:
            nlist = nlist or max(1, min(1024, int(np.sqrt(len(x)))))
            if d % pq_m:
                raise ValueError(f"ivfpq: pq_m={pq_m} must divide the embedding size {d}")
            index = faiss.index_factory(d, f"IVF{nlist},PQ{pq_m}", faiss.METRIC_INNER_PRODUCT)
            index.train(x)
            index.nprobe = nprobe
        index.add(x)
        return cls(index, item_ids, kind, max_norm2)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(inner-product scores, item positions), best first, for every index kind."""
        q = np.ascontiguousarray(queries, dtype=np.float32)
        k = min(k, len(self.item_ids))
        if self.kind != "hnsw":
            return self.index.search(q, k)
        qa = np.ascontiguousarray(np.hstack([q, np.zeros((len(q), 1), np.float32)]))
        dist, ix = self.index.search(qa, k)
        q2 = (q.astype(np.float64) ** 2).sum(1, keepdims=True)
        return ((q2 + self.max_norm2 - dist) / 2.0).astype(np.float32), ix

    def top_n_excluding(self, queries: np.ndarray, exclude: list[set[str]], n: int,
                        allowed: np.ndarray | None = None) -> tuple[list[list[str]], list[list[float]]]:
        """Top-n items per query, skipping each query's `exclude` set (its history).

        A first search asks for n + 16; queries that lose too many hits to exclusion are searched
        again with enough room for their whole exclusion set.
        """
        blocked = [set(e) for e in exclude]
        if allowed is not None:
            never = {self.item_ids[k] for k in np.flatnonzero(~allowed)}
            blocked = [b | never for b in blocked]
        items: list[list[str]] = [[] for _ in range(len(queries))]
        scores: list[list[float]] = [[] for _ in range(len(queries))]
        todo = np.arange(len(queries))
        k = n + 16
        while len(todo):
            s, ix = self.search(queries[todo], k)
            retry = []
            for row, qi in enumerate(todo):
                got_i, got_s = [], []
                for j, sc in zip(ix[row], s[row]):
                    if j < 0:
                        continue
                    item = self.item_ids[j]
                    if item in blocked[qi]:
                        continue
                    got_i.append(item)
                    got_s.append(float(sc))
                    if len(got_i) == n:
                        break
                if len(got_i) < n and k < len(self.item_ids):
                    retry.append(qi)
                items[qi], scores[qi] = got_i, got_s
            todo = np.array(retry, dtype=np.int64)
            k = min(len(self.item_ids), n + max((len(blocked[q]) for q in retry), default=0) + 16)
        return items, scores

    def save(self, directory: str | os.PathLike) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")
        os.close(fd)
        faiss.write_index(self.index, tmp)
        os.replace(tmp, d / "items.faiss")
        atomic_write_text(d / "items.json", json.dumps({"kind": self.kind, "max_norm2": self.max_norm2,
                                                        "item_ids": self.item_ids}))

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "ItemIndex":
        d = Path(directory)
        for f in ("items.faiss", "items.json"):
            if not (d / f).exists():
                raise FileNotFoundError(f"{d / f}: missing; build the index with `dgr2 retrieve` first")
        meta = json.loads((d / "items.json").read_text())
        return cls(faiss.read_index(str(d / "items.faiss")), meta["item_ids"], meta["kind"],
                   float(meta.get("max_norm2", 0.0)))
