"""`dgr2 data retrace`: a built data directory with its reasoning traces rewritten in another style.

Rankings, prompts, SIDs and the tokenizer are kept, so a model trained on the source data can go on
training on the copy; only ``reasoning`` and ``assistant`` change. A full rebuild with
``rerank_data.trace_style`` gives the same traces but trains a new tokenizer on them.

The styles:

* "brief" keeps each ranking and writes its decision sentence alone.
* "scan" replaces the ranking too: the co-purchase scan of ``scan_trace`` (each candidate's count
  of purchases right after the user's last item, with a running best), then the decision for the
  scan's pick, the rest in the prompt's order (the retriever's, or a pre-ranker's). Its labels are
  a function of the prompt (read back from the prompt's evidence lines), not the held-out target,
  so the model is taught to use the evidence rather than the target's position prior.
* "scan_recent": the same with the counts after each of the last 3 items ("2/0/1", newest first),
  compared in that order (a tie after the last item is broken by the one before).
* "scan_brand": "scan_recent" with each candidate's same-brand history count written after its
  counts ("2/0/1 b3") and compared last. Chosen on the Beauty training lists, where it is the
  best rule of those tried (right on 0.3707 of them, against 0.3674 for "scan_recent" and 0.3648
  for "scan").
* Each of the three with "_top3" ("scan_brand_top3"): the scan keeps a running list of its best
  3 (`top_scan`) and the answer puts them first, in order, the rest in the prompt's order. The pick
  is the same; the head of the list is ordered by the rule too (on Beauty's selection lists,
  NDCG@3 0.4966 against 0.4758 for the pick alone; docs/EXPERIMENTS.md).

The "brief" trace needs the reason the full trace gave for its first item, which the writer took
from evidence the data files do not store: it is read back from the full trace's decision
sentence (one of ``WHY_FIRST``), so only template traces (the rule teacher's) can be retraced.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from candidate_gen.files import atomic_write_text, iter_jsonl, write_jsonl

from reranker.data.teachers.traces import (RULE_LABEL_STYLES, SCAN_HEADS, TOP_SCAN, WHY_FIRST, brief_trace, rest_text,
                                           scan_keys, scan_trace)
from reranker.text.prompt import (parse_candidate_evidence, prompt_candidate_order, prompt_candidate_sids,
                                  render_assistant)

SPLITS = ("train", "valid", "test")
RETRACE_STYLES = ("brief",) + RULE_LABEL_STYLES
COPIED = ("sids.json", "tokenizer", "scorer", "preranker")  # what a data directory carries beside its splits


def why_of(reasoning: str) -> str | None:
    """The reason a full template trace gave for its first item (last mention wins), else None."""
    found = [(reasoning.rfind(f"({w})"), w) for w in WHY_FIRST]
    at, why = max(found)
    return why if at >= 0 else None


def user_text(row: dict) -> str:
    """The user message of a row's ``prompt_messages`` (the rendered prompt with the evidence lines)."""
    for m in row.get("prompt_messages") or []:
        if m.get("role") == "user":
            return m["content"]
    raise ValueError("field 'prompt_messages': no user message")


def _scan_and_top(style: str) -> tuple[str, int]:
    """("scan_brand", 3) for "scan_brand_top3": the scan a RULE_LABEL_STYLES style compares by, and
    how many candidates it orders at the head."""
    return (style[: -len(TOP_SCAN)], 3) if style.endswith(TOP_SCAN) else (style, 1)


def _rule_inputs(user_text: str, n_candidates: int, style: str) -> tuple[list, str, list[int] | None]:
    """(counts, scan head, brand counts or None) of a RULE_LABEL_STYLES scan, from the evidence
    lines of a rendered prompt."""
    if style not in RULE_LABEL_STYLES:
        raise ValueError(f"rule_scan writes one of {RULE_LABEL_STYLES}, got style {style!r}")
    scan, top = _scan_and_top(style)
    evidence = parse_candidate_evidence(user_text, n_candidates)
    recent = [ev["copurchase_recent"] or [0] for ev in evidence]
    if scan == "scan":
        counts, head, brands = [c[0] for c in recent], SCAN_HEADS["last"], None
    elif scan == "scan_recent":
        counts, head, brands = [tuple(c) for c in recent], SCAN_HEADS["recent"], None
    else:  # "scan_brand"
        counts, head, brands = ([tuple(c) for c in recent], SCAN_HEADS["recent_brand"],
                                [ev["brand_match_count"] for ev in evidence])
    return counts, (head if top == 1 else f"{head[:-1]}; best {top} so far:"), brands


def rule_keys(user_text: str, n_candidates: int, style: str) -> list[tuple]:
    """What a RULE_LABEL_STYLES scan compares for each candidate; it picks the first of the largest."""
    counts, _, brands = _rule_inputs(user_text, n_candidates, style)
    return scan_keys(counts, brands)


def rule_scan(user_text: str, sids, style: str) -> tuple[str, list[int]]:
    """(trace, ranking) of a RULE_LABEL_STYLES style, from the evidence lines of a rendered prompt.
    ``sids``: the candidates' SIDs in the order the prompt lists them; the ranking indexes them."""
    counts, head, brands = _rule_inputs(user_text, len(sids), style)
    return scan_trace(sids, counts, head, brands, top=_scan_and_top(style)[1],
                      candidate_order=prompt_candidate_order(user_text))


def shown_order(user_text: str, candidate_sids) -> list[int]:
    """The candidate indices in the order a rendered prompt lists them (the retriever's, or the
    pre-ranker's: reranker/data/preranker.py)."""
    shown = prompt_candidate_sids(user_text)
    index = {s: j for j, s in enumerate(candidate_sids)}
    if len(shown) != len(candidate_sids) or set(shown) != set(index):
        raise ValueError(f"the prompt lists {len(shown)} candidate lines that are not the row's "
                         f"{len(candidate_sids)} candidate_sids")
    return [index[s] for s in shown]


def retrace_row(row: dict, style: str = "brief") -> dict:
    """``row`` with a ``style`` trace; rows without a teacher ranking (test) are returned as is."""
    if row.get("ranking") is None:
        return row
    sids, text = row["candidate_sids"], user_text(row)
    # The trace numbers candidates as the prompt lists them; the row's ranking indexes candidate_sids.
    order = shown_order(text, sids)
    if style in RULE_LABEL_STYLES:
        reasoning, at = rule_scan(text, [sids[j] for j in order], style)
        ranking = [order[p] for p in at]
    else:
        why = why_of(row.get("reasoning") or "")
        if why is None:
            raise ValueError(f"trace of user {row.get('user')!r} names none of the rule teacher's reasons; "
                             "only template (rule teacher) traces can be retraced")
        ranking = [int(i) for i in row["ranking"]]
        at = [order.index(j) for j in ranking]
        reasoning = brief_trace(sids[ranking[0]], at[0], why,
                                rest_text(at, candidate_order=prompt_candidate_order(text)))
    return {**row, "ranking": ranking, "reasoning": reasoning,
            "assistant": render_assistant(reasoning, [sids[i] for i in ranking])}


def _rebased(info: dict, src: Path, dst: Path) -> dict:
    """build_info.json's paths are relative to its own directory: re-anchor them at ``dst``."""
    out = dict(info)
    for key in ("retrieval_dir", "items_path"):
        if key in out:
            out[key] = os.path.relpath((src / out[key]).resolve(), dst.resolve())
    return out


def copy_support_files(src: Path, dst: Path) -> None:
    """Everything of data dir ``src`` but its splits, into ``dst``: SIDs, tokenizer, scorer, pre-ranker,
    and build_info.json with its paths re-anchored at ``dst``."""
    for name in COPIED:
        s, d = src / name, dst / name
        if s.is_dir():
            shutil.copytree(s, d, dirs_exist_ok=True)
        elif s.is_file():
            shutil.copy2(s, d)
    if (src / "build_info.json").is_file():
        info = json.loads((src / "build_info.json").read_text(encoding="utf-8"))
        atomic_write_text(dst / "build_info.json", json.dumps(_rebased(info, src, dst), indent=2))


def retrace_data(src, dst, style: str = "brief", progress: bool = True) -> dict:
    """Write ``dst``: ``src``'s splits with traces in ``style``, plus its SIDs, tokenizer and scorer."""
    from tqdm.auto import tqdm

    src, dst = Path(src), Path(dst)
    if style not in RETRACE_STYLES:
        raise ValueError(f"retrace writes one of {RETRACE_STYLES}, got style {style!r}; "
                         "a full trace needs `dgr2 data build`")
    if not (src / "train.jsonl").is_file():
        raise FileNotFoundError(f"{src}: no train.jsonl; build it with `dgr2 data build`")
    if dst.resolve() == src.resolve():
        raise ValueError(f"{dst}: the output must differ from the source data directory")
    dst.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split in SPLITS:
        path = src / f"{split}.jsonl"
        if not path.is_file():
            continue
        rows = []
        for n, row in tqdm(iter_jsonl(path), desc=f"retrace {split}", unit="ex", disable=not progress):
            try:
                rows.append(retrace_row(row, style))
            except (ValueError, KeyError, IndexError, TypeError) as e:
                raise ValueError(f"{path}:{n}: {e}") from None
        write_jsonl(dst / f"{split}.jsonl", rows)
        counts[split] = len(rows)
    copy_support_files(src, dst)
    report = json.loads((src / "build_report.json").read_text(encoding="utf-8")) \
        if (src / "build_report.json").is_file() else {}
    report.update({"trace_style": style, "retraced_from": os.path.relpath(src.resolve(), dst.resolve())})
    report.pop("tokens", None)  # the assistant lengths changed; the prompt stats still hold but go with them
    atomic_write_text(dst / "build_report.json", json.dumps(report, indent=2))
    return {"out": str(dst), "style": style, "examples": counts}
