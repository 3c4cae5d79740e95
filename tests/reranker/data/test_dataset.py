"""The re-ranking data builder on a tiny real retrieval run: split rules, determinism, the prompt
budget, and leakage (no teacher, scorer or tokenizer reads a held-out target; no test-time
evidence counts the user's own interactions)."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from candidate_gen.split import train_sequences
from reranker.data.dataset import build_rerank_data, load_split, read_jsonl, selection_users
from reranker.data.evidence import CoPurchaseCounts
from reranker.text.answer import parse_ranking
from reranker.text.tokenizer import load_tokenizer

torch.set_num_threads(1)
N_SEL = 100
BUILD = dict(n_selection_users=N_SEL, seed=0, tokenizer_vocab=600)


@pytest.fixture(scope="module")
def retrieval(tmp_path_factory):
    """A tiny synthetic catalog through the real retrieval stage (~5-15 s)."""
    from candidate_gen.retrieve import RetrievalSettings, run_retrieval
    from candidate_gen.synthetic import SyntheticConfig, write_synthetic

    tmp = tmp_path_factory.mktemp("rerank_retrieval")
    data_dir = write_synthetic(tmp, SyntheticConfig(n_users=300, seed=3), name="tiny")
    run_retrieval(RetrievalSettings(out=tmp / "r", data_dir=data_dir, sasrec={
        "epochs": 2, "hidden_size": 16, "inner_size": 32, "n_layers": 1, "n_heads": 1,
        "train_batch_size": 256, "MAX_ITEM_LIST_LENGTH": 20}))
    return tmp / "r", data_dir / "tiny.item"


@pytest.fixture(scope="module")
def built(retrieval, tmp_path_factory):
    r, items = retrieval
    out = tmp_path_factory.mktemp("rerank_data") / "data"
    report = build_rerank_data(r, items, out, **BUILD)
    return out, report


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_splits_follow_the_protocol(retrieval, built):
    r, _ = retrieval
    out, report = built
    seqs = json.loads((r / "sequences.json").read_text())
    selected = selection_users(seqs, N_SEL, 0)
    train, valid, test = (load_split(out, s) for s in ("train", "valid", "test"))
    assert train and valid and test
    for row in train + valid + test:
        assert row["candidates"][row["target_index"]] == row["target"]
        assert row["target"] == seqs[row["user"]][row["position"]]
        assert row["candidate_sids"] and len(row["candidate_sids"]) == len(row["candidates"])
    n = {u: len(s) for u, s in seqs.items()}
    for row in train:
        assert row["position"] <= n[row["user"]] - 2
        if row["position"] == n[row["user"]] - 2:  # a validation position: never a selection user's
            assert row["user"] not in selected and row["source"] == "valid"
        else:
            assert row["source"] == "crossfit"
    assert all(row["user"] in selected and row["position"] == n[row["user"]] - 2 for row in valid)
    assert all(row["position"] == n[row["user"]] - 1 and row["teacher"] is None and row["assistant"] is None
               for row in test)
    test_src = read_jsonl(r / "candidates" / "test.jsonl")
    assert len(test) == sum(x["target"] in x["candidates"] for x in test_src)
    assert report["splits"]["train"]["examples"] == len(train) and report["splits"]["test"]["examples"] == len(test)
    assert report["splits"]["train"]["from_valid"] > 0 and report["splits"]["train"]["from_crossfit"] > 0


def test_assistant_answers_parse_and_put_target_first(built):
    out, report = built
    for row in load_split(out, "train") + load_split(out, "valid"):
        res = parse_ranking(row["assistant"], row["candidate_sids"])
        assert res.ok and list(res.permutation) == row["ranking"]
        assert row["ranking"][0] == row["target_index"]
        assert row["assistant"].startswith("<think>\n" + row["reasoning"])
        assert row["teacher"]["accepted"] != row["teacher"]["fallback"]
    st = report["teacher_stats"]["train"]
    assert st["accepted"] + st["fallback"] == st["examples"] == report["splits"]["train"]["examples"]


def test_prompts_fit_the_cpu_budget_and_report_is_complete(built):
    out, report = built
    tok = load_tokenizer(out / "tokenizer")
    for split in ("train", "valid", "test"):
        for row in load_split(out, split)[:40]:
            text = tok.apply_chat_template(row["prompt_messages"], tokenize=False, add_generation_prompt=True)
            assert len(tok(text, add_special_tokens=False)["input_ids"]) <= 512
    assert report["max_prompt_len"] <= 512
    for key in ("prompt", "reasoning", "answer"):
        assert "mean" in json.dumps(report["tokens"][key])
    assert report["sids"]["unique_fraction"] == 1.0 and "collision_rate_after_3_levels" in report["sids"]
    assert set(report["target_in_topN"]) >= {"train_crossfit", "valid_all_users", "test"}
    info = json.loads((out / "build_info.json").read_text())
    for key in ("retrieval_dir", "items_path"):
        assert not Path(info[key]).is_absolute()
        assert (out / info[key]).exists()
    for name, data in _files(out).items():  # no absolute path of this machine in any output
        assert str(out.parent).encode() not in data, name


def test_build_is_deterministic(retrieval, built, tmp_path):
    r, items = retrieval
    out, _ = built
    build_rerank_data(r, items, tmp_path / "again", **BUILD)
    a, b = _files(out), _files(tmp_path / "again")
    assert a.keys() == b.keys()
    assert [k for k in a if a[k] != b[k]] == []


def _perturb_heldout_targets(src: Path, dst: Path, selected: set[str]) -> None:
    """Copy of the retrieval artifacts where every test target and every selection user's
    validation target is a different item (in the candidate files and in sequences.json)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("folds", "sasrec", "data"))
    seqs = json.loads((src / "sequences.json").read_text())
    for split in ("test", "valid"):
        rows = read_jsonl(src / "candidates" / f"{split}.jsonl")
        for row in rows:
            if split == "valid" and row["user"] not in selected:
                continue
            # Alternate between another candidate (stays a hit) and an item outside the list (a miss).
            k = len(row["user"]) + row["position"]
            new = row["candidates"][-1] if k % 2 else row["history"][0]
            if new == row["target"]:
                new = row["candidates"][0]
            row["target"] = new
            seqs[row["user"]][row["position"]] = new
        (dst / "candidates" / f"{split}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    (dst / "sequences.json").write_text(json.dumps(seqs))


def test_no_heldout_target_reaches_training_data(retrieval, built, tmp_path):
    """Changing every test target and every selection user's validation target leaves the training
    data, the fitted scorers and the tokenizer byte-identical."""
    r, items = retrieval
    out, _ = built
    seqs = json.loads((r / "sequences.json").read_text())
    perturbed = tmp_path / "retrieval"
    _perturb_heldout_targets(r, perturbed, selection_users(seqs, N_SEL, 0))
    assert train_sequences(json.loads((perturbed / "sequences.json").read_text())) == train_sequences(seqs)
    build_rerank_data(perturbed, items, tmp_path / "data", **BUILD)
    a, b = _files(out), _files(tmp_path / "data")
    same = [k for k in a if k == "train.jsonl" or k == "sids.json" or k.startswith(("scorer", "tokenizer"))]
    assert "scorer/model.txt" in same and "tokenizer/tokenizer.json" in same
    assert [k for k in same if a[k] != b[k]] == []
    assert a["test.jsonl"] != b["test.jsonl"]  # the perturbation did reach the held-out split


def test_test_evidence_excludes_the_users_own_interactions(retrieval, built):
    """The prompt's co-purchase numbers for a test user equal counts fitted without that user."""
    r, _ = retrieval
    out, _ = built
    train = train_sequences(json.loads((r / "sequences.json").read_text()))
    line = re.compile(r"^(\d+)\.\S+ .*cobought ([\d/]+);", re.M)
    checked = 0
    for row in load_split(out, "test")[:12]:
        without = CoPurchaseCounts.fit({u: s for u, s in train.items() if u != row["user"]})
        recent = list(reversed(row["history"][-3:]))
        for m in line.finditer(row["prompt_messages"][1]["content"]):
            cand = row["candidates"][int(m.group(1)) - 1]
            shown = [int(c) for c in m.group(2).split("/")]
            assert shown == [without.count(h, cand) for h in recent]
            checked += 1
    assert checked >= 60


def test_jsonl_teacher_through_the_builder(retrieval, built, tmp_path):
    r, items = retrieval
    out, _ = built
    train = load_split(out, "train")
    lines = [{"user": x["user"], "position": x["position"], "reasoning": "external " + x["user"],
              "ranking": [x["candidates"][i] for i in x["ranking"]]} for x in train[:10]]
    path = tmp_path / "traces.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    rep = build_rerank_data(r, items, tmp_path / "data", teacher="jsonl", teacher_options={"path": str(path)},
                            **{**BUILD, "max_train_examples": 40})
    details = rep["teacher_stats"]["details"]
    assert details["lines"] == 10
    rows = load_split(tmp_path / "data", "train")
    imported = [x for x in rows if x["reasoning"].startswith("external ")]
    assert all(x["teacher"]["accepted"] and x["ranking"][0] == x["target_index"] for x in imported)
    assert len(rows) == 40 and rep["teacher_stats"]["train"]["accepted"] == len(imported)
    assert rep["teacher_stats"]["train"]["fallback"] == 40 - len(imported)


def test_config_errors_name_the_bad_key():
    from reranker.data.dataset import make_teacher, scorer_settings

    with pytest.raises(ValueError, match=r"scorer_config: unknown key\(s\) \['bogus'\]"):
        scorer_settings({"bogus": 1}, 0)
    assert scorer_settings({"exclude_features": ["retriever_score"]}, 3).exclude_features == ("retriever_score",)
    with pytest.raises(ValueError, match="unknown teacher 'gpt'"):
        make_teacher("gpt", None, scorer=None, sids=None, meta=None, writer=None, seed=0)
    with pytest.raises(ValueError, match=r"teacher_options for 'rule': unknown key\(s\) \['temp'\]"):
        make_teacher("rule", {"temp": 1}, scorer=None, sids=None, meta=None, writer=None, seed=0)
    with pytest.raises(ValueError, match="needs teacher_options=\\{'path'"):
        make_teacher("jsonl", {}, scorer=None, sids=None, meta=None, writer=None, seed=0)


def test_serving_engine_renders_the_training_prompts(built, tmp_path):
    """No train/serve skew: RerankEngine.load rebuilds the evidence and renders the builder's prompts."""
    from reranker.engine import RerankEngine, RerankRequest
    from reranker.training.init_model import init_model

    out, _ = built
    model_dir = init_model(out, tmp_path / "m", size="tiny")
    engine = RerankEngine.load(model_dir, out)
    rows = load_split(out, "test")[:40] + load_split(out, "valid")[:20]
    for r in rows:
        ids = engine.prompt_ids(RerankRequest(r["history"], r["candidates"], r["scores"], r["user"]))
        assert ids == engine._encode(r["prompt_messages"]), r["user"]


def test_retrace_keeps_rankings_and_tokenizer_and_matches_a_brief_build(retrieval, built, tmp_path):
    """`dgr2 data retrace --style brief` rewrites only the traces, and writes what a build with
    trace_style="brief" writes (its reason is read back from the full trace)."""
    from reranker.data.retrace import retrace_data

    r, items = retrieval
    out, _ = built
    retrace_data(out, tmp_path / "brief", progress=False)
    src, new = (load_split(out, "train") + load_split(out, "valid"),
                load_split(tmp_path / "brief", "train") + load_split(tmp_path / "brief", "valid"))
    assert len(src) == len(new) > 0
    for a, b in zip(src, new):
        assert (a["prompt_messages"], a["ranking"], a["candidate_sids"]) == (b["prompt_messages"], b["ranking"], b["candidate_sids"])
        first = b["ranking"][0]
        assert b["reasoning"].startswith(f"#{first + 1}.{b['candidate_sids'][first]} first (")
        assert len(b["reasoning"]) < len(a["reasoning"])
        assert list(parse_ranking(b["assistant"], b["candidate_sids"]).permutation) == b["ranking"]
    assert load_split(tmp_path / "brief", "test") == load_split(out, "test")
    assert (tmp_path / "brief" / "tokenizer" / "tokenizer.json").read_bytes() == (out / "tokenizer" / "tokenizer.json").read_bytes()
    info = json.loads((tmp_path / "brief" / "build_info.json").read_text())
    assert (tmp_path / "brief" / info["retrieval_dir"]).resolve() == Path(r).resolve()

    build_rerank_data(r, items, tmp_path / "built_brief", trace_style="brief", **BUILD)
    fresh = load_split(tmp_path / "built_brief", "train") + load_split(tmp_path / "built_brief", "valid")
    assert [x["reasoning"] for x in fresh] == [x["reasoning"] for x in new]


def test_retrace_errors_name_the_line(built, tmp_path):
    from reranker.data.retrace import retrace_data

    out, _ = built
    src = tmp_path / "src"
    src.mkdir()
    rows = load_split(out, "train")[:3]
    rows[1] = {**rows[1], "reasoning": "an external LLM's own words"}
    (src / "train.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    with pytest.raises(ValueError, match=r"train.jsonl:2: .*rule teacher"):
        retrace_data(src, tmp_path / "dst", progress=False)
    with pytest.raises(ValueError, match="must differ"):
        retrace_data(out, out, progress=False)


def test_build_can_reuse_a_tokenizer_and_checks_it(retrieval, built, tmp_path):
    """tokenizer_from: new data for an already trained model keeps its token ids (the prompts are
    then those of the source build); a tokenizer without this build's SID codes is refused."""
    r, items = retrieval
    out, _ = built
    build_rerank_data(r, items, tmp_path / "again", tokenizer_from=out / "tokenizer", trace_style="brief",
                      teacher_options={"temperature": 0, "rejection": False}, **BUILD)
    assert (tmp_path / "again" / "tokenizer" / "tokenizer.json").read_bytes() == (out / "tokenizer" / "tokenizer.json").read_bytes()
    assert [x["prompt_messages"] for x in load_split(tmp_path / "again", "train")] == \
        [x["prompt_messages"] for x in load_split(out, "train")]
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        build_rerank_data(r, items, tmp_path / "x", tokenizer_from=tmp_path, **BUILD)


def test_scan_retrace_picks_the_copurchase_baselines_head(retrieval, built, tmp_path):
    """`dgr2 data retrace --style scan`: the label is the co-purchase-after-last rule's head, read
    back from the prompt; checked against the baseline computed from the training counts."""
    from candidate_gen.atomic import load_items
    from reranker.data.dataset import load_retrieval
    from reranker.data.evidence import item_meta_lookup
    from reranker.data.features import FEATURE_NAMES, FeatureContext
    from reranker.data.retrace import retrace_data, rule_scan
    from reranker.eval.baselines import baseline_permutations

    r, items = retrieval
    out, _ = built
    retrace_data(out, tmp_path / "scan", style="scan", progress=False)
    rows = load_split(tmp_path / "scan", "train") + load_split(tmp_path / "scan", "valid")
    seqs, _ = load_retrieval(r)
    ctx = FeatureContext(train_sequences(seqs), item_meta_lookup(load_items(items).to_frame()))
    heads = [p[0] for p in baseline_permutations(rows, ctx, None)["copurchase_last"]]
    assert [x["ranking"][0] for x in rows] == heads
    assert any(h != 0 for h in heads)  # the tiny catalog has co-purchase evidence to follow
    for x in rows:
        assert x["ranking"][1:] == sorted(x["ranking"][1:])
        assert x["reasoning"].startswith("After the last item: #1 ")
        assert list(parse_ranking(x["assistant"], x["candidate_sids"]).permutation) == x["ranking"]
    assert load_split(tmp_path / "scan", "test") == load_split(out, "test")

    # scan_recent: the head of the (after last, second-to-last, third-to-last) lexicographic order
    retrace_data(out, tmp_path / "scan_recent", style="scan_recent", progress=False)
    rows = load_split(tmp_path / "scan_recent", "train") + load_split(tmp_path / "scan_recent", "valid")
    X, groups = ctx.featurize(rows, desc="features")
    cols = [FEATURE_NAMES.index(f"copurchase_last{i}") for i in (1, 2, 3)]
    at = 0
    for x, n in zip(rows, groups):
        keys = [tuple(X[at + j, cols]) for j in range(n)]
        at += n
        assert x["ranking"][0] == max(range(n), key=lambda j: (keys[j], -j))
        assert x["reasoning"].startswith("After the last items, newest first: #1 ")
    assert sum(x["ranking"][0] != h for x, h in zip(rows, heads)) > 0  # it differs from the last-item scan somewhere
    recent_heads = [x["ranking"][0] for x in rows]

    # scan_brand: the same order with the same-brand history count compared last
    retrace_data(out, tmp_path / "scan_brand", style="scan_brand", progress=False)
    rows = load_split(tmp_path / "scan_brand", "train") + load_split(tmp_path / "scan_brand", "valid")
    brand = FEATURE_NAMES.index("brand_match_count")
    at = 0
    for x, n in zip(rows, groups):
        keys = [tuple(X[at + j, cols]) + (X[at + j, brand],) for j in range(n)]
        at += n
        assert x["ranking"][0] == max(range(n), key=lambda j: (keys[j], -j))
        assert x["reasoning"].startswith("After the last items, newest first, then brand: #1 ")
        assert list(parse_ranking(x["assistant"], x["candidate_sids"]).permutation) == x["ranking"]
    assert sum(x["ranking"][0] != h for x, h in zip(rows, recent_heads)) > 0
    with pytest.raises(ValueError, match="rule_scan writes one of"):
        rule_scan(rows[0]["prompt_messages"][1]["content"], rows[0]["candidate_sids"], "brief")
    # ...which is the head of the copurchase_recent_brand baseline
    assert [p[0] for p in baseline_permutations(rows, ctx, None)["copurchase_recent_brand"]] == \
        [x["ranking"][0] for x in rows]

    # a build with trace_style="scan" writes the same rows (its tokenizer is trained on brief traces)
    report = build_rerank_data(r, items, tmp_path / "built_scan", trace_style="scan", **BUILD)
    fresh = load_split(tmp_path / "built_scan", "train") + load_split(tmp_path / "built_scan", "valid")
    scanned = load_split(tmp_path / "scan", "train") + load_split(tmp_path / "scan", "valid")
    assert [(x["ranking"], x["reasoning"]) for x in fresh] == [(x["ranking"], x["reasoning"]) for x in scanned]
    assert report["trace_style"] == "scan" and report["tokens"]["reasoning"]["mean"] > 30
    with pytest.raises(ValueError, match="retrace writes one of"):
        retrace_data(out, tmp_path / "x", style="long", progress=False)


def test_a_catalog_without_any_item_text_builds_and_serves_the_same_prompts(retrieval, tmp_path, caplog):
    """An .item file of bare ids: every content embedding is zero, so the semantic IDs come from the
    retriever's item vectors (k-means on zeros put the whole catalog under one prefix: SIDs that say
    nothing, and an error beyond 256 items);
    names and brand/category evidence are left out of the prompts, the same way at serving time."""
    import logging

    from candidate_gen.atomic import load_items, write_items
    from reranker.engine import RerankEngine, RerankRequest
    from reranker.text.prompt import parse_candidate_evidence
    from reranker.text.sid import SemanticIds
    from reranker.training.init_model import init_model

    r, items = retrieval
    bare = tmp_path / "bare.item"
    write_items(bare, load_items(items), columns=())
    assert bare.read_text().splitlines()[0] == "item_id:token"
    out = tmp_path / "data"
    with caplog.at_level(logging.WARNING, logger="reranker.data.dataset"):
        report = build_rerank_data(r, bare, out, **BUILD)
    assert report["absent_item_fields"] == ["title", "brand", "categories"]
    assert report["sids"]["embedding_method"] == "retriever" and report["sids"]["unique_fraction"] == 1.0
    notes = [rec.getMessage() for rec in caplog.records]
    assert len(notes) == 2 and "no item has a title / brand / categories" in notes[0] and "retriever" in notes[1]
    sids = SemanticIds.load(out / "sids.json")
    row = load_split(out, "test")[0]
    lines = row["prompt_messages"][1]["content"].split("\n")
    shown = row["history"][-8:]
    assert lines[1:len(shown) + 1] == [sids.sid_string(h) for h in shown]
    last = lines[-3]  # the last candidate line, before the retriever-order line and "Rank all"
    assert last.startswith(f"{len(row['candidates'])}.{sids.sid_string(row['candidates'][-1])}; cobought ")
    assert "brand" not in last and "category" not in last
    assert len(parse_candidate_evidence("\n".join(lines), len(row["candidates"]))) == len(row["candidates"])
    engine = RerankEngine.load(init_model(out, tmp_path / "m", size="tiny"), out)
    for r_ in load_split(out, "test")[:20]:
        ids = engine.prompt_ids(RerankRequest(r_["history"], r_["candidates"], r_["scores"], r_["user"]))
        assert ids == engine._encode(r_["prompt_messages"]), r_["user"]
