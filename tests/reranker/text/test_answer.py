"""Answer parsing: the happy path, every failure kind, fallback, and the optional projection."""

import itertools
import json

import numpy as np
import pytest

from reranker.text.answer import (
    FailureCounter,
    fallback_permutation,
    parse_ranking,
    permutation_or_fallback,
    project_to_permutation,
)
from reranker.text.sid import format_sid

CANDS = [format_sid((i, i + 1, i + 2, 0)) for i in range(5)]


def answer(ranking, reasoning="c3 was co-bought after the last item."):
    return f"<think>\n{reasoning}\n</think>\n" + json.dumps({"ranking": ranking})


def test_happy_path():
    order = [CANDS[i] for i in (3, 0, 4, 1, 2)]
    res = parse_ranking(answer(order), CANDS)
    assert res.ok and res.failure is None
    assert res.permutation == (3, 0, 4, 1, 2)


def test_tolerates_whitespace_trailing_eos_and_answer_only_text():
    order = [CANDS[i] for i in (1, 0, 2, 3, 4)]
    body = json.dumps({"ranking": order}, indent=2)
    assert parse_ranking(f"<think>\nx\n</think>  \n\n {body} \n<|im_end|>", CANDS).permutation == (1, 0, 2, 3, 4)
    assert parse_ranking(f"  {body}\n", CANDS).ok


@pytest.mark.parametrize("text, detail", [
    ("<think>\nhmm\n</think>\n{\"ranking\": [", "invalid JSON"),
    ("<think>\nhmm\n</think>\n", "invalid JSON"),
    ("<think>\nnever closed {\"ranking\": []}", "invalid JSON"),
    ("<think>\nx\n</think>\n{\"order\": []}", '"ranking" list'),
    ("<think>\nx\n</think>\n[1, 2]", '"ranking" list'),
    ("<think>\nx\n</think>\n{\"ranking\": \"abc\"}", '"ranking" list'),
    ("<think>\nx\n</think>\n{\"ranking\": [0, 1, 2, 3, 4]}", "SID strings, got 0"),
    ("<think>\nx\n</think>\n{\"ranking\": []} trailing", "invalid JSON"),
    ("<think>\nx\n</think>\nSure! {\"ranking\": []}", "invalid JSON"),
])
def test_unparsable(text, detail):
    res = parse_ranking(text, CANDS)
    assert not res.ok and res.failure == "unparsable" and res.permutation is None
    assert detail in res.detail


def test_out_of_set_names_the_sid_and_wins_over_duplicates():
    stranger = format_sid((200, 200, 200, 0))
    res = parse_ranking(answer([CANDS[0], CANDS[0], stranger]), CANDS)
    assert res.failure == "out_of_set"
    assert stranger in res.detail
    res = parse_ranking(answer(CANDS[:4] + [CANDS[4][:-2]]), CANDS)  # truncated SID is not a candidate
    assert res.failure == "out_of_set"


def test_duplicate_wins_over_dropped():
    res = parse_ranking(answer([CANDS[0], CANDS[1], CANDS[1]]), CANDS)
    assert res.failure == "duplicate"
    assert CANDS[1] in res.detail and "2 times" in res.detail
    res = parse_ranking(answer(CANDS + [CANDS[2]]), CANDS)  # all present plus one repeat
    assert res.failure == "duplicate"


def test_dropped():
    res = parse_ranking(answer([CANDS[4], CANDS[0], CANDS[1]]), CANDS)
    assert res.failure == "dropped"
    assert "2 candidate(s) missing" in res.detail and CANDS[2] in res.detail


def test_duplicate_candidate_list_is_a_caller_error():
    with pytest.raises(ValueError, match="repeats the SID"):
        parse_ranking(answer(CANDS), CANDS + [CANDS[0]])


def test_counter_and_fallback():
    counter = FailureCounter()
    for text in (answer(CANDS), answer(CANDS[:2]), "garbage", answer(CANDS[:1] * 2), answer(["<x>"])):
        res = counter.add(parse_ranking(text, CANDS))
        assert permutation_or_fallback(res, len(CANDS)) == (list(res.permutation) if res.ok else [0, 1, 2, 3, 4])
    d = counter.as_dict()
    assert {k: d[k] for k in ("ok", "unparsable", "out_of_set", "duplicate", "dropped")} == \
        {"ok": 1, "unparsable": 1, "out_of_set": 1, "duplicate": 1, "dropped": 1}
    assert d["total"] == 5 and d["valid_rate"] == pytest.approx(0.2) and d["fallback_rate"] == pytest.approx(0.8)
    assert fallback_permutation(3) == [0, 1, 2] and fallback_permutation(0) == []
    assert FailureCounter().valid_rate == 0.0


def test_projection_is_the_best_permutation():
    rng = np.random.default_rng(0)
    scores = rng.normal(size=(5, 5))
    best = max(itertools.permutations(range(5)), key=lambda p: sum(scores[r, c] for r, c in enumerate(p)))
    assert project_to_permutation(scores) == list(best)
    assert project_to_permutation([0.1, 0.9, 0.5]) == [1, 2, 0]
    assert project_to_permutation([1.0, 1.0]) == [0, 1]  # ties keep retriever order


def test_projection_rejects_bad_scores():
    with pytest.raises(ValueError, match="shape"):
        project_to_permutation(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="NaN"):
        project_to_permutation([0.0, float("nan")])
