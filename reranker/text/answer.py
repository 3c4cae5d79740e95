"""Parsing and validating the model's ranking, and the retriever-order fallback.

The answer must be exactly a permutation of the candidate SIDs. Failures are told
apart (unparsable / out_of_set / duplicate / dropped) because they have different
causes: broken JSON is a decoding problem, out-of-set SIDs are hallucinated items,
duplicates and drops are the model losing track of the list. No repair is attempted
beyond surrounding whitespace: a repaired answer would hide the failure rates the
project reports.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from reranker.text.tokenizer import IM_END, PAD_TOKEN, THINK_CLOSE

FAILURE_KINDS = ("unparsable", "out_of_set", "duplicate", "dropped")
_TRAILING_EOS = (IM_END, PAD_TOKEN)


@dataclass(frozen=True)
class ParseResult:
    permutation: tuple[int, ...] | None  # candidate indices, best first; None on failure
    failure: str | None  # one of FAILURE_KINDS, None when ok
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.failure is None


def _fail(kind: str, detail: str) -> ParseResult:
    return ParseResult(None, kind, detail)


def extract_answer_json(text: str) -> str:
    """The text after the first </think> (the whole text if there is none), whitespace and
    trailing end-of-turn/pad tokens stripped: what must be the JSON object."""
    close = text.find(THINK_CLOSE)
    body = text[close + len(THINK_CLOSE):] if close >= 0 else text
    body = body.strip()
    stripped = True
    while stripped:
        stripped = False
        for tok in _TRAILING_EOS:
            if body.endswith(tok):
                body = body[: -len(tok)].rstrip()
                stripped = True
    return body


def parse_ranking(text: str, candidate_sids: Sequence[str]) -> ParseResult:
    """Validate a generated answer against the candidate SIDs (retriever order)."""
    index = {sid: i for i, sid in enumerate(candidate_sids)}
    if len(index) != len(candidate_sids):
        dup = next(s for s, c in Counter(candidate_sids).items() if c > 1)
        raise ValueError(f"candidate list repeats the SID {dup!r}")
    body = extract_answer_json(text)
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as err:
        return _fail("unparsable", f"invalid JSON ({err.msg} at char {err.pos}): {body[:120]!r}")
    if not isinstance(obj, dict) or not isinstance(obj.get("ranking"), list):
        return _fail("unparsable", f'expected an object with a "ranking" list, got {body[:120]!r}')
    ranking = obj["ranking"]
    bad_type = [r for r in ranking if not isinstance(r, str)]
    if bad_type:
        return _fail("unparsable", f"ranking entries must be SID strings, got {bad_type[0]!r}")
    outside = [r for r in ranking if r not in index]
    if outside:
        return _fail("out_of_set", f"{outside[0]!r} is not among the {len(index)} candidates")
    repeated = [r for r, c in Counter(ranking).items() if c > 1]
    if repeated:
        return _fail("duplicate", f"{repeated[0]!r} appears {ranking.count(repeated[0])} times")
    if len(ranking) < len(index):
        missing = [s for s in candidate_sids if s not in set(ranking)]
        return _fail("dropped", f"{len(missing)} candidate(s) missing, first {missing[0]!r}")
    return ParseResult(tuple(index[r] for r in ranking), None, "")


def fallback_permutation(n: int) -> list[int]:
    """The retriever order, used whenever the answer is not a valid permutation."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return list(range(n))


def permutation_or_fallback(result: ParseResult, n: int, order=None) -> list[int]:
    """The parsed permutation, or, for an invalid answer, ``order`` (the list the prompt showed; None:
    the retriever order)."""
    if result.ok:
        return list(result.permutation)
    return fallback_permutation(n) if order is None else [int(j) for j in order]


class FailureCounter:
    """Tally of parse outcomes: valid-output rate and each failure kind separately."""

    def __init__(self):
        self.counts = Counter({"ok": 0, **{k: 0 for k in FAILURE_KINDS}})

    def add(self, result: ParseResult) -> ParseResult:
        self.counts["ok" if result.ok else result.failure] += 1
        return result

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def valid_rate(self) -> float:
        return self.counts["ok"] / self.total if self.total else 0.0

    @property
    def fallback_rate(self) -> float:
        return 1.0 - self.valid_rate if self.total else 0.0

    def as_dict(self) -> dict:
        return {**dict(self.counts), "total": self.total, "valid_rate": self.valid_rate,
                "fallback_rate": self.fallback_rate}


def project_to_permutation(scores) -> list[int]:
    """Nearest permutation to a score matrix (exact, Hungarian algorithm).

    ``scores[p, j]``: how much candidate j belongs at rank p (e.g. per-slot logits or
    log-probabilities). Returns candidate indices, best first, maximising the total score.
    A 1-D vector of per-candidate scores is simply sorted (descending, ties by index).
    Optional: callers keep the raw model answer unless they turn this on.
    """
    from scipy.optimize import linear_sum_assignment

    s = np.asarray(scores, dtype=np.float64)
    if not np.isfinite(s).all():
        raise ValueError("scores contain NaN or inf")
    if s.ndim == 1:
        return [int(i) for i in np.argsort(-s, kind="stable")]
    if s.ndim != 2 or s.shape[0] != s.shape[1]:
        raise ValueError(f"scores must be a square (rank x candidate) matrix or a vector, got shape {s.shape}")
    rows, cols = linear_sum_assignment(s, maximize=True)
    return [int(c) for _, c in sorted(zip(rows, cols))]
