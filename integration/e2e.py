"""`dgr2 e2e`: SASRec alone vs SASRec + re-rankers, scored by RecBole's own `Trainer.evaluate`.

Every row uses the retrieval stage's own RecBole dataset and its trained SASRec checkpoint (nothing
is retrained), the same RecBole config (full sort, leave-one-out test split, Recall@10 / NDCG@10)
and the same test users; only the re-ranker plugged into `SASRecReranked` changes. History items are
masked in every row (see integration/recbole_model.py).

Where the run's re-ranking data was built with a pre-ranker (`candidate_order: scorer`), a row
"SASRec + pre-ranker" comes second (with no --reranker too): the learned scorer's order alone, which
every language-model row's prompt lists and falls back to, so what the model adds to it is a row apart.

Writes docs/results/recbole-e2e-<name>.json (schema: integration/bench.py `recbole_section`).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from reranker.decoding import DECODERS
from reranker.eval.metrics import paired_bootstrap, per_user

from .config import retrieval_settings, section


PRERANKER_ROW = "SASRec + pre-ranker"


def parse_reranker(spec: str) -> tuple[str, str, str]:
    """'NAME=MODEL_DIR:DECODER' -> (name, model_dir, decoder). The directory may contain ':' and '='
    (the name ends at the first '=', the decoder starts after the last ':')."""
    name, eq, rest = spec.partition("=")
    model_dir, colon, decoder = rest.rpartition(":")
    if not (eq and colon and name.strip() and model_dir.strip()) or decoder not in DECODERS:
        raise ValueError(f"--reranker {spec!r}: expected NAME=MODEL_DIR:DECODER with DECODER one of "
                         f"{'|'.join(DECODERS)}, e.g. 'AR GR2=artifacts/beauty/models/ar:ar'")
    return name.strip(), model_dir, decoder


def sample_users(user_ids, n_users: int | None, seed: int) -> np.ndarray:
    """A seeded random sample of `n_users` of `user_ids` (sorted, so the sample depends only on the
    set and the seed); None or n >= the number of users: all of them."""
    users = np.unique(np.asarray(user_ids))
    if n_users is None or n_users >= len(users):
        return users
    if n_users < 1:
        raise ValueError(f"--users must be >= 1, got {n_users}")
    return np.sort(np.random.default_rng(seed).choice(users, size=n_users, replace=False))


def _retrieval_artifacts(cfg: dict, data_override) -> tuple[Path, str, Path, dict]:
    """(RecBole data root, dataset name, SASRec checkpoint, SASRec params) of the config's retrieval."""
    rs = retrieval_settings(cfg, data_override, None)
    out = Path(rs.out)
    ckpt = out / "sasrec" / "sasrec.safetensors"  # loaded by SASRecReranked, without unpickling
    metrics = out / "metrics.json"
    if not ckpt.exists() and ckpt.with_name("sasrec.pth").exists():
        raise FileNotFoundError(f"{ckpt}: missing; {ckpt.with_name('sasrec.pth')} is an old pickled checkpoint, "
                                f"which is not loaded: re-run `dgr2 retrieve --config "
                                f"configs/{cfg.get('name', '<name>')}.yaml`")
    for p in (ckpt, metrics):
        if not p.exists():
            raise FileNotFoundError(f"{p}: missing retrieval artifacts; make them with "
                                    f"`dgr2 retrieve --config configs/{cfg.get('name', '<name>')}.yaml`")
    name = json.loads(metrics.read_text())["dataset"]
    return out / "data", name, ckpt, rs.sasrec


def run_e2e(cfg: dict, rerankers: list[tuple[str, str, str]], n_users: int | None, seed: int, batch_size: int,
            tau: float | None = None, data_override=None, progress=True, commit_rule: str | None = None,
            hold_eos: bool | None = None, workers: int | None = None) -> dict:
    """Evaluate SASRec alone, then SASRec + each re-ranker (name, model dir, "ar" | "diffusion"),
    with RecBole's `Trainer.evaluate` on the retrieval stage's dataset and checkpoint.

    `n_users` evaluates a seeded random sample of the test users instead of all of them (an LM
    re-ranker over every Beauty test user costs hours on a CPU). The RecBole dataset is restricted to
    the sampled users' interactions before the dataloaders are built. SASRec's prediction for a user
    depends only on that user's own sequence (and the masking only on that user's own history), and
    the item catalogue is unchanged, so this is exactly the full evaluation restricted to those users.
    Every row uses the same sample. tau, commit_rule, hold_eos (diffusion rows): None is each
    model's recorded setting (reranker.decoding); a row records what it decoded with. workers:
    batches decoded at once (None: the config's eval.workers, else 1).
    """
    from tqdm.auto import tqdm

    from candidate_gen.recbole_compat import recbole_compat
    from candidate_gen.sasrec import recbole_config_dict

    from reranker.data.preranker import preranker_dir
    from reranker.engine import PreRankerOrder

    from .recbole_model import SASRecReranked

    data_root, name, ckpt, sasrec_params = _retrieval_artifacts(cfg, data_override)
    rerank_data = Path(cfg["out"]) / "rerank_data"
    for rname, model_dir, decoder in rerankers:
        if decoder not in DECODERS:
            raise ValueError(f"--reranker {rname!r}: decoder must be one of {DECODERS}, got {decoder!r}")
        if rname == PRERANKER_ROW:
            raise ValueError(f"--reranker {rname!r}: that name is the pre-ranker's own row; name the model otherwise")
        if not Path(model_dir).is_dir():
            raise FileNotFoundError(f"--reranker {rname!r}: model directory {model_dir} not found")
    if rerankers and not (rerank_data / "build_info.json").exists():
        raise FileNotFoundError(f"{rerank_data / 'build_info.json'}: missing re-ranking data; make it with "
                                f"`dgr2 data build --config configs/{cfg.get('name', '<name>')}.yaml`")
    ev = section(cfg, "eval")
    workers = int(ev.get("workers", 1)) if workers is None else workers
    run_dir = Path(cfg["out"]) / "e2e"

    with recbole_compat(tensorboard_dir=str(run_dir / "tensorboard")):
        from recbole.config import Config
        from recbole.data import create_dataset, data_preparation
        from recbole.trainer import Trainer
        from recbole.utils import init_seed

        settings = recbole_config_dict(data_root, run_dir, sasrec_params, int(cfg.get("seed", 0)))
        settings.update(sasrec_checkpoint=str(ckpt), mask_history=True, rerank_model=None,
                        rerank_data=str(rerank_data), rerank_top_n=10, rerank_batch_size=batch_size,
                        # each user's whole history, as the data build's test lists carry it
                        rerank_sequences=str(data_root.parent / "sequences.json"),
                        rerank_workers=workers,
                        rerank_tau=tau, rerank_commit_rule=commit_rule, rerank_hold_eos=hold_eos,
                        rerank_block_size=ev.get("block_size"),
                        rerank_max_new_tokens=ev.get("max_new_tokens"), show_progress=progress)
        config = Config(model=SASRecReranked, dataset=name, config_dict=settings)
        init_seed(config["seed"], config["reproducibility"])
        dataset = create_dataset(config)
        # Here inter_feat is still the remapped interaction table (ids are final, the item catalogue
        # is fixed); the per-user sequences and the leave-one-out split are built from it by
        # data_preparation, so dropping the other users' rows leaves each kept user's data intact.
        # The sample is drawn over raw user ids, so it does not depend on RecBole's id remapping.
        tokens = np.asarray(dataset.field2id_token[dataset.uid_field])
        row_users = tokens[dataset.inter_feat[dataset.uid_field].to_numpy()]
        users = sample_users(row_users, n_users, seed)
        n_total = len(np.unique(row_users))
        if len(users) < n_total:
            dataset.inter_feat = dataset.inter_feat[np.isin(row_users, users)].reset_index(drop=True)
        train_data, _, test_data = data_preparation(config, dataset)
        n_eval = len(test_data.dataset)  # leave-one-out: one test row per user

        rows = []
        per_user: dict[str, dict[int, int]] = {}
        n_boot = int(ev.get("n_boot", 2000))
        info_path = rerank_data / "build_info.json"
        pre_ranked = info_path.is_file() and preranker_dir(rerank_data, json.loads(info_path.read_text())) is not None
        # named by its place in the run, not by a path of this machine (the row is published)
        pre_row = [(PRERANKER_ROW, "rerank_data/preranker", None)] if pre_ranked else []
        for rname, model_dir, decoder in [("SASRec alone", None, None), *pre_row, *rerankers]:
            is_pre = rname == PRERANKER_ROW and decoder is None
            config["rerank_model"] = None if is_pre else model_dir
            config["rerank_decoder"] = decoder or "ar"
            init_seed(config["seed"], config["reproducibility"])
            engine = PreRankerOrder.load(rerank_data) if is_pre else None
            model = SASRecReranked(config, train_data.dataset, engine).to(config["device"])
            model.target_ranks = []
            bar = None
            if progress and model.engine is not None:
                # RecBole's own bar moves once per eval batch (thousands of users); count users.
                bar = tqdm(total=n_eval, desc=rname, unit="user")
                rerank = model.engine.rerank

                def rerank_counted(requests, options=None, _rerank=rerank, _bar=bar):
                    out = _rerank(requests, options)
                    _bar.update(len(requests))
                    return out

                model.engine.rerank = rerank_counted
            t0 = time.time()
            result = Trainer(config, model).evaluate(test_data, load_best_model=False,
                                                     show_progress=progress and bar is None)
            seconds = time.time() - t0
            if bar is not None:
                bar.close()
            used = model.options if decoder == "diffusion" else None  # resolved against the model's record
            row = {"name": rname, "decoder": decoder, "tau": used.tau if used else None,
                   "commit_rule": used.commit_rule if used else None, "hold_eos": used.hold_eos if used else None,
                   **{k: float(v) for k, v in result.items()}, "seconds": round(seconds, 3)}
            per_user[rname] = dict(model.target_ranks)
            check_recorded_ranks(rname, per_user[rname], row)
            if rows:  # paired by user against SASRec alone, the first row
                row["vs_sasrec"] = compare_to_base(per_user[rows[0]["name"]], per_user[rname], n_boot, seed)
            if model.engine is not None:
                st = model.rerank_stats
                row.update(model_dir=str(model_dir), users_reordered=st["reordered"],
                           fallback_rate=st["fallback"] / max(st["users"], 1),
                           users_with_recbole_history=st["recbole_history"],
                           seconds_per_user=round(seconds / max(n_eval, 1), 4))
            rows.append(row)

    return {"dataset": name, "history_masked": True, "n_users": n_eval, "n_users_total": n_total,
            "user_sample_seed": seed if len(users) < n_total else None, "rerank_top_n": 10,
            "rerank_batch_size": batch_size, "rerank_workers": workers, "sasrec_checkpoint": str(ckpt), "rows": rows}


AT_10 = {"recall@10": ("recall", 10), "ndcg@10": ("ndcg", 10)}  # what RecBole reports here


def check_recorded_ranks(name: str, ranks: dict[int, int], row: dict) -> None:
    """The per-user ranks recorded from the scores must give RecBole's own numbers, or the
    intervals would be about something else (ties broken differently, a missed user)."""
    per = per_user(np.array(list(ranks.values())), AT_10)
    for m, v in per.items():
        if m in row and abs(float(v.mean()) - row[m]) > 1e-4:
            raise RuntimeError(f"{name}: {m} from the recorded ranks is {v.mean():.6f}, RecBole reported "
                               f"{row[m]:.6f}; the paired intervals would not describe RecBole's numbers")


def compare_to_base(base: dict[int, int], new: dict[int, int], n_boot: int, seed: int) -> dict:
    """Paired bootstrap 95% CIs of recall@10 / ndcg@10, `new` minus `base`, over their common users."""
    users = sorted(set(base) & set(new))
    if len(users) != len(base) or len(users) != len(new):
        raise RuntimeError(f"the rows saw different users ({len(base)} vs {len(new)}, {len(users)} shared)")
    a = per_user(np.array([base[u] for u in users]), AT_10)
    b = per_user(np.array([new[u] for u in users]), AT_10)
    return {m: paired_bootstrap(a[m], b[m], n_boot, seed) for m in a}


def format_e2e(res: dict) -> str:
    sample = (f"a seeded sample (seed {res['user_sample_seed']}) of {res['n_users']} of {res['n_users_total']}"
              if res.get("user_sample_seed") is not None else f"all {res['n_users']}")
    lines = [f"RecBole Trainer.evaluate on {res['dataset']}, full sort, history masked, {sample} test users",
             f"{'model':28s} {'recall@10':>9s} {'ndcg@10':>8s} {'reordered':>9s} {'fallback':>8s} {'seconds':>8s}"
             "  ndcg@10 vs SASRec alone [paired 95% CI]"]
    for r in res["rows"]:
        decoding = [f"tau {r['tau']}", r.get("commit_rule"), "hold EOS" if r.get("hold_eos") else None]
        label = r["name"] + (f" ({', '.join(d for d in decoding if d)})" if r.get("tau") is not None else "")
        reordered = "" if r.get("users_reordered") is None else str(r["users_reordered"])
        fallback = "" if r.get("fallback_rate") is None else f"{r['fallback_rate']:.3f}"
        v = (r.get("vs_sasrec") or {}).get("ndcg@10")
        ci = f"  {v['diff']:+.4f} [{v['ci_low']:+.4f}, {v['ci_high']:+.4f}]" if v else ""
        lines.append(f"{label:28s} {r['recall@10']:9.4f} {r['ndcg@10']:8.4f} {reordered:>9s} {fallback:>8s} "
                     f"{r['seconds']:8.1f}{ci}")
    return "\n".join(lines)


def merge_into(old: dict, new: dict) -> dict:
    """Add `new`'s re-ranked rows to an earlier result `old` on the same users (rows of the same
    name are replaced). The SASRec-alone rows of both runs must agree: that is the check that the
    two runs saw the same users, data and retriever."""
    for key in ("dataset", "n_users", "n_users_total", "user_sample_seed", "history_masked"):
        if old.get(key) != new.get(key):
            raise ValueError(f"cannot merge: {key} is {old.get(key)!r} in the existing file and {new.get(key)!r} now")
    base_old, base_new = old["rows"][0], new["rows"][0]
    for m in ("recall@10", "ndcg@10"):
        if abs(float(base_old[m]) - float(base_new[m])) > 1e-9:
            raise ValueError(f"cannot merge: SASRec alone {m} is {base_old[m]} in the existing file and "
                             f"{base_new[m]} now (different users, data or retriever)")
    names = {r["name"] for r in new["rows"][1:]}
    rows = [base_old] + [r for r in old["rows"][1:] if r["name"] not in names] + new["rows"][1:]
    return {**{k: v for k, v in old.items() if k not in ("command", "commit", "date")},
            **{k: v for k, v in new.items() if k != "rows"}, "rows": rows}
