"""Copy warm-up data: every answer token is determined by the prompt, in the re-ranking format."""

import json

import pytest

from reranker.data.copy_warmup import build_copy_warmup, copy_example
from reranker.text.answer import parse_ranking

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


def test_relabel_sids_is_consistent_keeps_prefixes_and_never_merges_sids():
    import random

    from reranker.data.copy_warmup import relabel_sids

    sids = SIDS + ["<|sid_begin|><a_0><b_0><c_1><d_1><|sid_end|>"]  # shares a, b, c with SIDS[0]
    rec = {"prompt_messages": [{"role": "user", "content": "h " + sids[3] + "\n" + "\n".join(sids)}],
           "assistant": json.dumps({"ranking": sids[::-1]}), "candidate_sids": sids}
    out = relabel_sids(rec, random.Random(0))
    assert out == relabel_sids(rec, random.Random(0)) and out != relabel_sids(rec, random.Random(1))
    new = out["candidate_sids"]
    assert len(set(new)) == len(new) and not set(new) & set(sids)
    assert new[11 - 1][:-len("<d_1><|sid_end|>")] == new[0][:-len("<d_0><|sid_end|>")]  # shared prefix kept
    lines = out["prompt_messages"][0]["content"].split("\n")
    assert lines[0] == "h " + new[3] and lines[1:] == new  # the same SID -> the same new SID everywhere
    assert list(parse_ranking(out["assistant"], new).permutation) == list(range(len(sids)))[::-1]


def test_relabel_sids_redraws_a_collision():
    import random

    from reranker.data.copy_warmup import relabel_sids

    class Fixed(random.Random):  # every draw 7 until told otherwise: the second SID collides once
        def __init__(self):
            super().__init__(0)
            self.draws = [7, 7, 7, 7, 7, 7, 9]

        def randrange(self, n):
            return self.draws.pop(0) if self.draws else super().randrange(n)

    a = "<|sid_begin|><a_1><b_1><c_1><d_0><|sid_end|>"
    b = "<|sid_begin|><a_2><b_2><c_2><d_0><|sid_end|>"
    out = relabel_sids({"prompt_messages": [], "assistant": a + b}, Fixed())
    assert out["assistant"] == ("<|sid_begin|><a_7><b_7><c_7><d_0><|sid_end|>"
                                "<|sid_begin|><a_7><b_7><c_9><d_0><|sid_end|>")


def test_build_copy_warmup_random_sids(tmp_path):
    rows = [{"candidate_sids": SIDS, "prompt_messages": [], "assistant": "x"} for _ in range(3)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recs = [json.loads(x) for x in build_copy_warmup(tmp_path, seed=2, random_sids=True).read_text().splitlines()]
    for r in recs:
        answer = json.loads(r["assistant"].split("</think>\n", 1)[1])["ranking"]
        assert not set(answer) & set(SIDS) and len(set(answer)) == 10
        assert all(s in r["prompt_messages"][1]["content"] for s in answer)


def test_build_copy_warmup_out_path_leaves_the_data_dir_alone(tmp_path):
    rows = [{"candidate_sids": SIDS, "prompt_messages": [], "assistant": "x"} for _ in range(2)]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = build_copy_warmup(tmp_path / "data", source="valid.jsonl", out_path=tmp_path / "probe" / "p.jsonl")
    assert out == tmp_path / "probe" / "p.jsonl" and len(out.read_text().splitlines()) == 2
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["valid.jsonl"]


def test_straight_copy_lists_copy_verbatim_share_prefixes_and_do_not_depend_on_the_hash_seed(tmp_path):
    import os
    import subprocess
    import sys

    from reranker.data.copy_warmup import straight_copy_lists

    recs = straight_copy_lists(200, seed=4)
    assert recs == straight_copy_lists(200, seed=4) and recs != straight_copy_lists(200, seed=5)
    shared = 0
    for r in recs:
        listing = json.loads(r["prompt_messages"][1]["content"])["ranking"]
        assert len(set(listing)) == 10
        answer = r["assistant"].split("</think>\n", 1)[1]
        assert list(parse_ranking(r["assistant"], listing).permutation) == list(range(10))
        assert json.loads(answer)["ranking"] == listing
        shared += len({s[:s.index("><b_")] for s in listing}) < 10
    assert shared > 100  # most lists have candidates sharing a first code
    code = ("import json; from reranker.data.copy_warmup import straight_copy_lists; "
            "print(json.dumps(straight_copy_lists(20, seed=1)))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": h}).stdout for h in ("1", "2")}
    assert len(outs) == 1
    out = build_copy_warmup(tmp_path, straight=3, seed=1, out_path=tmp_path / "s.jsonl")
    assert [json.loads(x) for x in out.read_text().splitlines()] == straight_copy_lists(3, seed=1)
    with pytest.raises(ValueError, match="straight"):
        build_copy_warmup(tmp_path, straight=0)


def test_lookup_copy_lists_answer_each_asked_number_with_the_sid_listed_under_it(tmp_path):
    import re

    from reranker.data.copy_warmup import lookup_copy_lists

    recs = lookup_copy_lists(50, seed=3)
    assert recs == lookup_copy_lists(50, seed=3) and recs != lookup_copy_lists(50, seed=4)
    for r in recs:
        user = r["prompt_messages"][1]["content"]
        listed = dict(re.findall(r"^(\d+)\.(<\|sid_begin\|>.*?<\|sid_end\|>) cobought", user, re.M))
        asked = re.search(r"^Order: (.*)$", user, re.M).group(1).split()
        assert sorted(asked, key=lambda k: int(k[1:])) == [f"#{i}" for i in range(1, 11)]
        think, answer = r["assistant"].split("</think>\n", 1)
        lines = think.removeprefix("<think>\n").strip().split("\n")
        # every decision line is "#k.<the SID listed as k.>", in the asked order
        assert lines == [f"{k}.{listed[k[1:]]}" for k in asked]
        assert json.loads(answer)["ranking"] == [listed[k[1:]] for k in asked]
        assert list(parse_ranking(r["assistant"], list(listed.values())).permutation) == \
            [int(k[1:]) - 1 for k in asked]
    out = build_copy_warmup(tmp_path, lookup=4, seed=2, out_path=tmp_path / "l.jsonl")
    assert [json.loads(x) for x in out.read_text().splitlines()] == lookup_copy_lists(4, seed=2)
    with pytest.raises(ValueError, match="lookup"):
        build_copy_warmup(tmp_path, lookup=0)
    with pytest.raises(ValueError, match="give one"):
        build_copy_warmup(tmp_path, lookup=2, straight=2)


def test_scan_traced_copies_with_relabelled_dedup_codes(tmp_path):
    """--trace-style answers the real prompt with the rule scan (here candidate #4 has the most
    co-purchases); --relabel-last-code draws the dedup code too, within the data's last codebook."""
    import re

    sids = [f"<|sid_begin|><a_5><b_5><c_5><d_{i}><|sid_end|>" for i in range(10)]  # one prefix, ten dedup codes
    evidence = ["cobought 0/0; brand 0; category no"] * 10
    evidence[3] = "cobought 2/0; brand 0; category yes"
    user = ("History (oldest first, 1 of 1):\nh\nCandidates (retriever order).\n"
            + "\n".join(f"{i + 1}.{s} Cat, Brand; {e}" for i, (s, e) in enumerate(zip(sids, evidence)))
            + "\nRank all 10 candidates.")
    row = {"candidate_sids": sids, "assistant": "x",
           "prompt_messages": [{"role": "system", "content": "Re-rank."}, {"role": "user", "content": user}]}
    (tmp_path / "train.jsonl").write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
    (tmp_path / "sids.json").write_text(json.dumps({"format": "diffusion-gr2/semantic-ids/v1", "codes": {},
                                                    "meta": {"codebook_sizes": [256, 256, 256, 12]}}))
    plain = json.loads(build_copy_warmup(tmp_path, trace_style="scan_brand").read_text().splitlines()[0])
    assert plain["prompt_messages"] == row["prompt_messages"]
    assert plain["assistant"].startswith("<think>\nAfter the last items, newest first, then brand: #1 0/0 b0+")
    assert parse_ranking(plain["assistant"], sids).permutation == (3, 0, 1, 2, 4, 5, 6, 7, 8, 9)

    recs = [json.loads(x) for x in build_copy_warmup(tmp_path, trace_style="scan_brand", random_sids=True,
                                                      relabel_last_code=True, seed=5).read_text().splitlines()]
    for rec in recs:
        new = re.findall(r"\d+\.(<\|sid_begin\|>.*?<\|sid_end\|>)", rec["prompt_messages"][1]["content"])
        assert len(set(new)) == 10 and not set(new) & set(sids)
        assert parse_ranking(rec["assistant"], new).permutation == (3, 0, 1, 2, 4, 5, 6, 7, 8, 9)
        assert all(int(d) < 12 for d in re.findall(r"<d_(\d+)>", rec["assistant"]))
    dedup = [re.findall(r"\d+\.<\|sid_begin\|>.*?<d_(\d+)>", r["prompt_messages"][1]["content"]) for r in recs]
    assert len(dedup[0]) == 10 and dedup[0] != dedup[1] and dedup[0] != [str(i) for i in range(10)]  # drawn, not kept

    with pytest.raises(ValueError, match="relabel_last_code needs random_sids"):
        build_copy_warmup(tmp_path, relabel_last_code=True)
    with pytest.raises(ValueError, match="trace_style must be one of"):
        build_copy_warmup(tmp_path, trace_style="brief")
    (tmp_path / "sids.json").write_text("{}")
    with pytest.raises(ValueError, match="sids.json: cannot read meta.codebook_sizes"):
        build_copy_warmup(tmp_path, random_sids=True, relabel_last_code=True)


def _scan_row(evidence, order_line=True):
    sids = [f"<|sid_begin|><a_{i}><b_{i}><c_1><d_0><|sid_end|>" for i in range(len(evidence))]
    user = ("History (oldest first, 1 of 1):\nh\nCandidates (retriever order).\n"
            + "\n".join(f"{i + 1}.{s} Cat, Brand; {e}" for i, (s, e) in enumerate(zip(sids, evidence)))
            + ("\nRetriever order: " + json.dumps(sids) if order_line else "")
            + f"\nRank all {len(sids)} candidates.")
    return {"candidate_sids": sids, "assistant": "x",
            "prompt_messages": [{"role": "system", "content": "Re-rank."}, {"role": "user", "content": user}]}


def test_uniform_pick_spreads_the_scans_pick_over_every_position(tmp_path):
    """Real lists mostly pick #1; with uniform_pick the copies put the pick at every position about
    equally often, and each copy is still answered by the scan of its own (reordered) prompt."""
    import random
    import re

    from reranker.data.copy_warmup import uniform_pick_order

    rng = random.Random(0)
    keys = [(0,), (3,), (1,), (3,), (0,)]  # the pick: #2 (first of the largest); #4 ties it
    at = [uniform_pick_order(keys, rng) for _ in range(2000)]
    assert all(sorted(o) == list(range(5)) for o in at)
    firsts = [next(i for i, j in enumerate(o) if keys[j] == (3,)) for o in at]  # where the pick lands
    counts = [firsts.count(p) for p in range(5)]
    assert counts[4] == 0 and min(counts[:4]) > 400  # three others can go before it: positions 1-4, uniform
    assert uniform_pick_order([(1,)] * 3, rng)[0] in range(3)  # all tied: the pick is #1, whichever it is

    rows = [_scan_row(["cobought 0/0; brand 0; category no"] * 3 + ["cobought 2/0; brand 0; category yes"]
                      + ["cobought 0/0; brand 1; category no"] * 6) for _ in range(200)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plain = [json.loads(x) for x in build_copy_warmup(tmp_path, trace_style="scan_brand").read_text().splitlines()]
    assert {re.search(r"\n#(\d+)\.", r["assistant"]).group(1) for r in plain} == {"4"}
    recs = [json.loads(x) for x in build_copy_warmup(tmp_path, trace_style="scan_brand", uniform_pick=True,
                                                      seed=3).read_text().splitlines()]
    picks = []
    for rec in recs:
        user = rec["prompt_messages"][1]["content"]
        listed = re.findall(r"^\d+\.(<\|sid_begin\|>.*?<\|sid_end\|>)", user, re.M)
        assert sorted(listed) == sorted(rows[0]["candidate_sids"])
        assert json.loads(user.split("Retriever order: ", 1)[1].split("\n", 1)[0]) == listed
        k = int(re.search(r"\n#(\d+)\.", rec["assistant"]).group(1))
        assert listed[k - 1] == rows[0]["candidate_sids"][3]  # the decision still names the co-bought item
        assert parse_ranking(rec["assistant"], listed).permutation[0] == k - 1
        picks.append(k)
    assert len(set(picks)) == 10
    with pytest.raises(ValueError, match="uniform_pick needs trace_style"):
        build_copy_warmup(tmp_path, uniform_pick=True)
