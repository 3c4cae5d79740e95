"""Trace teachers: the oracle hides the target, rejection sampling and its counted fallback, the
learned scorer, the trace writer, the JSONL importer and the local HF LLM teacher's plumbing."""

import json
import random

import numpy as np
import pandas as pd
import pytest
import torch

from reranker.data.evidence import candidates_evidence, item_meta_lookup
from reranker.data.features import FeatureContext
from reranker.data.teachers.base import Oracle, TeachExample, rejection_sample, teacher_stats
from reranker.data.teachers.jsonl import JsonlTeacher, TraceFileError, load_external_traces
from reranker.text.answer import parse_ranking
from reranker.text.sid import build_semantic_ids, content_embeddings
from reranker.data.teachers.rule import (LtrScorer, RuleTeacher, ScorerConfig, fit_cross_fitted, plackett_luce_sample,
                                   promote_then_input_order)
from reranker.data.teachers.traces import TraceWriter, trace_rng

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def world():
    rng = random.Random(0)
    n_items = 80
    items = pd.DataFrame({
        "item_id": [f"i{k}" for k in range(n_items)],
        "title": [f"{rng.choice(['Soft', 'Deep', 'Pure'])} thing {k}" for k in range(n_items)],
        "brand": [rng.choice(["Lumo", "Kave", "Ritz", "Sona"]) for _ in range(n_items)],
        "categories": [["Beauty", rng.choice(["Skin_Care", "Hair_Care"]), rng.choice(["Creams", "Oils", "Gels", "Masks"])]
                       for _ in range(n_items)],
    })
    ids = list(items["item_id"])
    seqs = {f"u{u}": [ids[(s + 2 * k + rng.randrange(2)) % n_items] for k in range(rng.randint(6, 12))]
            for u, s in ((u, rng.randrange(n_items)) for u in range(150))}
    meta = item_meta_lookup(items)
    sids = build_semantic_ids(content_embeddings(items, dim=8), ids)
    ctx = FeatureContext({u: s[:-2] for u, s in seqs.items()}, meta)
    examples, labels_users = [], []
    for user, seq in seqs.items():
        history, target = seq[:-1], seq[-1]
        pool = [i for i in ids if i not in history and i != target]
        cands = rng.sample(pool, 9) + [target]
        rng.shuffle(cands)
        scores = sorted((rng.random() for _ in cands), reverse=True)
        ev = candidates_evidence(history, cands, meta, ctx.copurchase, user)
        feats = ctx.list_features(user, history, cands, scores)
        examples.append(TeachExample(user, len(history), history, cands, [sids.sid_string(c) for c in cands],
                                     scores, ev, min(8, len(history)), Oracle(cands.index(target)), feats))
        labels_users.append((cands.index(target), user))
    return {"items": items, "meta": meta, "sids": sids, "examples": examples, "labels_users": labels_users}


@pytest.fixture(scope="module")
def scorer(world):
    exs = world["examples"]
    X = np.concatenate([e.features for e in exs])
    labels = np.concatenate([np.eye(10)[t] for t, _ in world["labels_users"]])
    users = [u for _, u in world["labels_users"]]
    cfg = ScorerConfig(n_estimators=40, min_child_samples=5, early_stopping_rounds=10)
    return fit_cross_fitted(X, [10] * len(exs), labels, users, folds=2, config=cfg)


class RecordingOracle(Oracle):
    """Never accepts; records every proposal it is shown."""

    __slots__ = ("seen",)

    def __init__(self, target):
        super().__init__(target)
        self.seen = []

    def accept(self, ranking):
        self.seen.append(list(ranking))
        return False


def test_oracle_hides_target_and_builds_fallback():
    o = Oracle(3)
    assert "3" not in repr(o) and "3" not in str(o)
    assert o.accept([3, 0, 1, 2]) and not o.accept([0, 3, 1, 2]) and not o.accept([])
    assert o.targeted([2, 0, 3, 1]) == [3, 2, 0, 1]


def test_rejection_sample_stops_at_first_accept():
    calls = []

    def propose(k):
        calls.append(k)
        return [k % 3, *(i for i in range(3) if i != k % 3)]

    ranking, tries = rejection_sample(propose, Oracle(2), max_tries=8)
    assert ranking[0] == 2 and tries == 3 and calls == [0, 1, 2]
    ranking, tries = rejection_sample(lambda k: [0, 1, 2], Oracle(2), max_tries=4)
    assert ranking is None and tries == 4
    with pytest.raises(ValueError, match="max_tries"):
        rejection_sample(propose, Oracle(0), 0)


def test_plackett_luce_is_seeded_and_follows_scores():
    s = np.array([3.0, 0.0, -1.0, 1.0])
    assert plackett_luce_sample(s, 0.0, None) == [0, 3, 1, 2]
    a = [plackett_luce_sample(s, 1.0, np.random.default_rng(5)) for _ in range(3)]
    b = [plackett_luce_sample(s, 1.0, np.random.default_rng(5)) for _ in range(3)]
    assert a == b
    rng = np.random.default_rng(0)
    firsts = [plackett_luce_sample(s, 1.0, rng)[0] for _ in range(2000)]
    p0 = np.exp(3) / np.exp(s).sum()
    assert abs(firsts.count(0) / 2000 - p0) < 0.04
    assert sorted(plackett_luce_sample(s, 0.5, rng)) == [0, 1, 2, 3]


def test_scorer_save_load_and_determinism(world, scorer, tmp_path):
    X = np.concatenate([e.features for e in world["examples"][:5]])
    scorer.full.save(tmp_path / "s")
    loaded = LtrScorer.load(tmp_path / "s")
    assert np.allclose(loaded.predict(X), scorer.full.predict(X))
    exs = world["examples"]
    X_all = np.concatenate([e.features for e in exs])
    labels = np.concatenate([np.eye(10)[t] for t, _ in world["labels_users"]])
    users = [u for _, u in world["labels_users"]]
    cfg = ScorerConfig(n_estimators=40, min_child_samples=5, early_stopping_rounds=10)
    again = fit_cross_fitted(X_all, [10] * len(exs), labels, users, folds=2, config=cfg)
    assert again.full.model_text() == scorer.full.model_text()
    assert [m.model_text() for m in again.folds] == [m.model_text() for m in scorer.folds]
    # Users in fold k are scored by the model fitted without them.
    u = users[0]
    assert scorer.scorer_for(u) is scorer.folds[scorer.fold_of[u]]
    assert scorer.scorer_for("someone-else") is scorer.full
    with pytest.raises(ValueError, match="unknown feature"):
        LtrScorer.fit(X_all, [10] * len(exs), labels, users, ScorerConfig(exclude_features=("nope",)))


def test_rule_teacher_accepts_target_first_and_is_deterministic(world, scorer):
    writer = TraceWriter(world["sids"], world["meta"])
    teacher = RuleTeacher(scorer, writer, temperature=1.0, max_tries=8, seed=0)
    outs = teacher.teach_many(world["examples"])
    assert outs == teacher.teach_many(world["examples"])
    assert [teacher.teach(e) for e in world["examples"][:10]] == outs[:10]
    for o, (t, _) in zip(outs, world["labels_users"]):
        assert o.ranking[0] == t and sorted(o.ranking) == list(range(10))
        assert o.accepted != o.fallback and 1 <= o.tries <= 8
    stats = teacher_stats(outs)
    assert stats["accepted"] + stats["fallback"] == len(outs) and stats["accepted"] > 0


def test_promoted_head_then_the_retriever_order():
    assert promote_then_input_order([5, 2, 9, 0, 1, 3, 4, 6, 7, 8], 1) == [5, 0, 1, 2, 3, 4, 6, 7, 8, 9]
    assert promote_then_input_order([5, 2, 9, 0, 1, 3, 4, 6, 7, 8], 2) == [5, 2, 0, 1, 3, 4, 6, 7, 8, 9]
    assert promote_then_input_order([0, 1, 2], 3) == [0, 1, 2]


def test_rule_teacher_tail_follows_the_retriever_order_and_the_trace_says_so(world, scorer):
    """Default promote=1: the answer below the chosen first item is the input order, so it follows
    from the trace and the prompt; promote=None keeps the whole sampled permutation."""
    writer = TraceWriter(world["sids"], world["meta"])
    outs = RuleTeacher(scorer, writer, seed=0).teach_many(world["examples"][:20])
    for o in outs:
        rest = list(o.ranking[1:])
        assert rest == sorted(rest) and "the rest in retriever order" in o.reasoning
        assert "weaker evidence" not in o.reasoning
    sampled = RuleTeacher(scorer, writer, seed=0, promote=None).teach_many(world["examples"][:20])
    assert [o.ranking[0] for o in sampled] == [o.ranking[0] for o in outs]
    assert any(list(o.ranking[1:]) != sorted(o.ranking[1:]) for o in sampled)
    with pytest.raises(ValueError, match="promote"):
        RuleTeacher(scorer, writer, promote=0)


def test_rule_teacher_proposals_do_not_depend_on_the_target(world, scorer):
    """The sampler never sees the target: with an oracle that never accepts, the proposals are the
    same whatever the target is, and the fallback (counted) puts the target first."""
    writer = TraceWriter(world["sids"], world["meta"])
    teacher = RuleTeacher(scorer, writer, max_tries=5, seed=3)
    ex = world["examples"][0]
    seen = []
    for target in (0, 7):
        oracle = RecordingOracle(target)
        ex2 = TeachExample(**{**ex.__dict__, "oracle": oracle})
        out = teacher.teach(ex2)
        assert out.fallback and not out.accepted and out.tries == 5
        assert out.ranking[0] == target
        seen.append(oracle.seen)
    assert seen[0] == seen[1] and len(seen[0]) == 5


def test_trace_writer_cites_sids_and_varies_wording(world):
    writer = TraceWriter(world["sids"], world["meta"])
    ex = world["examples"][1]
    ranking = list(range(10))[::-1]
    text = writer.write(ex.history, ex.candidates, ex.evidence, ranking, ex.shown_history, random.Random(0))
    for j in ranking[:3]:
        assert ex.candidate_sids[j] in text
    assert world["sids"].sid_string(ex.history[-1]) in text
    assert "<think>" not in text and "</think>" not in text
    assert 40 <= len(text.split()) <= 120
    assert text == writer.write(ex.history, ex.candidates, ex.evidence, ranking, ex.shown_history, random.Random(0))
    variants = {writer.write(ex.history, ex.candidates, ex.evidence, ranking, ex.shown_history, trace_rng(0, ex.user, p))
                for p in range(30)}
    assert len(variants) > 3
    with pytest.raises(ValueError, match="not a permutation"):
        writer.write(ex.history, ex.candidates, ex.evidence, [0, 0, 1], 8, random.Random(0))


def _write(path, lines):
    path.write_text("".join((json.dumps(x) if not isinstance(x, str) else x) + "\n" for x in lines))
    return path


@pytest.mark.parametrize("line, message", [
    ("{not json", r":1: invalid JSON"),
    ({"user": "u", "position": 1, "reasoning": "r"}, r":1: field 'ranking' is missing"),
    ({"user": "u", "position": "1", "reasoning": "r", "ranking": []}, r":1: field 'position'"),
    ({"user": "u", "position": 1, "reasoning": "", "ranking": []}, r":1: field 'reasoning'"),
    ({"user": "u", "position": 1, "reasoning": "a </think> b", "ranking": []}, r":1: field 'reasoning': must not"),
    ({"user": "u", "position": 1, "reasoning": "r", "ranking": [1, 2]}, r":1: field 'ranking'"),
])
def test_jsonl_import_errors_name_file_line_field(tmp_path, line, message):
    path = _write(tmp_path / "traces.jsonl", [line])
    with pytest.raises(TraceFileError, match=message) as err:
        load_external_traces(path)
    assert "traces.jsonl" in str(err.value)


def test_jsonl_teacher_accept_rule_failures_and_counts(world, tmp_path):
    ex, ex2, ex3 = world["examples"][:3]
    t = world["labels_users"][0][0]
    others = [i for i in range(10) if i != t]
    sids = ex.candidate_sids
    lines = [
        {"user": ex.user, "position": ex.position, "reasoning": "wrong first", "ranking": [sids[i] for i in others + [t]]},
        {"user": ex.user, "position": ex.position, "reasoning": "dup", "ranking": [sids[t]] * 10},
        # Raw item ids are accepted as well as SIDs.
        {"user": ex.user, "position": ex.position, "reasoning": "good one",
         "ranking": [ex.candidates[t]] + [sids[i] for i in others]},
        {"user": ex2.user, "position": ex2.position, "reasoning": "short", "ranking": ex2.candidate_sids[:9]},
        {"user": ex2.user, "position": ex2.position, "reasoning": "alien", "ranking": ["zzz"] + ex2.candidate_sids[1:]},
        {"user": "nobody", "position": 3, "reasoning": "unused", "ranking": []},
    ]
    teacher = JsonlTeacher(_write(tmp_path / "t.jsonl", lines), world["sids"], TraceWriter(world["sids"], world["meta"]))
    o1, o2, o3 = (teacher.teach(e) for e in (ex, ex2, ex3))
    assert o1.accepted and o1.tries == 3 and o1.reasoning == "good one" and o1.ranking[0] == t
    assert o2.fallback and not o2.accepted and o2.tries == 2 and o2.info["failures"] == {"dropped": 1, "out_of_set": 1}
    assert o3.fallback and o3.tries == 0 and sorted(o3.ranking) == list(range(10))
    rep = teacher.report()
    assert (rep["accepted"], rep["rejected"], rep["duplicate"], rep["dropped"], rep["out_of_set"]) == (1, 1, 1, 1, 1)
    assert (rep["missing"], rep["fallback"], rep["lines"], rep["unused_keys"]) == (1, 2, 6, 1)


def test_hf_llm_teacher_plumbing_with_tiny_random_model(world, tmp_path):
    """A random tiny Qwen3 writes garbage: every sample is rejected and the fallback is counted."""
    from reranker.data.teachers.hf_llm import HfLlmTeacher, split_reasoning
    from reranker.model import SIZES, build_model, save_model
    from reranker.text.prompt import render_prompt_messages
    from reranker.text.tokenizer import build_tokenizer

    exs = world["examples"][:2]
    corpus = [m["content"] for e in exs for m in render_prompt_messages(
        e.history, e.candidates, world["sids"], world["meta"], e.evidence, profile="full")]
    tok = build_tokenizer(corpus * 3, vocab_size=400)
    model = build_model(len(tok), dict(SIZES["tiny"], max_position_embeddings=4096),
                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    save_model(model, tok, tmp_path / "llm")
    teacher = HfLlmTeacher(tmp_path / "llm", world["sids"], world["meta"], TraceWriter(world["sids"], world["meta"]),
                           max_tries=3, tries_per_batch=2, max_new_tokens=6, seed=0)
    outs = teacher.teach_many(exs)
    for o, e in zip(outs, exs):
        assert o.fallback and not o.accepted and o.tries == 3
        assert e.oracle.accept(o.ranking) and e.candidate_sids[o.ranking[0]] in o.reasoning
    rep = teacher.report()
    assert rep["samples"] == 6 and rep["fallback"] == 2 and rep["accepted"] == 0
    assert [teacher.teach(e) for e in exs] == outs  # seeded sampling
    assert split_reasoning("<think>\n because \n</think>{}") == "because"
    assert split_reasoning("no markers") is None and split_reasoning("<think> </think>") is None
    ok = "<think>x</think>" + json.dumps({"ranking": exs[0].candidate_sids})
    assert parse_ranking(ok, exs[0].candidate_sids).ok


def test_brief_trace_is_the_decision_with_the_full_traces_reason(world):
    from reranker.data.retrace import why_of

    full, brief = TraceWriter(world["sids"], world["meta"]), TraceWriter(world["sids"], world["meta"], style="brief")
    for ex in world["examples"][:20]:
        for k in (0, 3):
            ranking = promote_then_input_order([k] + [i for i in range(10) if i != k], 1)
            text = brief.write(ex.history, ex.candidates, ex.evidence, ranking, ex.shown_history, random.Random(0))
            reason = why_of(full.write(ex.history, ex.candidates, ex.evidence, ranking, ex.shown_history, random.Random(0)))
            assert text == f"#{k + 1}.{ex.candidate_sids[k]} first ({reason}), then the rest in retriever order."
    with pytest.raises(ValueError, match="trace style 'long' unknown"):
        TraceWriter(world["sids"], world["meta"], style="long")


def test_rule_teacher_without_rejection_distills_the_scorers_choice(world, scorer):
    """rejection=False: the answer is the scorer's own top item whatever the target; `accepted`
    records whether it was right. The choice must not move when the target does."""
    writer = TraceWriter(world["sids"], world["meta"], style="brief")
    exs = world["examples"]
    teacher = RuleTeacher(scorer, writer, temperature=0.0, seed=0, rejection=False)
    outs = teacher.teach_many(exs)
    scores = scorer.predict_lists([e.features for e in exs], [e.user for e in exs])
    for o, e, s, (t, _) in zip(outs, exs, scores, world["labels_users"]):
        assert o.ranking[0] == int(np.argmax(s)) and list(o.ranking[1:]) == sorted(o.ranking[1:])
        assert o.accepted == (o.ranking[0] == t) and o.tries == 1 and not o.fallback
        assert o.reasoning.startswith(f"#{o.ranking[0] + 1}.{e.candidate_sids[o.ranking[0]]} first (")
    assert 0 < sum(o.accepted for o in outs) < len(outs)
    moved = [TeachExample(e.user, e.position, e.history, e.candidates, e.candidate_sids, e.scores, e.evidence,
                          e.shown_history, Oracle((t + 1) % 10), e.features)
             for e, (t, _) in zip(exs, world["labels_users"])]
    assert [o.ranking for o in teacher.teach_many(moved)] == [o.ranking for o in outs]


def test_copurchase_scan_marks_each_new_best_and_picks_the_first_largest():
    from reranker.data.teachers.traces import copurchase_scan, scan_trace

    line, first = copurchase_scan([1, 3, 1, 0, 3, 4, 4])
    assert line == "After the last item: #1 1+ #2 3+ #3 1 #4 0 #5 3 #6 4+ #7 4."
    assert first == 5
    assert copurchase_scan([0, 0, 0]) == ("After the last item: #1 0+ #2 0 #3 0.", 0)
    sids = [f"<s{i}>" for i in range(4)]
    trace, ranking = scan_trace(sids, [0, 2, 5, 1])
    assert ranking == [2, 0, 1, 3]
    assert trace.splitlines()[1] == ("#3.<s2> first (strongest co-purchase after the last item), "
                                     "then the rest in retriever order.")
    assert "#1.<s0> first (the retriever's top choice)" in scan_trace(sids, [0, 0, 0, 0])[0]
    with pytest.raises(ValueError, match="4 candidates but 3"):
        scan_trace(sids, [1, 2, 3])
    # tuples (counts after the last items, newest first) compare in that order
    line, first = copurchase_scan([(1, 0, 4), (1, 2, 0), (0, 9, 9), (1, 2, 0)], "H:")
    assert (line, first) == ("H: #1 1/0/4+ #2 1/2/0+ #3 0/9/9 #4 1/2/0.", 1)
    assert "#2.<s1> first (co-bought after recent items)" in scan_trace(sids, [(0, 0), (0, 3), (0, 1), (0, 0)])[0]
    with pytest.raises(ValueError, match="at least one"):
        copurchase_scan([])
    # brand counts are written after the counts and break their ties only
    line, first = copurchase_scan([(0, 1), (0, 1), (0, 0), (1, 0)], "H:", brands=[0, 2, 5, 0])
    assert (line, first) == ("H: #1 0/1 b0+ #2 0/1 b2+ #3 0/0 b5 #4 1/0 b0+.", 3)
    trace, ranking = scan_trace(sids, [(0, 0)] * 4, "H:", brands=[0, 0, 3, 3])
    assert ranking == [2, 0, 1, 3] and "#3.<s2> first (same brand as the history)" in trace
    with pytest.raises(ValueError, match="4 co-purchase counts but 3 brand counts"):
        copurchase_scan([0, 0, 0, 0], brands=[1, 2, 3])


def test_top_scan_keeps_a_running_best_three_equal_to_a_stable_sort():
    from reranker.data.teachers.traces import scan_trace, top_scan

    line, best = top_scan([(2, 0), (1, 1), (0, 0), (1, 2), (1, 1)], "H:")
    # #4 enters between #1 and #2; #5 ties #2 and keeps below it (retriever order breaks ties)
    assert line == "H: #1 2/0 [1] #2 1/1 [1 2] #3 0/0 [1 2 3] #4 1/2 [1 4 2] #5 1/1."
    assert best == [0, 3, 1]
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 12)
        counts = [tuple(rng.randint(0, 2) for _ in range(3)) for _ in range(n)]
        brands = [rng.randint(0, 2) for _ in range(n)]
        keys = [c + (b,) for c, b in zip(counts, brands)]
        expected = sorted(range(n), key=lambda j: keys[j], reverse=True)  # stable: ties keep order
        line, best = top_scan(counts, "H:", brands)
        assert best == expected[:3]
        # the list written last on the line is the answer's head, numbered from 1
        assert line.rsplit("[", 1)[1].split("]")[0].split() == [str(j + 1) for j in best]
        sids = [f"<s{i}>" for i in range(n)]
        trace, ranking = scan_trace(sids, counts, "H:", brands, top=3)
        assert ranking[:3] == expected[:3] and sorted(ranking) == list(range(n))
        assert ranking[3:] == sorted(ranking[3:])
        assert trace.splitlines()[1].startswith(f"#{best[0] + 1}.<s{best[0]}> first (")
    sids = [f"<s{i}>" for i in range(5)]
    trace, ranking = scan_trace(sids, [0, 3, 0, 5, 1], top=3)
    assert ranking == [3, 1, 4, 0, 2]
    assert trace.splitlines()[1] == ("#4.<s3> first (strongest co-purchase after the last item), then #2.<s1>, "
                                     "#5.<s4>, then the rest in retriever order.")
    assert scan_trace(sids[:1], [2], top=3)[0].endswith("#1.<s0> first (strongest co-purchase after the last "
                                                        "item), then the rest in retriever order.")
    with pytest.raises(ValueError, match="top must be"):
        top_scan([1, 2], "H:", top=0)
    with pytest.raises(ValueError, match="at least one"):
        top_scan([], "H:")


def test_top3_styles_retrace_a_prompt_with_the_same_pick_and_an_ordered_head(world):
    from reranker.data.retrace import RULE_LABEL_STYLES, rule_keys, rule_scan
    from reranker.text.prompt import render_prompt_messages

    assert {"scan_top3", "scan_recent_top3", "scan_brand_top3"} <= set(RULE_LABEL_STYLES)
    e = world["examples"][0]
    text = render_prompt_messages(e.history, e.candidates, world["sids"], world["meta"], e.evidence)[1]["content"]
    for style in ("scan", "scan_recent", "scan_brand"):
        trace1, ranking1 = rule_scan(text, e.candidate_sids, style)
        trace3, ranking3 = rule_scan(text, e.candidate_sids, style + "_top3")
        keys = rule_keys(text, len(e.candidate_sids), style)
        assert rule_keys(text, len(e.candidate_sids), style + "_top3") == keys
        assert ranking3[0] == ranking1[0]
        assert ranking3[:3] == sorted(range(len(keys)), key=lambda j: keys[j], reverse=True)[:3]
        assert "; best 3 so far:" in trace3.splitlines()[0] and "best 3" not in trace1
    with pytest.raises(ValueError, match="got style 'scan_top3_top3'"):
        rule_scan(text, e.candidate_sids, "scan_top3_top3")


def test_candidate_evidence_parses_back_from_a_rendered_prompt(world):
    from reranker.text.prompt import parse_candidate_evidence, render_prompt_messages

    ids = list(world["items"]["item_id"])
    hist, cands = ids[:3], ids[3:9]
    rng = random.Random(0)
    evidence = [{"copurchase_recent": [rng.randrange(30), rng.randrange(3), 0], "brand_match_count": rng.randrange(4),
                 "leaf_category_match": bool(rng.randrange(2))} for _ in cands]
    msgs = render_prompt_messages(hist, cands, world["sids"], world["meta"], evidence)
    user = next(m["content"] for m in msgs if m["role"] == "user")
    assert parse_candidate_evidence(user, len(cands)) == evidence
    without = render_prompt_messages(hist, cands, world["sids"], world["meta"], None)
    with pytest.raises(ValueError, match=r"no evidence .* line\(s\) \[1, 2, 3, 4, 5\]"):
        parse_candidate_evidence(next(m["content"] for m in without if m["role"] == "user"), len(cands))
