"""The rule teacher's trace writer: a short reasoning text grounded in the prompt's evidence.

It follows GR2's trace principles in ~100-150 tokens: (1) the pattern in the history (dominant
leaf categories and brands of the items the prompt shows), (2) complementary products (candidates
other users bought right after the user's last item), (3) evidence for the top candidates of the
chosen ranking, citing their SIDs (co-purchase counts, brand and category match, retriever rank),
(4) a decision. It is written from the ranking and the evidence only; it never sees the target.
Wording is drawn from a few equivalent phrasings (seeded) so the LM learns the content, not one
fixed sentence.
"""
from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Mapping, Sequence

from reranker.data.evidence import ItemMeta, as_item_meta

_EMPTY = ItemMeta("", "", ())
# Names come from item metadata: drop anything that looks like one of our control/SID tokens.
_TOKEN_LIKE = re.compile(r"<\|[^<>|\s]*\|>|</?think>|<[a-z]_\d+>|[<>{}\[\]\"]")


def clean_name(value: str, max_chars: int = 24) -> str:
    words = _TOKEN_LIKE.sub(" ", value or "").replace("_", " ").split()
    out = " ".join(words[:3])
    if len(out) > max_chars:
        cut = out[: max_chars + 1]
        out = cut.rsplit(" ", 1)[0] if " " in cut else cut[:max_chars]
    return out.rstrip(" &,-/")


_PATTERN = (
    "Pattern: recent buys are mostly {cats}{brands}.",
    "History pattern: {cats}{brands}.",
    "The user keeps buying {cats}{brands}.",
)
_VARIED = (
    "Pattern: varied recent buys ({cats}){brands}.",
    "No dominant category yet ({cats}){brands}.",
)
_BRANDS = ("; brand {b}", "; repeat brand {b}", ", loyal to {b}")
_LAST = (
    "Last item {sid} ({desc}).",
    "Most recent: {sid} ({desc}).",
    "Latest purchase {sid} ({desc}).",
)
_COMPLEMENTS = (
    "Bought right after it by others: {items}.",
    "Often bought next: {items}.",
    "Co-purchase after it: {items}.",
)
_NO_COMPLEMENT = (
    "No candidate is co-bought right after it, so older items, brand and category decide.",
    "Nothing here is bought right after it; rely on earlier items, brand and category.",
)
# Every reason `_why_first` can give; `retrace` finds the one an existing trace used.
WHY_FIRST = (
    "strongest co-purchase after the last item", "co-bought after recent items", "brand and category fit",
    "category fit", "brand loyalty", "the retriever's top choice", "a low-evidence pick", "the scorer's top choice",
)
TRACE_STYLES = ("full", "brief")
_DECISION = (
    "Decision: {first} first ({why}), then {rest}.",
    "So {first} goes first ({why}), followed by {rest}.",
    "Ranking: {first} on top ({why}), next {rest}.",
)


def trace_rng(seed: int, user: str, position: int) -> random.Random:
    """The wording stream of one example: its own seed, so the same ranking gets the same text
    however many tries it took and whatever else is in the build (str seeds are hashed stably)."""
    return random.Random(f"trace|{int(seed)}|{user}|{int(position)}")


def _counted(counter: Counter, k: int) -> list[tuple[str, int]]:
    # Ties broken by name so the text does not depend on history order quirks.
    return sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))[:k]


class TraceWriter:
    """Writes the reasoning text for a ranking; needs the SID map and item metadata."""

    def __init__(self, sids, items_meta, cited: int = 3, style: str = "full"):
        if cited < 1:
            raise ValueError(f"cited must be >= 1, got {cited}")
        if style not in TRACE_STYLES:
            raise ValueError(f"trace style {style!r} unknown; choose from {list(TRACE_STYLES)}")
        self.sids = sids
        self.meta: Mapping[str, ItemMeta] = as_item_meta(items_meta)
        self.cited = int(cited)
        self.style = style

    def _desc(self, item: str) -> str:
        m = self.meta.get(item, _EMPTY)
        parts = [clean_name(m.leaf_category), clean_name(m.brand)]
        return ", ".join(p for p in parts if p) or "no metadata"

    @staticmethod
    def _evidence_text(ev: Mapping, rng: random.Random) -> str:
        recent = [int(c) for c in ev.get("copurchase_recent", [])]
        parts = []
        if any(recent):
            parts.append(rng.choice(("cobought ", "co-bought ")) + "/".join(map(str, recent)))
        if int(ev.get("brand_match_count", 0)):
            parts.append(f"brand x{int(ev['brand_match_count'])}")
        if ev.get("leaf_category_match"):
            parts.append(rng.choice(("category match", "same category")))
        if not parts:
            parts.append(rng.choice(("no co-purchase or content match", "weak evidence")))
        return ", ".join(parts)

    @staticmethod
    def _why_first(evidence: Sequence[Mapping], first: int) -> str:
        ev = evidence[first]
        after_last = [int(e.get("copurchase_after_last", 0)) for e in evidence]
        if after_last[first] > 0 and after_last[first] == max(after_last):
            return WHY_FIRST[0]  # "strongest co-purchase after the last item"
        if int(ev.get("copurchase_max", 0)) > 0:
            return WHY_FIRST[1]  # "co-bought after recent items"
        if int(ev.get("brand_match_count", 0)) and ev.get("leaf_category_match"):
            return WHY_FIRST[2]  # "brand and category fit"
        if ev.get("leaf_category_match"):
            return WHY_FIRST[3]  # "category fit"
        if int(ev.get("brand_match_count", 0)):
            return WHY_FIRST[4]  # "brand loyalty"
        return WHY_FIRST[5] if first == 0 else WHY_FIRST[6]

    def write(self, history: Sequence[str], candidates: Sequence[str], evidence: Sequence[Mapping],
              ranking: Sequence[int], shown_history: int, rng: random.Random) -> str:
        """Reasoning for ``ranking`` (candidate indices, best first) of ``candidates``."""
        n = len(candidates)
        if sorted(int(i) for i in ranking) != list(range(n)):
            raise ValueError(f"ranking {list(ranking)} is not a permutation of {n} candidates")
        if len(evidence) != n:
            raise ValueError(f"{len(evidence)} evidence entries for {n} candidates")
        if self.style == "brief":
            first = int(ranking[0])
            return brief_trace(self.sids.sid_string(candidates[first]), first, self._why_first(evidence, first),
                               rest_text(ranking, self.cited))
        shown = list(history)[-max(1, int(shown_history)):] if history else []
        sentences = []

        # 1. Pattern in the (shown) history.
        metas = [self.meta.get(h, _EMPTY) for h in shown]
        cats = _counted(Counter(clean_name(m.leaf_category) for m in metas if clean_name(m.leaf_category)), 2)
        brands = [(b, c) for b, c in _counted(Counter(clean_name(m.brand) for m in metas if clean_name(m.brand)), 1) if c > 1]
        if cats:
            brand_text = rng.choice(_BRANDS).format(b=f"{brands[0][0]} ({brands[0][1]})") if brands else ""
            if cats[0][1] > 1:
                cat_text = " and ".join(f"{name} ({c})" for name, c in cats)
                sentences.append(rng.choice(_PATTERN).format(cats=cat_text, brands=brand_text))
            else:  # no repeated category: do not claim a pattern that is not there
                names = " and ".join(name for name, _ in cats)
                sentences.append(rng.choice(_VARIED).format(cats=names, brands=brand_text))

        # 2. The last item and its complements among the candidates.
        if shown:
            last = shown[-1]
            sentences.append(rng.choice(_LAST).format(sid=self.sids.sid_string(last), desc=self._desc(last)))
            after = sorted(((int(ev.get("copurchase_after_last", 0)), j) for j, ev in enumerate(evidence)),
                           key=lambda cj: (-cj[0], cj[1]))
            comp = [(c, j) for c, j in after if c > 0][:2]
            if comp:
                # By candidate number: the SIDs are cited below where the evidence is weighed.
                items = ", ".join(f"#{j + 1} ({c}x)" for c, j in comp)
                sentences.append(rng.choice(_COMPLEMENTS).format(items=items))
            else:
                sentences.append(rng.choice(_NO_COMPLEMENT))

        # 3. Evidence for the top of the chosen ranking, citing SIDs.
        top = [int(i) for i in ranking[: self.cited]]
        for j in top:
            # "(#k)": the candidate's number in the prompt, i.e. its retriever rank.
            sentences.append(f"{self.sids.sid_string(candidates[j])} (#{j + 1}): {self._evidence_text(evidence[j], rng)}.")

        # 4. Decision.
        sentences.append(rng.choice(_DECISION).format(first=self.sids.sid_string(candidates[top[0]]),
                                                     why=self._why_first(evidence, top[0]),
                                                     rest=rest_text(ranking, self.cited)))
        return " ".join(sentences)


def brief_trace(first_sid: str, first: int, why: str, rest: str) -> str:
    """The one-sentence "brief" trace: the decision alone, "#k.<sid> first (why), then the rest in
    retriever order." The candidate's number comes before its SID on purpose: the model makes the
    choice as one token, then copies line k's SID from the prompt. Written SID-first, a small model
    blends the codes of several likely candidates into one SID that is not a candidate (measured
    on Beauty: nearly every invalid answer of the SID-first version failed in that first SID).
    "k." is how the prompt numbers line k, right before its SID, so the copy is a plain lookup of
    the two tokens before it; with the reason in between ("#k first (why): <sid>") a model taught
    300 steps of copies got that SID's first code right 0.56 of the time, against 1.00 this way
    (docs/EXPERIMENTS.md, "A retriever-order line")."""
    return f"#{first + 1}.{first_sid} first ({why}), then {rest}."


RULE_SCANS = ("scan", "scan_recent", "scan_brand")  # what each compares: `retrace` (module docstring)
TOP_SCAN = "_top3"  # a rule scan with this suffix orders its best 3, not only its pick (`top_scan`)
# The styles whose ranking is a rule of the prompt's evidence, not the teacher's.
RULE_LABEL_STYLES = RULE_SCANS + tuple(style + TOP_SCAN for style in RULE_SCANS)
SCAN_HEADS = {"last": "After the last item:", "recent": "After the last items, newest first:",
              "recent_brand": "After the last items, newest first, then brand:"}


def _count_key(c) -> tuple:
    """A count or a tuple of counts as a tuple of ints (compared, and written "a/b/c")."""
    return tuple(int(x) for x in c) if isinstance(c, (tuple, list)) else (int(c),)


def scan_keys(counts: Sequence, brands: Sequence[int] | None = None) -> list[tuple]:
    """What the scan compares for each candidate: its counts, then its same-brand count if given."""
    keys = [_count_key(c) for c in counts]
    return keys if brands is None else [key + (int(b),) for key, b in zip(keys, brands)]


def _scan_entries(counts: Sequence, brands: Sequence[int] | None, caller: str) -> tuple[list[str], list[tuple]]:
    """(what a scan writes for each candidate, "2/0/1 b3"; what it compares), checked."""
    if not len(counts):
        raise ValueError(f"{caller} needs at least one candidate")
    if brands is not None and len(brands) != len(counts):
        raise ValueError(f"{len(counts)} co-purchase counts but {len(brands)} brand counts")
    texts = ["/".join(map(str, _count_key(c))) for c in counts]
    if brands is not None:
        texts = [f"{t} b{int(b)}" for t, b in zip(texts, brands)]
    return texts, scan_keys(counts, brands)


def copurchase_scan(counts: Sequence, head: str = SCAN_HEADS["last"],
                    brands: Sequence[int] | None = None) -> tuple[str, int]:
    """The "scan" trace's evidence line and the candidate it picks.

    It walks the candidates in retriever order writing each one's co-purchase evidence (a count, or
    a tuple such as the counts after the last 3 items, "2/0/1", compared newest first) and marks
    with "+" each candidate that beats the best so far: "After the last item: #1 2+ #2 1 #3 5+ #4 0.".
    The pick is the last "+" (the first of the largest). Why a running best and not just the pick:
    choosing the largest of ten numbers in one token is an argmax over the whole prompt, which a
    small model trained on the target's position never learned (it kept the retriever's #1); each
    step here is a copy (line k's count) and one comparison with the latest "+", both local.

    ``brands`` (each candidate's same-brand history count) breaks ties of the counts: it is written
    after them as "b2" and compared last, so "#1 0/0 b2+" beats "#2 0/0 b0".
    """
    texts, keys = _scan_entries(counts, brands, "copurchase_scan")
    best, parts = 0, []
    for k, key in enumerate(keys):
        beats = k == 0 or key > keys[best]
        if beats:
            best = k
        parts.append(f"#{k + 1} {texts[k]}{'+' if beats else ''}")
    return f"{head} {' '.join(parts)}.", best


def top_scan(counts: Sequence, head: str, brands: Sequence[int] | None = None,
             top: int = 3) -> tuple[str, list[int]]:
    """The scan line of the "_top3" styles and the ``top`` candidates it ranks first.

    Like `copurchase_scan`, but the running best is a running list of the best ``top`` so far,
    written after each candidate that enters it: "#1 2/0 [1] #2 1/1 [1 2] #3 0/0 [1 2 3] #4 1/2
    [1 4 2]". Each step is a copy and at most ``top`` comparisons with keys written earlier in the
    line, so the head of the answer (what NDCG@3 scores) is ordered without an argmax over the
    prompt. Ties keep retriever order, so the list equals a stable descending sort's first ``top``.
    """
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"top must be a whole number >= 1, got {top!r}")
    texts, keys = _scan_entries(counts, brands, "top_scan")
    best: list[int] = []
    parts = []
    for k, key in enumerate(keys):
        at = next((i for i, j in enumerate(best) if key > keys[j]), len(best))
        entered = at < top
        if entered:
            best = (best[:at] + [k] + best[at:])[:top]
        shown = " [" + " ".join(str(j + 1) for j in best) + "]" if entered else ""
        parts.append(f"#{k + 1} {texts[k]}{shown}")
    return f"{head} {' '.join(parts)}.", best


def scan_trace(candidate_sids: Sequence[str], counts: Sequence, head: str = SCAN_HEADS["last"],
               brands: Sequence[int] | None = None, top: int = 1,
               candidate_order: str = "retriever") -> tuple[str, list[int]]:
    """(trace, ranking) of the "scan" style: the co-purchase scan line, then the brief decision.

    The ranking is the scan's pick first (with ``top`` > 1, the scan's best ``top`` in order), the
    rest in the prompt's order (``candidate_order`` names it: "retriever" or "scorer"): the trace and
    the answer are one deterministic function of the prompt's evidence (with single counts after the last item, the co-purchase-after-last rule's
    head).
    """
    if len(candidate_sids) != len(counts):
        raise ValueError(f"{len(candidate_sids)} candidates but {len(counts)} co-purchase counts")
    if top == 1:
        line, first = copurchase_scan(counts, head, brands)
        picked = [first]
    else:
        line, picked = top_scan(counts, head, brands, top)
        first = picked[0]
    ranking = picked + [j for j in range(len(candidate_sids)) if j not in picked]
    key = _count_key(counts[first])
    why = ("strongest co-purchase after the last item" if key[0] > 0 else
           "co-bought after recent items" if any(key) else
           "same brand as the history" if brands is not None and brands[first] > 0 else
           f"the {candidate_order}'s top choice")
    # The top scans name their second and third with SIDs too ("then #2.<sid>, #4.<sid>, then the
    # rest ..."): the answer then copies each from the trace just above it. Named by number alone,
    # the answer had to look them up in the prompt, and a demo-sized model mostly wrote the first
    # SID again (docs/EXPERIMENTS.md, "a scan that orders its best three").
    if len(picked) == 1:
        rest = rest_text(ranking, candidate_order=candidate_order)
    else:
        rest = ("".join(f"#{j + 1}.{candidate_sids[j]}, " for j in picked[1:])
                + f"then the rest in {candidate_order} order")
    return f"{line}\n{brief_trace(candidate_sids[first], first, why, rest)}", ranking


def rest_text(ranking: Sequence[int], cited: int = 3, candidate_order: str = "retriever") -> str:
    """What the ranking does below its head, e.g. "#3, then the rest in retriever order" (the order
    the prompt lists the candidates in, which ``candidate_order`` names)."""
    # Where it keeps the listed order from some point on, say so (then the answer follows from the
    # trace and the prompt).
    tail_from = len(ranking)
    while tail_from > 1 and sorted(ranking[tail_from - 1:]) == list(ranking[tail_from - 1:]):
        tail_from -= 1
    named = [f"#{int(j) + 1}" for j in ranking[1:min(tail_from, cited)]]
    if tail_from <= cited:
        return (", ".join(named) + ", then " if named else "") + f"the rest in {candidate_order} order"
    rest = [f"#{int(j) + 1}" for j in ranking[1:cited]]
    return (", ".join(rest) + " and the rest by weaker evidence") if rest else "the rest"
