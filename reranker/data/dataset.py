"""Re-ranking data: retrieval artifacts -> train / valid / test examples with reasoning traces.

Example (what ``dgr2 data build --config ...`` runs)::

    from reranker.data.dataset import build_rerank_data
    report = build_rerank_data("artifacts/beauty/retrieval",
                               "../shared/data/amazon-beauty/amazon-beauty.item",
                               "artifacts/beauty/rerank_data", teacher="rule", seed=0)

Splits (N = the retriever's list length, 10 by default):

* train: cross-fitted training-position lists whose target is in the top-N, plus the validation
  position (target in top-N) of every user outside the held-out selection set. Each carries a
  teacher trace and ranking.
* valid: the validation position of ``n_selection_users`` held-out users (a seeded draw over user
  ids, which reads no target), target in top-N; for model selection. These also carry a teacher
  trace (full scorer, never fitted on them) so trainers can report a validation loss; their
  targets are read only by the teacher's oracle, never to build train data, the scorer or the
  tokenizer.
* test: the leave-one-out test position of every user whose target is in the history-masked
  top-N; prompts and targets only, no teacher output.

Every example's evidence (prompt and features) uses co-purchase counts and popularity from the
training split (each sequence minus its last two items) with the example's own user excluded.
The learned scorer is fitted on the train lists only; the traces of training examples come from
user-cross-fitted scorers (never the model that saw that list). The tokenizer is trained on the
train split's prompts and traces only. All randomness is seeded per example: two builds with the
same inputs and seed are byte-identical.

``candidate_order: scorer`` lists every prompt's candidates in a learned scorer's order instead of
the retriever's (reranker/data/preranker.py: the pre-ranker, fitted on the validation-position lists,
orders valid lists cross-fitted by user half and test lists with its full model; train prompts are
ordered by the teaching scorer above, so no valid target builds training data). Rows keep their
candidates in retriever order and record the prompt's as ``prompt_order``; it needs a rule trace
style (the answers are read back from the prompts).

Writes to ``out_dir``: sids.json, tokenizer/, scorer/ (full model; fold<k>/ teaching models),
preranker/ (with candidate_order: scorer), train.jsonl, valid.jsonl, test.jsonl, build_report.json,
build_info.json (paths relative to ``out_dir`` so the serving engine can rebuild the co-purchase counts).
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from candidate_gen.atomic import load_items
from candidate_gen.files import atomic_write_text, write_dir_atomically, write_jsonl
from candidate_gen.files import read_jsonl as _read_jsonl
from candidate_gen.split import train_sequences
from reranker.data.evidence import (ITEM_FIELDS, absent_fields, absent_fields_note, candidates_evidence,
                                    item_meta_lookup)
from reranker.data.features import FeatureContext
from reranker.data.preranker import CANDIDATE_ORDERS, PreRanker, order_by
from reranker.data.retrace import RULE_LABEL_STYLES, retrace_row
from reranker.data.teachers.base import Oracle, TeachExample, TeacherOutput, teacher_stats
from reranker.data.teachers.rule import RuleTeacher, ScorerConfig, fit_cross_fitted
from reranker.data.teachers.traces import TraceWriter, trace_rng
from reranker.text.prompt import (DEFAULT_MAX_PROMPT_TOKENS, PROFILES, render_assistant, render_prompt_messages,
                                  render_prompt_within_budget, response_token_types)
from reranker.text.sid import SID_LETTERS, build_semantic_ids, content_embeddings
from reranker.text.tokenizer import build_tokenizer, load_tokenizer

log = logging.getLogger(__name__)
# The rendered text's version: a data dir, and everything trained on it, is rebuilt when it changes.
# v2: cpu and compact prompts end with a retriever-order line; the scan decision reads "#k.<sid> first (why)".
FORMAT = "diffusion-gr2/rerank-data/v2"
_ROW_FIELDS = {"user": str, "position": int, "history": list, "candidates": list, "scores": list, "target": str}
_SHOWN_RE = re.compile(r"History \(oldest first, (\d+) of \d+\)")


# ---------------------------------------------------------------- reading the retrieval artifacts
def _check_candidates(row: Mapping) -> str | None:
    cands = row["candidates"]
    if len(set(cands)) != len(cands):
        return "field 'candidates': an item appears twice"
    if len(row["scores"]) != len(cands):
        return f"field 'scores': {len(row['scores'])} scores for {len(cands)} candidates"
    return None


def read_jsonl(path, required: Mapping[str, type] = _ROW_FIELDS) -> list[dict]:
    """Candidate-list rows with the ``required`` fields type-checked; errors name file, line and field."""
    return _read_jsonl(path, dict(required), check=_check_candidates if "candidates" in required else None)


def load_retrieval(retrieval_dir) -> tuple[dict[str, list[str]], dict[str, list[dict]]]:
    """(sequences per user, candidate rows per split) from a retrieval artifacts directory."""
    d = Path(retrieval_dir)
    seq_path = d / "sequences.json"
    if not seq_path.is_file():
        raise FileNotFoundError(f"{seq_path}: not found (is {d} a retrieval artifacts directory?)")
    seqs = json.loads(seq_path.read_text(encoding="utf-8"))
    rows = {sp: read_jsonl(d / "candidates" / f"{sp}.jsonl") for sp in ("train", "valid", "test")}
    return seqs, rows


def selection_users(users, n: int, seed: int) -> set[str]:
    """The held-out model-selection users: a seeded draw over sorted user ids (reads no target)."""
    users = sorted(users)
    if not 0 <= n < len(users):
        raise ValueError(f"n_selection_users={n}: must be >= 0 and below the {len(users)} users")
    perm = np.random.default_rng([int(seed), 5]).permutation(len(users))
    return {users[i] for i in perm[:n]}


def target_in_list(row: Mapping) -> bool:
    return row["target"] in row["candidates"]


# ---------------------------------------------------------------- small helpers
def _stats(values) -> dict:
    v = np.asarray(list(values), dtype=np.float64)
    if len(v) == 0:
        return {"n": 0, "mean": 0.0, "p95": 0.0, "max": 0}
    return {"n": int(len(v)), "mean": round(float(v.mean()), 2), "p95": round(float(np.percentile(v, 95)), 2),
            "max": int(v.max())}


def _sids_for(seqs, retrieval_dir: Path, items_frame, sid_config: Mapping, seed: int):
    """SIDs for every item the retriever knows (its items.json order, else first-seen order)."""
    items_json = retrieval_dir / "items.json"
    if items_json.is_file():
        ids = [str(i) for i in json.loads(items_json.read_text(encoding="utf-8"))]
    else:
        ids = list(dict.fromkeys(i for s in seqs.values() for i in s))
    frame = items_frame.set_index("item_id").reindex(ids)
    missing = int(frame["title"].isna().sum())
    frame = frame.reset_index().rename(columns={"index": "item_id"})
    frame["title"] = frame["title"].fillna("")
    frame["brand"] = frame["brand"].fillna("")
    frame["categories"] = [c if isinstance(c, list) else [] for c in frame["categories"]]
    cfg = {"method": "tfidf", "dim": 64, "codebook_size": 256, "seed": seed, "model_dir": None, **dict(sid_config or {})}
    emb = content_embeddings(frame, method=cfg["method"], dim=cfg["dim"], seed=cfg["seed"], model_dir=cfg["model_dir"])
    method = cfg["method"]
    retriever_emb = retrieval_dir / "item_embeddings.npy"
    if not emb.any() and items_json.is_file() and retriever_emb.is_file():
        # No item has a title, brand or category: every content row is zero, and k-means would put
        # the whole catalog under one prefix. The retriever's item vectors (rows in items.json
        # order) are the only description of the items there is.
        emb = np.load(retriever_emb).astype(np.float64)
        if emb.shape[0] != len(ids):
            raise ValueError(f"{retriever_emb}: {emb.shape[0]} rows for the {len(ids)} items of {items_json}")
        norms = np.linalg.norm(emb, axis=1, keepdims=True)
        emb = np.divide(emb, norms, out=np.zeros_like(emb), where=norms > 1e-12).astype(np.float32)
        method = "retriever"
        log.warning("no item has a title, brand or category: semantic IDs come from the retriever's item "
                    "embeddings (%s)", retriever_emb)
    sids = build_semantic_ids(emb, ids, codebook_size=cfg["codebook_size"], seed=cfg["seed"],
                              embedding_method=method)
    return sids, missing


def scorer_settings(options: Mapping | None, seed: int) -> ScorerConfig:
    """ScorerConfig from a config mapping; unknown keys are an error, not silently ignored."""
    opts = dict(options or {})
    known = set(ScorerConfig.__dataclass_fields__)
    unknown = sorted(set(opts) - known)
    if unknown:
        raise ValueError(f"scorer_config: unknown key(s) {unknown}; known: {sorted(known)}")
    if "exclude_features" in opts:
        opts["exclude_features"] = tuple(opts["exclude_features"])
    return ScorerConfig(**{"seed": seed, **opts})


_TEACHER_KEYS = {"rule": {"temperature", "max_tries", "promote", "rejection"}, "jsonl": {"path", "max_tries"},
                 "hf_llm": {"model_dir", "max_tries", "tries_per_batch", "temperature", "top_p", "max_new_tokens",
                            "profile", "device", "dtype"}}


def make_teacher(name: str, options: Mapping | None, *, scorer, sids, meta, writer, seed: int):
    opts = dict(options or {})
    if name not in _TEACHER_KEYS:
        raise ValueError(f"unknown teacher {name!r}; choose from {sorted(_TEACHER_KEYS)}")
    unknown = sorted(set(opts) - _TEACHER_KEYS[name])
    if unknown:
        raise ValueError(f"teacher_options for {name!r}: unknown key(s) {unknown}; known: {sorted(_TEACHER_KEYS[name])}")
    if name == "rule":
        return RuleTeacher(scorer, writer, temperature=opts.get("temperature", 1.0),
                           max_tries=opts.get("max_tries", 8), seed=seed, promote=opts.get("promote", 1),
                           rejection=opts.get("rejection", True))
    if name == "jsonl":
        from reranker.data.teachers.jsonl import JsonlTeacher

        if "path" not in opts:
            raise ValueError("teacher 'jsonl' needs teacher_options={'path': <traces.jsonl>}")
        return JsonlTeacher(opts["path"], sids, writer, seed=seed, max_tries=opts.get("max_tries"))
    if name == "hf_llm":
        from reranker.data.teachers.hf_llm import HfLlmTeacher

        if "model_dir" not in opts:
            raise ValueError("teacher 'hf_llm' needs teacher_options={'model_dir': <local model directory>}")
        model_dir = opts.pop("model_dir")
        return HfLlmTeacher(model_dir, sids, meta, writer, seed=seed, **opts)
    raise AssertionError(name)  # unreachable: checked above


def _shown_history(messages: Sequence[Mapping]) -> int:
    """How many history items the rendered prompt shows (the budget may drop the oldest)."""
    m = _SHOWN_RE.search(messages[1]["content"])
    if m is None:
        raise ValueError("prompt format changed: no 'History (oldest first, k of n)' line in the user message")
    return int(m.group(1))


def _corpus_text(messages: Sequence[Mapping]) -> str:
    return "\n".join(f"{m['role']}\n{m['content']}" for m in messages)


# ---------------------------------------------------------------- the builder's steps
def split_rows(rows: Mapping[str, list[dict]], selected: set[str]) -> tuple[list[dict], list[dict], list[dict]]:
    """(train, valid, test) lists per the module docstring; rows gain ``_source``."""
    for sp, rs in rows.items():
        for r in rs:
            r["_source"] = {"train": "crossfit", "valid": "valid", "test": "test"}[sp]
    train = [r for r in rows["train"] if target_in_list(r)]
    train += [r for r in rows["valid"] if r["user"] not in selected and target_in_list(r)]
    train.sort(key=lambda r: (r["user"], r["position"]))
    valid = sorted((r for r in rows["valid"] if r["user"] in selected and target_in_list(r)),
                   key=lambda r: (r["user"], r["position"]))
    test = sorted((r for r in rows["test"] if target_in_list(r)), key=lambda r: r["user"])
    return train, valid, test


def _blocks(X: np.ndarray, groups: np.ndarray) -> list[np.ndarray]:
    """Per-list feature blocks (views) of a stacked feature matrix."""
    return np.split(X, np.cumsum(groups)[:-1]) if len(groups) else []


SCORER_LISTS = ("valid_positions", "all")


def _fit_scorers(ctx: FeatureContext, train_rows, config: ScorerConfig, folds: int, seed: int,
                 lists: str = "valid_positions"):
    """Full + user-fold scorers on train lists only; returns (scorer, per-list feature blocks).

    lists="valid_positions" fits on the validation-position lists alone (made by the main
    retriever, like the test lists); "all" adds the cross-fitted training-position lists, whose
    retriever scores and positions come from another distribution (on Beauty's held-out
    validation users: R@1 0.355 vs 0.315, 273 lists)."""
    if lists not in SCORER_LISTS:
        raise ValueError(f"scorer_lists must be one of {SCORER_LISTS}, got {lists!r}")
    X, groups = ctx.featurize(train_rows, desc="train features")
    blocks = _blocks(X, groups)
    fit_idx = [i for i, r in enumerate(train_rows) if lists == "all" or "fold" not in r]
    if not fit_idx:
        raise ValueError("no validation-position lists to fit the scorer on; use scorer_lists: all")
    Xf = np.concatenate([blocks[i] for i in fit_idx])
    gf = np.asarray([len(blocks[i]) for i in fit_idx])
    labels = np.concatenate([[c == train_rows[i]["target"] for c in train_rows[i]["candidates"]]
                             for i in fit_idx]).astype(np.float32)
    scorer = fit_cross_fitted(Xf, gf, labels, [train_rows[i]["user"] for i in fit_idx], folds, config, seed)
    return scorer, blocks


def _example(r: Mapping, feats, *, meta, sids, copurchase, max_hist: int) -> TeachExample:
    ev = candidates_evidence(r["history"], r["candidates"], meta, copurchase, r["user"])
    return TeachExample(r["user"], r["position"], r["history"], r["candidates"],
                        [sids.sid_string(c) for c in r["candidates"]], r["scores"], ev,
                        min(len(r["history"]), max_hist), Oracle(r["candidates"].index(r["target"])), feats)


def _in_order(order, *lists):
    """Each of ``lists`` permuted into ``order`` (None passes through; order None: unchanged)."""
    if order is None:
        return lists
    return tuple(None if xs is None else [xs[j] for j in order] for xs in lists)


def _train_tokenizer(train_ex, train_out, sids, meta, profile: str, vocab: int, orders, candidate_order: str):
    """BPE on the train split's prompts (provisional, before the budget) and assistant texts."""
    corpus = [_corpus_text(render_prompt_messages(e.history, *_in_order(order, e.candidates), sids, meta,
                                                  *_in_order(order, e.evidence), profile=profile,
                                                  candidate_order=candidate_order))
              + "\n" + render_assistant(o.reasoning, [e.candidate_sids[i] for i in o.ranking])
              for e, o, order in zip(train_ex, train_out, orders)]
    return build_tokenizer(corpus, vocab_size=vocab)


def _reused_tokenizer(path, sids):
    """A saved project tokenizer; it must hold every SID code token of this build."""
    if not (Path(path) / "tokenizer.json").is_file():
        raise FileNotFoundError(f"tokenizer_from: {path} holds no tokenizer.json")
    tok = load_tokenizer(path)
    vocab = tok.get_vocab()
    codes = {f"<{letter}_{c}>" for item in sids.item_ids for letter, c in zip(SID_LETTERS, sids.codes(item))}
    missing = sorted(c for c in codes if c not in vocab)
    if missing:
        raise ValueError(f"tokenizer_from: {path} lacks {len(missing)} SID code token(s) of this build, e.g. {missing[:3]}")
    return tok


class _Renderer:
    """Final prompts within the token budget and the output rows; counts trimmed prompts and the
    assistant token lengths of the train split."""

    def __init__(self, tok, sids, meta, writer: TraceWriter, profile: str, max_prompt_tokens, seed: int,
                 relabel: str | None = None, candidate_order: str = "retriever"):
        self.tok, self.sids, self.meta, self.writer = tok, sids, meta, writer
        self.candidate_order = candidate_order
        self.relabel = relabel  # a RULE_LABEL_STYLES style: each taught row is rewritten as retrace does
        if relabel:
            self._retrace_row = retrace_row
        self.profile, self.max_prompt_tokens, self.seed = profile, max_prompt_tokens, seed
        self.max_hist = PROFILES[profile].max_history
        self.trimmed = 0
        self.tokens: dict[str, list[int]] = {"reasoning": [], "answer": [], "assistant": []}

    def prompt(self, history, candidates, evidence, order=None) -> tuple[list[dict], int]:
        """The prompt, its candidates listed in ``order`` (None: as given), and how much history it shows."""
        candidates, evidence = _in_order(order, candidates, evidence)
        kw = dict(profile=self.profile, candidate_order=self.candidate_order)
        if self.max_prompt_tokens:
            messages = render_prompt_within_budget(self.tok, self.max_prompt_tokens, history, candidates, self.sids,
                                                   self.meta, evidence, **kw)
        else:
            messages = render_prompt_messages(history, candidates, self.sids, self.meta, evidence, **kw)
        shown = _shown_history(messages)
        self.trimmed += shown < min(len(history), self.max_hist)
        return messages, shown

    def taught(self, split: str, src: Mapping, e: TeachExample, o: TeacherOutput, order=None) -> dict:
        messages, shown = self.prompt(e.history, e.candidates, e.evidence, order)
        reasoning = o.reasoning
        if shown < e.shown_history and (o.fallback or o.teacher == "rule"):
            # A template trace: re-ground its history pattern in what the prompt really shows.
            reasoning = self.writer.write(e.history, e.candidates, e.evidence, o.ranking, shown,
                                          trace_rng(self.seed, e.user, e.position))
        assistant = render_assistant(reasoning, [e.candidate_sids[i] for i in o.ranking])
        row = _row(split, src, e.candidate_sids, messages, assistant, reasoning, o, order)
        if self.relabel:
            row = self._retrace_row(row, self.relabel)
        if split == "train":
            types = response_token_types(self.tok, row["assistant"])
            self.tokens["reasoning"].append(types.count("reasoning"))
            self.tokens["answer"].append(types.count("answer"))
            self.tokens["assistant"].append(len(types))
        return row

    def test(self, src: Mapping, copurchase, order=None) -> dict:
        ev = candidates_evidence(src["history"], src["candidates"], self.meta, copurchase, src["user"])
        messages, _ = self.prompt(src["history"], src["candidates"], ev, order)
        return _row("test", src, [self.sids.sid_string(c) for c in src["candidates"]], messages, None, None, None,
                    order)


def _row(split: str, src: Mapping, candidate_sids, messages, assistant, reasoning, o: TeacherOutput | None,
         order=None) -> dict:
    row = {"user": src["user"], "position": src["position"], "split": split, "source": src["_source"],
           "history": src["history"], "history_len": src.get("history_len", len(src["history"])),
           "candidates": src["candidates"], "candidate_sids": list(candidate_sids), "scores": src["scores"],
           "target": src["target"], "target_index": src["candidates"].index(src["target"]),
           "prompt_messages": messages, "assistant": assistant, "reasoning": reasoning,
           "ranking": list(o.ranking) if o else None, "teacher": o.as_dict() if o else None}
    if order is not None:  # only where the prompt is not in retriever order: retriever builds stay byte-identical
        row["prompt_order"] = [int(j) for j in order]
    return row


def _prompt_token_stats(tok, split_rows: Mapping[str, list[dict]]) -> dict:
    """Prompt lengths as the model sees them (chat template + generation header), per split."""
    out = {}
    for split, rs in split_rows.items():
        texts = [tok.apply_chat_template(r["prompt_messages"], tokenize=False, add_generation_prompt=True) for r in rs]
        out[split] = _stats(len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]) if texts else _stats([])
    return out


# ---------------------------------------------------------------- the builder
def build_rerank_data(retrieval_dir, items_path, out_dir, teacher: str = "rule", teacher_options: Mapping | None = None,
                      n_selection_users: int = 1000, max_train_examples: int | None = None, seed: int = 0,
                      sid_config: Mapping | None = None, tokenizer_vocab: int = 2000, profile: str = "cpu",
                      max_prompt_tokens: int | None = DEFAULT_MAX_PROMPT_TOKENS, scorer_config: Mapping | None = None,
                      teacher_folds: int = 2, scorer_lists: str = "valid_positions", trace_style: str = "full",
                      tokenizer_from: str | Path | None = None, candidate_order: str = "retriever") -> dict:
    """Build the re-ranking data set (see the module docstring); returns build_report.json's content
    plus ``wall_seconds`` (kept out of the file so builds stay byte-identical)."""
    t0 = time.time()
    retrieval_dir, out = Path(retrieval_dir), Path(out_dir)
    if profile not in PROFILES:
        raise ValueError(f"unknown prompt profile {profile!r}; choose from {sorted(PROFILES)}")
    if candidate_order not in CANDIDATE_ORDERS:
        raise ValueError(f"candidate_order must be one of {CANDIDATE_ORDERS}, got {candidate_order!r}")
    if candidate_order != "retriever" and trace_style not in RULE_LABEL_STYLES:
        raise ValueError(f"candidate_order: {candidate_order} needs a rule trace style {RULE_LABEL_STYLES} (its "
                         f"answers are read back from the reordered prompts), got trace_style {trace_style!r}")
    scfg = scorer_settings(scorer_config, seed)
    out.mkdir(parents=True, exist_ok=True)
    seqs, rows = load_retrieval(retrieval_dir)
    items_frame = load_items(items_path).to_frame()
    meta = item_meta_lookup(items_frame)
    absent = [f for f in ITEM_FIELDS if f in absent_fields(meta)]
    if absent:
        log.warning("%s", absent_fields_note(meta, items_path))

    # 1. Semantic IDs (item content only).
    sids, no_meta = _sids_for(seqs, retrieval_dir, items_frame, sid_config or {}, seed)
    sids.save(out / "sids.json")

    # 2. Splits; the selection users are drawn from user ids alone.
    selected = selection_users(seqs, n_selection_users, seed)
    train_rows, valid_rows, test_rows = split_rows(rows, selected)
    if len(train_rows) < 2:
        raise ValueError(f"{retrieval_dir}: only {len(train_rows)} training lists contain their target; "
                         "too few to fit the scorer")

    # 3. Features (training-split counts, own user excluded); scorers fitted on train lists only.
    ctx = FeatureContext(train_sequences(seqs), meta)
    scorer, train_feats = _fit_scorers(ctx, train_rows, scfg, teacher_folds, seed, scorer_lists)
    scorer.full.save(out / "scorer")
    for k, m in enumerate(scorer.folds):
        m.save(out / "scorer" / f"fold{k}")
    Xv, gv = ctx.featurize(valid_rows, desc="valid features")
    # 3b. The prompts' candidate order (module docstring): None everywhere keeps the retriever's.
    orders = {"train": [None] * len(train_rows), "valid": [None] * len(valid_rows), "test": [None] * len(test_rows)}
    preranker = None
    if candidate_order == "retriever" and (out / "preranker").is_dir():
        shutil.rmtree(out / "preranker")  # an earlier build's: nothing here reads it any more
    if candidate_order == "scorer":
        preranker = PreRanker.fit([r for r in train_rows if r["_source"] == "valid"] + valid_rows, ctx, scfg, seed)
        if None in preranker.folds:
            raise ValueError(f"the pre-ranker's user halves: one has under 2 validation-position lists with their "
                             f"target to fit a model without it ({len(valid_rows)} selection lists); raise "
                             f"n_selection_users or use candidate_order: retriever")
        preranker.save(out / "preranker")
        orders["train"] = [order_by(s) for s in scorer.predict_lists(train_feats, [r["user"] for r in train_rows])]
        orders["valid"] = preranker.orders(Xv, gv, [r["user"] for r in valid_rows], cross_fitted=True)
        Xt, gt = ctx.featurize(test_rows, desc="test features")
        orders["test"] = preranker.orders(Xt, gt, [r["user"] for r in test_rows])

    # 4. Teaching (the training subsample is a seeded draw; the scorers saw every train list).
    teach_idx = np.arange(len(train_rows))
    if max_train_examples is not None and max_train_examples < len(train_rows):
        teach_idx = np.sort(np.random.default_rng([int(seed), 3]).choice(len(train_rows), max_train_examples,
                                                                          replace=False))
    kw = dict(meta=meta, sids=sids, copurchase=ctx.copurchase, max_hist=PROFILES[profile].max_history)
    train_ex = [_example(train_rows[i], train_feats[i], **kw)
                for i in tqdm(teach_idx, desc="train evidence", unit="ex", leave=False, mininterval=2.0)]
    valid_ex = [_example(r, f, **kw) for r, f in zip(valid_rows, _blocks(Xv, gv))]
    # The scan styles replace the teacher's ranking with a rule of the prompt's evidence: teach with
    # brief traces; the renderer rewrites each taught row exactly as `dgr2 data retrace` does (step 6).
    relabel = trace_style in RULE_LABEL_STYLES
    writer = TraceWriter(sids, meta, style="brief" if relabel else trace_style)
    teacher_obj = make_teacher(teacher, teacher_options, scorer=scorer, sids=sids, meta=meta, writer=writer, seed=seed)
    train_out = teacher_obj.teach_many(train_ex, desc="teaching train")
    valid_out = teacher_obj.teach_many(valid_ex, desc="teaching valid") if valid_ex else []

    # 5. Tokenizer on the train split only, or an existing one (new data for a trained model).
    if tokenizer_from is not None:
        tok = _reused_tokenizer(tokenizer_from, sids)
    else:
        tok = _train_tokenizer(train_ex, train_out, sids, meta, profile, tokenizer_vocab,
                               [orders["train"][i] for i in teach_idx], candidate_order)
    write_dir_atomically(out / "tokenizer", lambda p: tok.save_pretrained(str(p)))

    # 6. Final rows: prompts within the budget, assistant texts, targets.
    render = _Renderer(tok, sids, meta, writer, profile, max_prompt_tokens, seed, trace_style if relabel else None,
                       candidate_order)
    out_rows = {
        "train": [render.taught("train", train_rows[i], e, o, orders["train"][i]) for i, e, o in
                  tqdm(list(zip(teach_idx, train_ex, train_out)), desc="train rows", unit="ex", leave=False, mininterval=2.0)],
        "valid": [render.taught("valid", r, e, o, order)
                  for r, e, o, order in zip(valid_rows, valid_ex, valid_out, orders["valid"])],
        "test": [render.test(r, ctx.copurchase, order)
                 for r, order in tqdm(list(zip(test_rows, orders["test"])), desc="test rows", unit="ex", leave=False,
                                      mininterval=2.0)],
    }
    for split, rs in out_rows.items():
        write_jsonl(out / f"{split}.jsonl", rs)

    # 7. Report and build info.
    prompt_tokens = _prompt_token_stats(tok, out_rows)
    report = {
        "format": FORMAT, "n_candidates": len(train_rows[0]["candidates"]), "seed": seed, "profile": profile,
        "teacher": teacher, "trace_style": trace_style,
        **({"candidate_order": candidate_order,
            "preranker": {"full": preranker.full.info, "folds": [m.info if m else None for m in preranker.folds],
                          "feature_importance_gain": preranker.full.importance()}} if preranker else {}),
        "splits": {
            "train": {"examples": len(out_rows["train"]), "lists_with_target": len(train_rows),
                      "from_crossfit": sum(r["source"] == "crossfit" for r in out_rows["train"]),
                      "from_valid": sum(r["source"] == "valid" for r in out_rows["train"])},
            "valid": {"examples": len(out_rows["valid"]), "selection_users": len(selected)},
            "test": {"examples": len(out_rows["test"])},
        },
        "target_in_topN": _hit_rates(rows, selected),
        "teacher_stats": {"train": teacher_stats(train_out), "valid": teacher_stats(valid_out),
                          **({"details": teacher_obj.report()} if hasattr(teacher_obj, "report") else {})},
        "tokens": {"prompt": prompt_tokens, **{k: _stats(v) for k, v in render.tokens.items()}},
        "max_prompt_tokens": max_prompt_tokens,
        "max_prompt_len": max((s["max"] for s in prompt_tokens.values()), default=0),
        "prompts_trimmed": int(render.trimmed),
        "tokenizer_size": len(tok),
        "sids": {**sids.report(), "items_without_metadata": no_meta},
        # Only when something is absent: the report of a full catalog stays byte-identical.
        **({"absent_item_fields": absent} if absent else {}),
        "scorer": {"lists": scorer_lists, "full": scorer.full.info, "folds": [m.info for m in scorer.folds],
                   "feature_importance_gain": scorer.full.importance(),
                   "valid": _scorer_on_valid(scorer.full, Xv, gv, valid_rows)},
    }
    atomic_write_text(out / "build_report.json", json.dumps(report, indent=2))
    atomic_write_text(out / "build_info.json", json.dumps(_build_info(retrieval_dir, items_path, out, ctx, rows, report,
                                                                      max_prompt_tokens), indent=2))
    log.info("re-ranking data in %s: %s", out, {k: v["examples"] for k, v in report["splits"].items()})
    return {**report, "wall_seconds": round(time.time() - t0, 1)}


def _build_info(retrieval_dir: Path, items_path, out: Path, ctx: FeatureContext, rows, report, max_prompt_tokens) -> dict:
    """What the serving engine needs to rebuild the evidence; paths relative to ``out``."""
    return {
        "format": "diffusion-gr2/rerank-build-info/v1",
        "paths_relative_to": "the directory of this file",
        "retrieval_dir": os.path.relpath(retrieval_dir.resolve(), out.resolve()),
        "items_path": os.path.relpath(Path(items_path).resolve(), out.resolve()),
        "copurchase": {"window": ctx.window, "exclude_user": True,
                       "sequences": "retrieval_dir/sequences.json, each user's last two items removed"},
        # Evidence (brand/category match counts) was computed over at most this many recent items.
        "evidence_history_items": max((len(r["history"]) for rs in rows.values() for r in rs), default=0),
        "artifacts": {"sids": "sids.json", "tokenizer": "tokenizer", "scorer": "scorer",
                      **({"preranker": "preranker"} if "preranker" in report else {})},
        **({"candidate_order": report["candidate_order"]} if "candidate_order" in report else {}),
        "profile": report["profile"], "max_prompt_tokens": max_prompt_tokens,
        "n_candidates": report["n_candidates"], "seed": report["seed"],
    }


def _scorer_on_valid(scorer, X, groups, rows) -> dict | None:
    """Model-selection numbers of the full scorer on the valid split (reported, never fitted on)."""
    from reranker.eval.metrics import new_ranks, summarize

    if not rows:
        return None
    scores = np.split(scorer.predict(X), np.cumsum(groups)[:-1])
    targets = [r["candidates"].index(r["target"]) for r in rows]
    perms = [[int(i) for i in np.argsort(-s, kind="stable")] for s in scores]
    return {"examples": len(rows),
            "retriever": summarize(new_ranks([list(range(len(r["candidates"]))) for r in rows], targets)),
            "scorer": summarize(new_ranks(perms, targets))}


def _hit_rates(rows: Mapping[str, list[dict]], selected: set[str]) -> dict:
    def rate(rs):
        rs = list(rs)
        return round(sum(map(target_in_list, rs)) / len(rs), 4) if rs else None

    return {
        "train_crossfit": rate(rows["train"]),
        "valid_all_users": rate(rows["valid"]),
        "valid_selection_users": rate(r for r in rows["valid"] if r["user"] in selected),
        "valid_other_users": rate(r for r in rows["valid"] if r["user"] not in selected),
        "test": rate(rows["test"]),
    }


def load_split(data_dir, split: str) -> list[dict]:
    """Rows of one built split (train / valid / test)."""
    if split not in ("train", "valid", "test"):
        raise ValueError(f"unknown split {split!r}; choose train, valid or test")
    return read_jsonl(Path(data_dir) / f"{split}.jsonl",
                      {"user": str, "position": int, "candidates": list, "scores": list, "history": list})
