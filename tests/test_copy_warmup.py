"""Copy warm-up data: every answer token is determined by the prompt, in the re-ranking format."""

import json

import pytest

from reranker.answer import parse_ranking
from reranker.copy_warmup import build_copy_warmup, copy_example

SIDS = [f"<|sid_begin|><a_{i}><b_{i % 3}><c_1><d_0><|sid_end|>" for i in range(10)]


def test_copy_example_promotes_k_then_keeps_the_listed_order():
    rec = copy_example(SIDS, 6)
    user = rec["prompt_messages"][1]["content"]
    assert f"7.{SIDS[6]}" in user and "Put #7 first" in user
    answer = rec["assistant"].split("</think>\n", 1)[1]
    assert json.loads(answer)["ranking"] == [SIDS[6]] + SIDS[:6] + SIDS[7:]
    with pytest.raises(ValueError, match="outside"):
        copy_example(SIDS, 10)


def test_build_copy_warmup_is_seeded_and_parses_as_rankings(tmp_path):
    rows = [{"candidate_sids": SIDS, "prompt_messages": [], "assistant": "x"} for _ in range(5)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = build_copy_warmup(tmp_path, seed=1)
    first = out.read_text()
    assert build_copy_warmup(tmp_path, seed=1).read_text() == first
    recs = [json.loads(x) for x in first.splitlines()]
    assert len(recs) == 5
    for r in recs:
        ranking = parse_ranking(r["assistant"], SIDS)
        assert sorted(ranking.permutation) == list(range(10)), ranking
    (tmp_path / "train.jsonl").write_text('{"candidate_sids": "oops"}\n')
    with pytest.raises(ValueError, match="train.jsonl:1"):
        build_copy_warmup(tmp_path)


def test_full_prompt_copy_keeps_the_real_prompt_and_asks_for_k_first(tmp_path):
    user = "History (oldest first, 1 of 1):\nh\nCandidates (retriever order).\n" + "\n".join(
        f"{i + 1}.{s} Cat, Brand; cobought 0/0" for i, s in enumerate(SIDS)) + "\nRank all 10 candidates."
    row = {"candidate_sids": SIDS, "assistant": "x",
           "prompt_messages": [{"role": "system", "content": "Re-rank."}, {"role": "user", "content": user}]}
    (tmp_path / "train.jsonl").write_text(json.dumps(row) + "\n")
    rec = json.loads(build_copy_warmup(tmp_path, full_prompt=True, seed=3).read_text())
    content = rec["prompt_messages"][1]["content"]
    assert content.startswith("History (oldest first") and "Rank all" not in content
    k = int(content.rsplit("Put #", 1)[1].split(" ", 1)[0]) - 1
    assert rec["prompt_messages"][0]["content"] == "Re-rank."
    assert parse_ranking(rec["assistant"], SIDS).permutation == tuple([k] + [i for i in range(10) if i != k])
