"""The retrieval stage end to end: atomic data -> SASRec (RecBole) -> FAISS -> candidate lists.

Writes an artifacts directory:

    data/<name>/<name>.inter      validated, k-cored copy that RecBole reads
    sasrec/sasrec.safetensors     state dict of the main retriever (SASRec; no pickle)
    sasrec/train_info.json        its training seconds and settings (RecBole's Config is rebuilt from them)
    item_embeddings.npy, items.json
    index/items.faiss, index/items.json
    sequences.json                time-ordered sequences per user (raw ids)
    candidates/{train,valid,test}.jsonl
    folds/fold<k>/...             cross-fitted retrievers for the training-position lists
    metrics.json

Training-position lists are cross-fitted: a retriever's lists on positions it trained on hit the
target far more often than at test and teach a re-ranker to copy the retriever (DESIGN §3), so the
lists for users in fold k come from a SASRec that never saw those users.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from .atomic import find_atomic_file, load_interactions
from .files import atomic_write_text, write_jsonl
from .index import ItemIndex
from .metrics import ndcg_at, recall_at, target_ranks
from .sasrec import SasrecEncoder, train_sasrec, write_recbole_dataset
from .split import Example, filter_sequences, leave_one_out
from .synthetic import SyntheticConfig, write_synthetic

log = logging.getLogger(__name__)
HISTORY_KEEP = 50  # history items stored with each candidate list (most recent)


@dataclass
class RetrievalSettings:
    out: Path
    data_dir: Path | None = None  # None: the embedded synthetic generator
    synthetic: dict = field(default_factory=dict)
    user_k: int = 5
    item_k: int = 5
    seed: int = 0
    n_candidates: int = 10
    crossfit_folds: int = 2
    index: str = "flat"
    sasrec: dict = field(default_factory=dict)
    fold_sasrec: dict = field(default_factory=dict)  # overrides for the fold retrievers
    agreement_users: int = 0  # 0: every test user


def _records(examples: list[Example], seqs, items, scores, fold=None):
    out = []
    for ex, cands, sc in zip(examples, items, scores):
        s = seqs[ex.user]
        rec = {"user": ex.user, "position": ex.position, "split": ex.split,
               "history": s[max(0, ex.position - HISTORY_KEEP):ex.position], "history_len": ex.position,
               "target": s[ex.position], "candidates": cands, "scores": [round(x, 6) for x in sc]}
        if fold is not None:
            rec["fold"] = fold
        out.append(rec)
    return out


def lists_for(encoder: SasrecEncoder, index: ItemIndex, examples: list[Example], seqs, n: int,
              desc: str, allowed=None, chunk: int = 4096):
    """Candidate lists (history excluded) for examples; returns (items, scores)."""
    all_items, all_scores = [], []
    for b in tqdm(range(0, len(examples), chunk), desc=desc, unit="chunk", leave=False):
        exs = examples[b:b + chunk]
        prefixes = [seqs[e.user][:e.position] for e in exs]
        q = encoder.encode(prefixes)
        it, sc = index.top_n_excluding(q, [set(p) for p in prefixes], n, allowed=allowed)
        all_items += it
        all_scores += sc
    return all_items, all_scores


def hit_rate(items, examples, seqs) -> float:
    targets = [seqs[e.user][e.position] for e in examples]
    return recall_at(target_ranks(items, targets), len(items[0]) if items else 1)


def recbole_agreement(run, encoder: SasrecEncoder, test_items: dict[str, list[str]], seqs, n: int,
                      max_users: int = 0) -> float:
    """Share of test users whose FAISS top-n equals RecBole's full-sort top-n, history masked."""
    ds = run.test_data.dataset
    uid_tokens = ds.field2id_token["user_id"]
    id_tokens = encoder.model.item_embedding.weight.new_zeros(0)  # device anchor
    item_tokens = ds.field2id_token["item_id"]
    same = total = 0
    with torch.no_grad():
        for batch in run.test_data:
            interaction = batch[0].to(id_tokens.device)
            scores = encoder.model.full_sort_predict(interaction).cpu()
            scores[:, 0] = -np.inf
            users = [str(uid_tokens[u]) for u in interaction["user_id"].cpu().numpy()]
            for r, u in enumerate(users):
                hist = [encoder.token_to_id[i] for i in seqs[u][:-1] if i in encoder.token_to_id]
                scores[r, hist] = -np.inf
            top = torch.topk(scores, n, dim=1).indices.numpy()
            for r, u in enumerate(users):
                total += 1
                same += [str(item_tokens[j]) for j in top[r]] == test_items[u]
            if max_users and total >= max_users:
                break
    return same / max(total, 1)


def hnsw_recall(emb: np.ndarray, item_ids: list[str], queries: np.ndarray, k: int = 10) -> float:
    """Mean overlap of HNSW's top-k with exact inner-product top-k (default HNSW settings)."""
    exact = ItemIndex.build(emb, item_ids, "flat").search(queries, k)[1]
    approx = ItemIndex.build(emb, item_ids, "hnsw").search(queries, k)[1]
    return float(np.mean([len(set(a) & set(b)) / k for a, b in zip(exact, approx)]))


def remeasure_hnsw(artifacts_dir, encoder: SasrecEncoder) -> float:
    """HNSW recall@10 of an existing artifacts dir's test queries (after an index change)."""
    d = Path(artifacts_dir)
    seqs = json.loads((d / "sequences.json").read_text())
    emb = np.load(d / "item_embeddings.npy")
    item_ids = json.loads((d / "items.json").read_text())
    return hnsw_recall(emb, item_ids, encoder.encode([s[:-1] for s in seqs.values()]))


def run_retrieval(cfg: RetrievalSettings) -> dict:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    t_start = time.time()
    data_dir = cfg.data_dir
    if data_dir is None:
        data_dir = write_synthetic(out / "source", SyntheticConfig(**{"seed": cfg.seed, **cfg.synthetic}))
    inter_path = find_atomic_file(data_dir, "inter")
    name = inter_path.stem
    inter = load_interactions(inter_path)
    seq_obj = filter_sequences(inter, cfg.user_k, cfg.item_k)
    seqs = seq_obj.by_user
    split = leave_one_out(seqs)
    log.info("%s: %d users, %d items, %d interactions after %d/%d-core", name, len(seqs),
             len(seq_obj.items), seq_obj.n_interactions, cfg.user_k, cfg.item_k)
    atomic_write_text(out / "sequences.json", json.dumps(seqs, separators=(",", ":")))

    # 1. The main retriever, trained on every user's training part.
    write_recbole_dataset(out / "data", name, seqs)
    run = train_sasrec(out / "data", name, out / "sasrec", cfg.sasrec, cfg.seed)
    enc = SasrecEncoder(run.model, run.dataset)
    item_ids = seq_obj.items
    emb, known = enc.item_embeddings(item_ids)
    np.save(out / "item_embeddings.npy", emb)
    atomic_write_text(out / "items.json", json.dumps(item_ids))
    t_index = time.time()
    index = ItemIndex.build(emb, item_ids, cfg.index)
    index.save(out / "index")
    index_seconds = time.time() - t_index

    n = cfg.n_candidates
    res: dict = {"dataset": name, "users": len(seqs), "items": len(item_ids),
                 "interactions": seq_obj.n_interactions, "n_candidates": n,
                 "train_seconds": run.train_seconds, "index_seconds": index_seconds,
                 "recall@10": run.test_result.get("recall@10"), "ndcg@10": run.test_result.get("ndcg@10")}
    # 2. Test and validation lists (history masked), with deep lists for the masked metrics.
    deep = max(50, n)
    lists = {}
    for sp in ("test", "valid"):
        exs = split[sp]
        items, scores = lists_for(enc, index, exs, seqs, deep, f"{sp} lists")
        targets = [seqs[e.user][e.position] for e in exs]
        ranks = target_ranks(items, targets)
        if sp == "test":
            res.update({"recall@10_masked": recall_at(ranks, 10), "ndcg@10_masked": ndcg_at(ranks, 10),
                        "recall@50_masked": recall_at(ranks, 50), "ndcg@50_masked": ndcg_at(ranks, 50),
                        "test_users_target_in_top10": int(((ranks >= 0) & (ranks < 10)).sum()),
                        f"test_users_target_in_top{n}": int(((ranks >= 0) & (ranks < n)).sum())})
        res[f"{sp}_hit_rate"] = recall_at(ranks, n)
        lists[sp] = (exs, [i[:n] for i in items], [s[:n] for s in scores])
        write_jsonl(out / "candidates" / f"{sp}.jsonl", _records(exs, seqs, *lists[sp][1:]), ensure_ascii=True)

    # 3. FAISS exact vs RecBole full-sort (history masked), and HNSW recall against exact.
    test_top = {e.user: it[:10] for e, it in zip(lists["test"][0], lists["test"][1])}
    if cfg.index == "flat" and n >= 10:
        res["faiss_recbole_top10_agreement"] = recbole_agreement(run, enc, test_top, seqs, 10, cfg.agreement_users)
    q = enc.encode([seqs[e.user][:e.position] for e in split["test"]])
    res["hnsw_recall@10"] = hnsw_recall(emb, item_ids, q)

    # 4. Training positions: in-sample (main retriever, reported only) and cross-fitted (written).
    train_ex = split["train"]
    in_items, _ = lists_for(enc, index, train_ex, seqs, n, "in-sample train lists")
    res["train_hit_rate_in_sample"] = hit_rate(in_items, train_ex, seqs)
    res["train_positions"] = len(train_ex)
    rows, fold_info = [], []
    if cfg.crossfit_folds >= 2:
        users = sorted(seqs)
        perm = np.random.default_rng(cfg.seed).permutation(len(users))
        fold_of = {users[p]: k % cfg.crossfit_folds for k, p in enumerate(perm)}
        for k in range(cfg.crossfit_folds):
            fdir = out / "folds" / f"fold{k}"
            others = {u: s for u, s in seqs.items() if fold_of[u] != k}
            write_recbole_dataset(fdir / "data", name, others)
            frun = train_sasrec(fdir / "data", name, fdir / "sasrec", {**cfg.sasrec, **cfg.fold_sasrec},
                                cfg.seed + 1 + k, evaluate=False)
            fenc = SasrecEncoder(frun.model, frun.dataset)
            femb, fknown = fenc.item_embeddings(item_ids)
            findex = ItemIndex.build(femb, item_ids, "flat")
            exs = [e for e in train_ex if fold_of[e.user] == k]
            items, scores = lists_for(fenc, findex, exs, seqs, n, f"fold {k} train lists", allowed=fknown)
            rows += _records(exs, seqs, items, scores, fold=k)
            fold_info.append({"fold": k, "users": len(seqs) - len(others), "positions": len(exs),
                              "hit_rate": hit_rate(items, exs, seqs), "train_seconds": frun.train_seconds,
                              "items_unknown_to_fold_model": int((~fknown).sum())})
            res["train_seconds"] += frun.train_seconds
        ranks = target_ranks([r["candidates"] for r in rows], [r["target"] for r in rows])
        res["train_hit_rate_crossfit"] = recall_at(ranks, n)
        res["train_examples_target_in_topN_crossfit"] = int(((ranks >= 0) & (ranks < n)).sum())
    else:
        log.warning("crossfit_folds < 2: training lists come from the in-sample retriever")
        rows = _records(train_ex, seqs, in_items, [[0.0] * n for _ in in_items])
        res["train_hit_rate_crossfit"] = None
    res["folds"] = fold_info
    rows.sort(key=lambda r: (r["user"], r["position"]))
    write_jsonl(out / "candidates" / "train.jsonl", rows, ensure_ascii=True)
    res["wall_seconds"] = time.time() - t_start
    atomic_write_text(out / "metrics.json", json.dumps(res, indent=2))
    return res
