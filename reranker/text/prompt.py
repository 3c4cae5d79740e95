"""Prompt and assistant-message rendering for the re-ranker, and reasoning/answer token labels.

One compact line per item keeps the "cpu" profile (8 history items, 10 candidates, and the
retriever-order line) under ~600 tokens with the project tokenizer, so the small CPU model trains
on short contexts; the "full" profile adds title words and more history for real checkpoints.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from reranker.data.evidence import ItemMeta, absent_fields, as_item_meta
from reranker.text.sid import SID_RE
from reranker.text.tokenizer import THINK_CLOSE, THINK_OPEN


@dataclass(frozen=True)
class PromptProfile:
    max_history: int
    title_words: int  # 0: no title text at all
    legend: bool  # explain the evidence fields once (costs ~45 tokens)
    max_name_chars: int  # cap on a category or brand name (rare brand names cost many tokens)
    names: bool = True  # category and brand names on each line (False: SIDs and evidence only)
    # A last line listing the candidate SIDs in the listed order (the retriever's or a pre-ranker's),
    # written as the answer writes them. Why: most of an answer is "the rest in <that> order", and a
    # small model copies a list
    # laid out like its output far more easily than SIDs ~20 tokens apart on evidence lines
    # (docs/EXPERIMENTS.md, "A retriever-order line"). Costs ~10 tokens per candidate.
    order_line: bool = False


PROFILES: dict[str, PromptProfile] = {
    "cpu": PromptProfile(max_history=8, title_words=0, legend=False, max_name_chars=24, order_line=True),
    "full": PromptProfile(max_history=20, title_words=8, legend=True, max_name_chars=40),
    # For a model trained in minutes (the synthetic demo): the co-purchase scan reads only the
    # evidence, so names and a long history are tokens the model pays for and does not use.
    "compact": PromptProfile(max_history=2, title_words=0, legend=False, max_name_chars=0, names=False,
                             order_line=True),
}

# The prompt budget a data build and the engine use unless told otherwise: the cpu profile's longest
# prompts (8 history items, 10 candidates and the retriever-order line) stay under it, and with 320
# new tokens it fits the cpu model's 1,024 positions.
DEFAULT_MAX_PROMPT_TOKENS = 640

SYSTEM_PROMPT = (
    "Re-rank the candidates for this user. Think briefly, then output JSON "
    "{\"ranking\": [all candidate SIDs, best first]}."
)

# Anything in item metadata that would tokenize as one of our control/SID tokens is removed,
# so a product title can never inject "<|im_end|>" or a fake SID into the prompt.
_TOKEN_LIKE = re.compile(r"<\|[^<>|\s]*\|>|</?think>|<[a-z]_\d+>")
# Names are capped in words and characters: some catalogs put a whole product
# description in "brand".
_MAX_WORDS = 4


def _text(value: str, max_chars: int, max_words: int = _MAX_WORDS) -> str:
    # Strip token look-alikes before "_" -> " ", or "<|im_end|>" would survive as "<|im end|>".
    words = _TOKEN_LIKE.sub(" ", value).replace("_", " ").replace(";", ",").split()
    out = " ".join(words[:max_words])
    if len(out) > max_chars:
        cut = out[: max_chars + 1]
        # Prefer a word boundary ("Debra Lynn", not "Debra Lynn Professio").
        out = cut.rsplit(" ", 1)[0] if " " in cut else cut[:max_chars]
    # Cut names must not end in a dangling "&" or ",": "Hand Creams &" reads as garbage.
    return out.rstrip(" &,-/")


def _item_text(meta: ItemMeta, prof: PromptProfile, absent: frozenset[str] = frozenset()) -> str:
    """`absent`: fields no item of the catalog has; "no brand" on every line would tell the model
    nothing and cost tokens."""
    if not prof.names:
        return ""
    parts = []
    title_words = prof.title_words
    if title_words:
        words = _TOKEN_LIKE.sub(" ", meta.title).replace(";", ",").split()
        if words:
            parts.append(" ".join(words[:title_words]))
    if "categories" not in absent:
        parts.append(_text(meta.leaf_category, prof.max_name_chars) or "no category")
    if "brand" not in absent:
        parts.append(_text(meta.brand, prof.max_name_chars) or "no brand")
    return ", ".join(parts)


def _joined(sid: str, text: str) -> str:
    return f"{sid} {text}" if text else sid


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def format_evidence(ev: Mapping, absent: frozenset[str] = frozenset()) -> str:
    """One candidate's evidence: "cobought 12/0/3; brand 2; category yes" (see evidence_legend).

    "cobought" is one word on purpose: a hyphen would make it three tokens on each of the
    ten candidate lines, and the cpu profile has no tokens to spare under its budget. For the same
    reason a field the catalog lacks (`absent`: "brand", "categories") is left out, not written
    as 0 on every line.
    """
    recent = "/".join(str(int(c)) for c in ev.get("copurchase_recent", [])) or "0"
    parts = [f"cobought {recent}"]
    if "brand" not in absent:
        parts.append(f"brand {int(ev.get('brand_match_count', 0))}")
    if "categories" not in absent:
        parts.append(f"category {_yes(bool(ev.get('leaf_category_match', False)))}")
    return "; ".join(parts)


# brand and category are optional: format_evidence leaves out what the catalog lacks.
_EVIDENCE_LINE = re.compile(
    r"^(\d+)\.\S.*; ?cobought ([\d/]+)(?:; brand (\d+))?(?:; category (yes|no))?$", re.M)


def parse_candidate_evidence(user_text: str, n_candidates: int) -> list[dict]:
    """The evidence ``format_evidence`` wrote on each candidate line of a rendered prompt, in
    candidate order: {"copurchase_recent": [...], "brand_match_count": n, "leaf_category_match": b}.

    For data files, which store the prompt but not the evidence dicts. Raises ValueError naming
    what is missing when the prompt has no evidence line for some candidate.
    """
    found = {}
    for m in _EVIDENCE_LINE.finditer(user_text):
        found[int(m.group(1))] = {
            "copurchase_recent": [int(x) for x in m.group(2).split("/") if x != ""],
            "brand_match_count": int(m.group(3) or 0),
            "leaf_category_match": m.group(4) == "yes",
        }
    missing = [k for k in range(1, n_candidates + 1) if k not in found]
    if missing:
        raise ValueError(f"prompt has no evidence (\"cobought ...; brand ...; category ...\") on candidate "
                         f"line(s) {missing[:5]}; was it rendered with evidence?")
    return [found[k] for k in range(1, n_candidates + 1)]


def evidence_legend(window: int = 1, absent: frozenset[str] = frozenset()) -> str:
    """Stated once per prompt so each candidate line can stay terse."""
    after = "right after" if window == 1 else f"within {window} purchases after"
    parts = [f"cobought: times other users bought it {after} each of the user's last 3 items, newest first"]
    if "brand" not in absent:
        parts.append("brand: same-brand items in history")
    if "categories" not in absent:
        parts.append("category: its category is in history")
    return "; ".join(parts) + "."


def render_prompt_messages(
    history: Sequence[str],
    candidates: Sequence[str],
    sids,
    items_meta,
    evidence: Sequence[Mapping] | None,
    max_history: int | None = None,
    profile: str = "cpu",
    candidate_order: str = "retriever",
) -> list[dict]:
    """[system, user] chat messages for one re-ranking request.

    ``history`` is time ordered (oldest first); only the most recent ``max_history``
    items (profile default) are shown. The prompt numbers ``candidates`` 1..N as given, and its
    header and order line name what that order is (``candidate_order``: the retriever's, or the
    pre-ranker's, reranker/data/preranker.py). ``evidence[i]`` belongs to ``candidates[i]`` (None: omit).
    """
    if profile not in PROFILES:
        raise ValueError(f"unknown prompt profile {profile!r}; choose from {sorted(PROFILES)}")
    prof = PROFILES[profile]
    h = prof.max_history if max_history is None else int(max_history)
    if h < 1:
        raise ValueError(f"max_history must be >= 1, got {max_history}")
    if not candidates:
        raise ValueError("no candidates to rank")
    if len(set(candidates)) != len(candidates):
        dup = next(c for c in candidates if list(candidates).count(c) > 1)
        raise ValueError(f"candidate {dup!r} appears more than once")
    if evidence is not None and len(evidence) != len(candidates):
        raise ValueError(f"{len(evidence)} evidence entries for {len(candidates)} candidates")
    if candidate_order not in CANDIDATES_HEADERS:
        raise ValueError(f"candidate_order must be one of {sorted(CANDIDATES_HEADERS)}, got {candidate_order!r}")
    meta = as_item_meta(items_meta)
    empty = ItemMeta("", "", ())
    absent = absent_fields(meta)

    shown = list(history)[-h:]
    lines = [f"History (oldest first, {len(shown)} of {len(history)}):"]
    # No space before a SID: it would cost one extra token per line (the space stands alone
    # next to an added token).
    lines += [_joined(sids.sid_string(i), _item_text(meta.get(i, empty), prof, absent)) for i in shown]
    if not shown:
        lines.append("none")
    header = CANDIDATES_HEADERS[candidate_order]
    if evidence is not None and prof.legend:
        header += " " + evidence_legend(int(evidence[0].get("window", 1)), absent)
    lines.append(header)
    cand_sids = [sids.sid_string(c) for c in candidates]
    for rank, (cand, sid) in enumerate(zip(candidates, cand_sids), start=1):
        line = f"{rank}." + _joined(sid, _item_text(meta.get(cand, empty), prof, absent))
        if evidence is not None:
            line += "; " + format_evidence(evidence[rank - 1], absent)
        lines.append(line)
    if prof.order_line:
        lines.append(render_order_line(cand_sids, candidate_order))
    lines.append(f"Rank all {len(candidates)} candidates.")
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "\n".join(lines)}]


def prompt_token_count(tokenizer, messages: list[dict]) -> int:
    """Tokens of the rendered prompt including the assistant generation header."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_prompt_within_budget(
    tokenizer, max_prompt_tokens: int, history, candidates, sids, items_meta, evidence,
    max_history: int | None = None, profile: str = "cpu", candidate_order: str = "retriever",
) -> list[dict]:
    """:func:`render_prompt_messages`, dropping the oldest shown history items until the
    prompt fits ``max_prompt_tokens`` (a hard guarantee for fixed-context models).
    Raises ValueError when even one history item does not fit."""
    if profile not in PROFILES:
        raise ValueError(f"unknown prompt profile {profile!r}; choose from {sorted(PROFILES)}")
    h = PROFILES[profile].max_history if max_history is None else int(max_history)
    h = max(1, min(h, len(history)))
    while True:
        messages = render_prompt_messages(history, candidates, sids, items_meta, evidence, h, profile, candidate_order)
        n = prompt_token_count(tokenizer, messages)
        if n <= max_prompt_tokens:
            return messages
        if h <= 1:
            raise ValueError(f"prompt needs {n} tokens with one history item, over max_prompt_tokens={max_prompt_tokens}")
        h -= 1


# What the numbered candidate list follows, as the prompt's header and its order line name it.
CANDIDATES_HEADERS = {"retriever": "Candidates (retriever order).", "scorer": "Candidates (scorer order)."}
ORDER_LINE_PREFIXES = {"retriever": "Retriever order: ", "scorer": "Scorer order: "}


def render_order_line(candidate_sids: Sequence[str], candidate_order: str = "retriever") -> str:
    """The prompt's order line: the candidate SIDs in the list the answer writes."""
    return ORDER_LINE_PREFIXES[candidate_order] + json.dumps(list(candidate_sids))


def prompt_candidate_order(user_text: str) -> str:
    """Which order a rendered prompt lists its candidates in, as its header says: "scorer" under the
    pre-ranker's header, else "retriever" (a prompt without a header lists them as they came)."""
    for name, header in CANDIDATES_HEADERS.items():
        if "\n" + header in user_text or user_text.startswith(header):
            return name
    return "retriever"


_CANDIDATE_LINE = re.compile(r"^\d+\.(" + SID_RE.pattern + r")", re.M)


def prompt_candidate_sids(user_text: str) -> list[str]:
    """The SIDs of a rendered prompt's numbered candidate lines, in the order it lists them."""
    return [m.group(1) for m in _CANDIDATE_LINE.finditer(user_text)]


def reorder_candidates(user_text: str, candidate_sids: Sequence[str], order: Sequence[int]) -> str:
    """A rendered prompt with its candidates listed in ``order`` (new line k is old candidate
    ``order[k-1]``, 0-based): the numbered lines renumbered and the retriever-order line, if any,
    rewritten to match. History and everything else are unchanged."""
    n = len(candidate_sids)
    if sorted(order) != list(range(n)):
        raise ValueError(f"order must be a permutation of 0..{n - 1}, got {list(order)}")
    lines = user_text.split("\n")
    order_name = prompt_candidate_order(user_text)
    header = CANDIDATES_HEADERS[order_name]
    head = next((i for i, line in enumerate(lines) if line.startswith(header)), None)
    if head is None or head + n > len(lines) - 1:
        raise ValueError(f"prompt has no {header!r} section with {n} numbered lines")
    body = []
    for k in range(1, n + 1):
        line = lines[head + k]
        if not line.startswith(f"{k}."):
            raise ValueError(f"candidate line {k} of the prompt does not start with \"{k}.\": {line[:40]!r}")
        body.append(line[len(f"{k}."):])
    lines[head + 1:head + 1 + n] = [f"{k + 1}.{body[j]}" for k, j in enumerate(order)]
    for i, line in enumerate(lines):
        if line.startswith(ORDER_LINE_PREFIXES[order_name]):
            lines[i] = render_order_line([candidate_sids[j] for j in order], order_name)
    return "\n".join(lines)


def render_answer(ranking_sids: Sequence[str]) -> str:
    """The JSON answer alone: {"ranking": ["<|sid_begin|>...<|sid_end|>", ...]}."""
    return json.dumps({"ranking": list(ranking_sids)})


def render_assistant(reasoning: str, ranking_sids: Sequence[str]) -> str:
    """"<think>\\n{reasoning}\\n</think>\\n{json answer}".

    ``reasoning`` is stripped of surrounding whitespace so the markers always sit on their
    own lines. No end-of-turn token: the chat template (or the trainer) appends <|im_end|>.
    """
    if THINK_CLOSE in reasoning or THINK_OPEN in reasoning:
        raise ValueError(f"reasoning must not contain {THINK_OPEN} or {THINK_CLOSE}: {reasoning[:80]!r}")
    return f"{THINK_OPEN}\n{reasoning.strip()}\n{THINK_CLOSE}\n{render_answer(ranking_sids)}"


def response_token_types(tokenizer, assistant_text: str) -> list[str]:
    """Per-token labels of ``tokenizer``'s encoding of ``assistant_text``: "reasoning" or "answer".

    Everything from the first </think> token on (the marker, the JSON, any end-of-turn
    token) is "answer"; the labels drive the decoupled λ_r / λ_o loss weights. A text
    without any think markers is all answer (no-reasoning ablation).
    """
    close = assistant_text.find(THINK_CLOSE)
    enc = tokenizer(assistant_text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    if close < 0:
        if THINK_OPEN in assistant_text:
            raise ValueError(f"assistant text opens {THINK_OPEN} but never closes it: {assistant_text[:80]!r}")
        return ["answer"] * len(offsets)
    # A token belongs to the answer when it ends after the marker starts; byte-level tokens
    # never straddle an added token, so this is exactly "from </think> on".
    return ["answer" if end > close else "reasoning" for _, end in offsets]
