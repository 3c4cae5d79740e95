"""Semantic IDs (TIGER protocol): residual k-means codes over item content embeddings.

Every item becomes four code tokens, ``<a_i><b_j><c_k><d_l>``, wrapped in
``<|sid_begin|>`` / ``<|sid_end|>``. The first three codes come from residual
k-means (RQ-KMeans with faiss), so items with similar content share prefixes and
the LM can generalise across them; the fourth code only numbers the items that
share a three-code prefix, which makes every SID unique without another
quantisation level.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence

import numpy as np

from candidate_gen.files import atomic_write_text

SID_BEGIN = "<|sid_begin|>"
SID_END = "<|sid_end|>"
# One letter per code position; the tokenizer adds <x_0> ... <x_{SID_CODEBOOK-1}> for each.
SID_LETTERS = ("a", "b", "c", "d")
# Hard ceiling of every code position: the tokenizer's SID vocabulary has this many tokens
# per letter, so neither a k-means codebook nor the dedup level may exceed it.
SID_CODEBOOK = 256

# One SID string, its four codes as groups (search, sub or fullmatch with it).
SID_RE = re.compile(
    re.escape(SID_BEGIN) + "".join(rf"<{letter}_(\d+)>" for letter in SID_LETTERS) + re.escape(SID_END)
)


def sid_token_vocabulary(codebook: int = SID_CODEBOOK) -> list[str]:
    """All SID tokens the tokenizer must hold as single tokens: code tokens, then begin/end."""
    codes = [f"<{letter}_{i}>" for letter in SID_LETTERS for i in range(codebook)]
    return codes + [SID_BEGIN, SID_END]


def format_sid(codes: Sequence[int]) -> str:
    """Render a 4-code tuple as its SID string."""
    if len(codes) != len(SID_LETTERS):
        raise ValueError(f"a SID has {len(SID_LETTERS)} codes, got {tuple(codes)!r}")
    body = "".join(f"<{letter}_{int(c)}>" for letter, c in zip(SID_LETTERS, codes))
    return f"{SID_BEGIN}{body}{SID_END}"


def parse_sid(sid: str) -> tuple[int, int, int, int]:
    """Inverse of :func:`format_sid`; exact match only (no whitespace or partial SIDs)."""
    m = SID_RE.fullmatch(sid)
    if m is None:
        raise ValueError(f"not a SID string: {sid!r}")
    return tuple(int(g) for g in m.groups())  # type: ignore[return-value]


def effective_codebook_size(n_items: int, requested: int = SID_CODEBOOK) -> int:
    """Codebook size actually used for ``n_items`` items.

    k-means with more centroids than ~n/4 points leaves most clusters with one or two
    items, which wastes code space and makes prefixes meaningless, so small catalogs
    get min(requested, n_items // 4), never below 2 (and never above n_items, which
    faiss cannot train).
    """
    if n_items < 1:
        raise ValueError(f"need at least one item to build semantic IDs, got n_items={n_items}")
    if not 2 <= requested <= SID_CODEBOOK:
        raise ValueError(f"codebook_size must be in [2, {SID_CODEBOOK}], got {requested}")
    return max(1, min(requested, max(2, n_items // 4), n_items))


class SemanticIds:
    """Item <-> SID mapping plus the statistics of how it was built."""

    def __init__(self, codes: Mapping[str, Sequence[int]], meta: Mapping | None = None):
        self._codes: dict[str, tuple[int, ...]] = {}
        self._items: dict[tuple[int, ...], str] = {}
        for item, code in codes.items():
            code = tuple(int(c) for c in code)
            if len(code) != len(SID_LETTERS):
                raise ValueError(f"item {item!r} has {len(code)} codes, expected {len(SID_LETTERS)}: {code!r}")
            bad = [c for c in code if not 0 <= c < SID_CODEBOOK]
            if bad:
                raise ValueError(f"item {item!r} has code(s) {bad} outside [0, {SID_CODEBOOK})")
            if code in self._items:
                raise ValueError(f"items {self._items[code]!r} and {item!r} share the SID {format_sid(code)}")
            self._codes[str(item)] = code
            self._items[code] = str(item)
        self.meta: dict = dict(meta or {})

    def __len__(self) -> int:
        return len(self._codes)

    def __contains__(self, item: object) -> bool:
        return item in self._codes

    @property
    def item_ids(self) -> list[str]:
        return list(self._codes)

    def codes(self, item: str) -> tuple[int, ...]:
        try:
            return self._codes[item]
        except KeyError:
            raise KeyError(f"item {item!r} has no semantic ID") from None

    def item_for_codes(self, codes: Sequence[int]) -> str:
        key = tuple(int(c) for c in codes)
        try:
            return self._items[key]
        except KeyError:
            raise KeyError(f"no item has the codes {key!r}") from None

    def sid_string(self, item: str) -> str:
        return format_sid(self.codes(item))

    def item_for_sid_string(self, sid: str) -> str:
        codes = parse_sid(sid)
        try:
            return self._items[codes]
        except KeyError:
            raise KeyError(f"no item has the SID {sid!r}") from None

    def report(self) -> dict:
        """Quality numbers of the code assignment (all recomputed from the codes)."""
        n = len(self._codes)
        prefixes = defaultdict(int)
        for code in self._codes.values():
            prefixes[code[:3]] += 1
        used = [len({code[level] for code in self._codes.values()}) for level in range(len(SID_LETTERS))]
        return {
            "n_items": n,
            # Share of items that needed a non-zero 4th code, i.e. 1 - distinct prefixes / items.
            "collision_rate_after_3_levels": (1.0 - len(prefixes) / n) if n else 0.0,
            # Share of items living in a prefix that some other item also has.
            "items_in_colliding_prefixes": (sum(c for c in prefixes.values() if c > 1) / n) if n else 0.0,
            "max_items_per_prefix": max(prefixes.values(), default=0),
            "unique_fraction": (len(self._items) / n) if n else 1.0,
            "codebook_sizes": list(self.meta.get("codebook_sizes", [])),
            "codes_used_per_level": used,
            "requested_codebook_size": self.meta.get("requested_codebook_size"),
            "embedding_method": self.meta.get("embedding_method"),
            "seed": self.meta.get("seed"),
        }

    def save(self, path: str | os.PathLike) -> None:
        payload = {"format": "diffusion-gr2/semantic-ids/v1", "meta": self.meta, "codes": self._codes}
        atomic_write_text(path, json.dumps(payload, sort_keys=True))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SemanticIds":
        with open(path, encoding="utf-8") as handle:
            payload = json.load(handle)
        if payload.get("format") != "diffusion-gr2/semantic-ids/v1":
            raise ValueError(f"{os.fspath(path)!r} is not a semantic-ID file (format={payload.get('format')!r})")
        return cls(payload["codes"], payload.get("meta"))


def _as_categories(value) -> list[str]:
    """Categories as a list; tolerate the raw space-separated token_seq string and NaN."""
    if value is None or (isinstance(value, float) and value != value):
        return []
    if isinstance(value, str):
        return value.split()
    return [str(c) for c in value]


def _as_text(value) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return ""
    return str(value)


def item_content_tokens(title: str, brand: str, categories: Sequence[str]) -> list[str]:
    """Bag of tokens for TF-IDF: title words, one whole-brand token, one token per category.

    Brand and category names are kept whole (prefixed) so that "Nail_Polish" as a category
    never merges with the word "polish" in some title: they are different evidence.
    """
    tokens = re.findall(r"\w+", _as_text(title).lower())
    if _as_text(brand).strip():
        tokens.append("brand:" + _as_text(brand).strip().lower())
    tokens.extend("cat:" + c.lower() for c in _as_categories(categories))
    return tokens


def content_embeddings(items, method: str = "tfidf", dim: int = 64, seed: int = 0, model_dir=None) -> np.ndarray:
    """L2-normalised float32 content embeddings, one row per row of ``items``.

    ``items`` is a DataFrame with item_id, title, brand, categories. "tfidf" (default, no
    model needed): TF-IDF over title words + brand + categories, TruncatedSVD to ``dim``
    (zero-padded when the catalog has fewer features, so the width is always ``dim``).
    "sentence-transformers": encode "title. brand. categories" with a local model directory
    (no download); ``dim`` is then the model's own width and is ignored.
    Items with no text at all get a zero row.
    """
    missing = [c for c in ("item_id", "title", "brand", "categories") if c not in items.columns]
    if missing:
        raise ValueError(f"items table lacks column(s) {missing}; has {list(items.columns)}")
    if len(items) == 0:
        raise ValueError("items table is empty")
    if method == "tfidf":
        from sklearn.decomposition import TruncatedSVD
        from sklearn.feature_extraction.text import TfidfVectorizer

        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        docs = [
            item_content_tokens(t, b, c)
            for t, b, c in zip(items["title"], items["brand"], items["categories"])
        ]
        vec = TfidfVectorizer(analyzer=lambda doc: doc, sublinear_tf=True, dtype=np.float64)
        if not any(docs):
            return np.zeros((len(items), dim), dtype=np.float32)
        tfidf = vec.fit_transform(docs)
        rank = min(dim, tfidf.shape[1] - 1, tfidf.shape[0] - 1)
        out = np.zeros((len(items), dim), dtype=np.float64)
        if rank >= 1:
            svd = TruncatedSVD(n_components=rank, algorithm="randomized", n_iter=7, random_state=seed)
            out[:, :rank] = svd.fit_transform(tfidf)
    elif method == "sentence-transformers":
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError:
            raise ImportError("method='sentence-transformers' needs the sentence-transformers package") from None
        if model_dir is None or not os.path.isdir(model_dir):
            raise ValueError(f"method='sentence-transformers' needs a local model directory, got model_dir={model_dir!r}")
        texts = [
            ". ".join(p for p in (_as_text(t), _as_text(b).replace("_", " "),
                                  " > ".join(c.replace("_", " ") for c in _as_categories(cs))) if p)
            for t, b, cs in zip(items["title"], items["brand"], items["categories"])
        ]
        model = SentenceTransformer(os.fspath(model_dir), device="cpu")
        out = np.asarray(model.encode(texts, batch_size=64, show_progress_bar=False), dtype=np.float64)
    else:
        raise ValueError(f"unknown embedding method {method!r}; use 'tfidf' or 'sentence-transformers'")
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    out = np.divide(out, norms, out=np.zeros_like(out), where=norms > 1e-12)
    return out.astype(np.float32)


def _kmeans_codes(x: np.ndarray, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """One residual level: train k-means, return (assignments, centroids)."""
    import faiss

    if k == 1:
        return np.zeros(len(x), dtype=np.int64), x.mean(axis=0, keepdims=True).astype(np.float32)
    # min_points_per_centroid=1 silences faiss' "please provide at least ..." warning on
    # small catalogs; a huge max_points_per_centroid stops it from subsampling.
    km = faiss.Kmeans(
        x.shape[1], k, niter=25, seed=int(seed), verbose=False,
        min_points_per_centroid=1, max_points_per_centroid=1 << 30,
    )
    km.train(x)
    _, assign = km.index.search(x, 1)
    return assign[:, 0].astype(np.int64), np.asarray(km.centroids, dtype=np.float32)


def build_semantic_ids(
    embeddings: np.ndarray,
    item_ids: Sequence[str],
    levels: int = 3,
    codebook_size: int = SID_CODEBOOK,
    seed: int = 0,
    embedding_method: str | None = None,
) -> SemanticIds:
    """RQ-KMeans codes for ``levels`` levels, then one dedup code (TIGER's 4th code).

    Level l runs k-means (seed + l) on the residual left by levels < l. Items sharing the
    full k-means prefix are numbered 0, 1, 2, ... by sorted item_id, so the result does
    not depend on row order beyond what k-means itself sees.
    """
    if levels != len(SID_LETTERS) - 1:
        raise ValueError(f"SIDs have {len(SID_LETTERS) - 1} k-means levels plus a dedup code; got levels={levels}")
    x = np.ascontiguousarray(np.asarray(embeddings, dtype=np.float32))
    ids = [str(i) for i in item_ids]
    if x.ndim != 2 or x.shape[0] != len(ids):
        raise ValueError(f"embeddings shape {x.shape} does not match {len(ids)} item ids")
    if len(set(ids)) != len(ids):
        dup = next(i for i, c in Counter(ids).items() if c > 1)
        raise ValueError(f"item id {dup!r} appears more than once")
    if not np.isfinite(x).all():
        raise ValueError("embeddings contain NaN or inf")
    k = effective_codebook_size(len(ids), codebook_size)

    residual = x.copy()
    codes = np.zeros((len(ids), levels), dtype=np.int64)
    for level in range(levels):
        assign, centroids = _kmeans_codes(residual, k, seed + level)
        codes[:, level] = assign
        residual -= centroids[assign]

    groups: dict[tuple[int, ...], list[str]] = defaultdict(list)
    for item, code in zip(ids, codes):
        groups[tuple(int(c) for c in code)].append(item)
    full: dict[str, tuple[int, ...]] = {}
    for prefix, members in groups.items():
        if len(members) > SID_CODEBOOK:
            raise ValueError(
                f"{len(members)} items share the prefix {prefix}, more than the {SID_CODEBOOK} "
                f"dedup codes (e.g. {sorted(members)[:3]}); use richer embeddings or a larger codebook"
            )
        for d, item in enumerate(sorted(members)):
            full[item] = prefix + (d,)
    ordered = {item: full[item] for item in ids}
    dedup_size = max(len(m) for m in groups.values())
    meta = {
        "levels": levels,
        "requested_codebook_size": int(codebook_size),
        "codebook_sizes": [k] * levels + [dedup_size],
        "seed": int(seed),
        "embedding_method": embedding_method,
    }
    return SemanticIds(ordered, meta)
