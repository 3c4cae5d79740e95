"""`dgr2 release`: a self-contained bundle from a finished `dgr2 pipeline` run directory.

    <bundle>/teacher/, student/   the AR teacher and the final student (HF directories: config.json
                                   with the diffusion and decode settings, safetensors, tokenizer)
    <bundle>/build_info.json       what the engine reads from a data directory; it names the two
    <bundle>/copurchase.npz        saved evidence files (co-purchase counts, plain arrays: no pickle)
    <bundle>/item_fields.json      and the prompt fields of every item with a semantic ID
    <bundle>/sids.json             item <-> semantic ID
    <bundle>/preranker/            with candidate_order: scorer, the pre-ranker's full model (LightGBM
    <bundle>/train_sequences.json.gz  text) and the training sequences its features count over
    <bundle>/test.jsonl            the test split's rendered prompts, candidates and targets
    <bundle>/metrics.json          the run's stage table, each row with its model's model_sha256
    <bundle>/recipe.*              the config the run was made from (its sha256 in the card)
    <bundle>/MODEL_CARD.md         data, recipe, metrics with CIs, speed, commit, limitations
    <bundle>/release.json          each file's sha256 and size (written last)

So `--data <bundle>` serves, evaluates and times the models with no retrieval or training artifact:
`dgr2 serve --model <bundle>/student --data <bundle>`, `dgr2 eval ...`, `dgr2 speed ...`. The
bundle is written in a temp directory and renamed into place; optimizer states, checkpoints and the
training splits stay behind.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from candidate_gen.files import (atomic_write_json, atomic_write_text, current_commit, file_sha256, model_sha256,
                                 write_dir_atomically)

from .pipeline import read_invocations

RELEASE_FORMAT = "diffusion-gr2/release/v1"
# The files of a model directory a user needs to load it; everything else a stage leaves there
# (its done marker, optimizer states, checkpoints) stays in the run.
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "vocab.json", "merges.txt")
DATA_FILES = ("build_info.json", "sids.json", "test.jsonl")
BUILD_INFO_KEEP = ("format", "copurchase", "evidence_history_items", "profile", "max_prompt_tokens", "n_candidates",
                   "seed", "candidate_order")
EVIDENCE_FILES = {"copurchase": "copurchase.npz", "item_fields": "item_fields.json"}
MAX_MB = 60.0  # what a committed bundle may weigh (the Beauty release's cap)


class ReleaseError(ValueError):
    """A run directory that cannot be released (what is missing, named) or a refused output."""


def check_run(run: Path, config: Path | None = None) -> dict:
    """The pieces of a run directory a release takes, or a ReleaseError listing every missing one."""
    missing = []
    models = {}
    for name in ("teacher", "student"):
        d = run / "models" / name
        if not (d / "config.json").is_file():
            missing.append(f"models/{name}/config.json (the pipeline links models/{name} to its final model)")
        elif not list(d.glob("*.safetensors")):
            missing.append(f"models/{name}/*.safetensors")
        models[name] = d
    for f in DATA_FILES:
        if not (run / "rerank_data" / f).is_file():
            missing.append(f"rerank_data/{f}")
    if not (run / "summary.json").is_file():
        missing.append("summary.json (the pipeline writes it after its evaluation step)")
    if not (run / "eval").is_dir():
        missing.append("eval/")
    recipe = Path(config) if config else run / "recipe.json"
    if not recipe.is_file():
        missing.append(f"{recipe.name} (the config the run was made from; give it with --config)"
                       if not config else f"{config} (--config)")
    if missing:
        raise ReleaseError(f"{run}: not a finished `dgr2 pipeline` run, missing: " + "; ".join(missing))
    return {"models": models, "recipe": recipe}


def _copy_model(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and (f.name in MODEL_FILES or f.name.endswith((".safetensors", ".safetensors.index.json"))):
            shutil.copyfile(f, dst / f.name)


def _write_evidence(data_dir: Path, bundle: Path) -> dict:
    """The engine's evidence, as the run's data directory builds it, saved as the bundle's own files;
    build_info.json then names those files instead of the retrieval artifacts."""
    from reranker.engine import RerankEngine
    from reranker.data.evidence import save_item_catalog
    from reranker.data.preranker import preranker_dir
    from reranker.text.sid import SemanticIds

    info = json.loads((data_dir / "build_info.json").read_text(encoding="utf-8"))
    copurchase, catalog = RerankEngine.load_evidence(data_dir, info)
    sids = SemanticIds.load(data_dir / "sids.json")
    copurchase.save(bundle / EVIDENCE_FILES["copurchase"])
    # the engine looks up only items with a semantic ID (it drops any other history item)
    save_item_catalog(bundle / EVIDENCE_FILES["item_fields"], catalog, sids.item_ids)
    out = {k: info[k] for k in BUILD_INFO_KEEP if k in info}
    out.update(paths_relative_to="the directory of this file", evidence_files=dict(EVIDENCE_FILES),
               artifacts={"sids": "sids.json"})
    if preranker_dir(data_dir, info) is not None:
        _write_preranker(data_dir, info, bundle)
        out["evidence_files"]["train_sequences"] = PRERANKER_FILES["train_sequences"]
        out["artifacts"]["preranker"] = PRERANKER_FILES["preranker"]
    if "copurchase" in out:
        out["copurchase"] = {**out["copurchase"], "sequences": "saved as counts in " + EVIDENCE_FILES["copurchase"]}
    return out


PRERANKER_FILES = {"preranker": "preranker", "train_sequences": "train_sequences.json.gz"}


def _write_preranker(data_dir: Path, info: dict, bundle: Path) -> None:
    """The pre-ranker's full model (what served requests are ordered by; its cross-fitted models order
    only the run's valid lists) and the training sequences its features count over."""
    import gzip

    from reranker.data.preranker import PreRanker, preranker_dir
    from reranker.engine import RerankEngine

    pre = PreRanker.load(preranker_dir(data_dir, info))
    PreRanker(pre.full, [None] * len(pre.folds), pre.seed).save(bundle / PRERANKER_FILES["preranker"])
    seqs = RerankEngine.train_sequences_of(data_dir, info)
    # mtime 0: the same sequences give the same bytes (release.json records every file's sha256)
    with gzip.GzipFile(bundle / PRERANKER_FILES["train_sequences"], "wb", mtime=0) as f:
        f.write(json.dumps(seqs, sort_keys=True, separators=(",", ":")).encode("utf-8"))


def _metrics(summary: dict, run: Path, models: dict[str, Path]) -> dict:
    """The stage table with each row's model_sha256 (of the run's weights; the shipped models are
    copies, so their rows carry the sha256 of the files in the bundle) and which rows were shipped."""
    shipped = {m.resolve(): name for name, m in models.items()}
    rows = []
    for row in summary.get("rows", []):
        row = dict(row)
        model = row.get("model")
        path = Path(model) if model else None
        if path is not None and not path.is_absolute():
            # relative to the run directory (a summary written by an older pipeline: to where it ran)
            path = run / path if (run / path).exists() or not path.exists() else path
        if path is None:
            row["model_sha256"] = None  # the retriever order: no model
        elif path.is_dir() and list(path.glob("*.safetensors")):
            row["model_sha256"] = model_sha256(path)
            row["shipped_as"] = shipped.get(path.resolve())
        else:
            raise ReleaseError(f"{run / 'summary.json'}: row {row.get('name')!r} names model {model}, which has "
                               "no weights any more; its model_sha256 cannot be recorded")
        if path is not None:  # the bundle's directory, or where the run kept it (relative: no machine paths)
            row["model"] = row.get("shipped_as") or os.path.relpath(path.resolve(), run.resolve())
        rows.append(row)
    for name in models:
        if not any(r.get("shipped_as") == name for r in rows):
            raise ReleaseError(f"{run / 'summary.json'}: no row evaluated models/{name}; rerun the pipeline so its "
                               "stage table evaluates the final models")
    keep = {k: summary.get(k) for k in ("name", "test_users", "tau", "block_size", "retrieval", "baselines",
                                        "baselines_info", "speed", "stage_optimizer_steps")}
    # the code that trained the models: each `dgr2 pipeline` call that made the run records its commit
    run_commits = list(dict.fromkeys(c["commit"] for c in read_invocations(run) if c.get("commit")))
    return {**keep, "run_commits": run_commits, "rows": rows}


def _ci(c: dict | None) -> str:
    return f"{c['diff']:+.4f} [{c['ci_low']:+.4f}, {c['ci_high']:+.4f}]" if c else ""


def _retrieval_lines(metrics: dict) -> list[str]:
    """The candidates' source and the non-LM baselines, as the run measured them (all its test users)."""
    ret, lines = metrics.get("retrieval") or {}, []
    if ret.get("recall@10") is not None:
        lines.append(f"Candidates: SASRec + FAISS, Recall@10 {ret['recall@10']:.4f} (RecBole full sort), "
                     f"{ret.get('recall@10_masked') or 0:.4f} with the history masked; the language-model rows are "
                     f"the test users whose target is in the top 10.")
    base = metrics.get("baselines") or {}
    n = (metrics.get("baselines_info") or {}).get("test_users")
    if base:
        scores = [f"{name} {b['metrics']['recall@1']:.4f}" for name, b in base.items()
                  if "recall@1" in (b.get("metrics") or {})]
        lines.append(f"Baselines without a language model (Recall@1 on {n} test users): {', '.join(scores)}.")
    return [x for line in lines for x in ("", line)]  # one paragraph each


def _trained_at(metrics: dict) -> str:
    commits = metrics.get("run_commits") or []
    return f" at commit {', '.join(f'`{c}`' for c in commits)}" if commits else ""


def model_card(metrics: dict, recipe_name: str, recipe_sha: str, info: dict, commit: str, n_test: int,
               sizes: dict[str, int]) -> str:
    rows = metrics["rows"]
    lines = [f"# {metrics.get('name') or 'diffusion-gr2'}: an AR re-ranker and its block-diffusion student", "",
             "A generative re-ranker over semantic IDs: `teacher/` decodes autoregressively, `student/` is its "
             "block-diffusion conversion, trained further, that commits many tokens per forward pass. Both rank "
             "a retriever's candidate list for a user's history (the prompt states co-purchase counts and "
             "category/brand matches per candidate).", "",
             "## Use", "", "```bash",
             "dgr2 serve --model BUNDLE/student --data BUNDLE --port 50051   # the student's recorded decode settings",
             "dgr2 eval --model BUNDLE/student --data BUNDLE",
             "dgr2 speed --ar BUNDLE/teacher --diffusion BUNDLE/student --data BUNDLE", "```", "",
             "## Data", "",
             f"`test.jsonl`: {n_test} test prompts (rendered, with candidates and the target); candidates per list: "
             f"{info.get('n_candidates')}; co-purchase window {(info.get('copurchase') or {}).get('window')}, counted "
             "on the training split, each user's own pairs left out of that user's evidence "
             f"(`{EVIDENCE_FILES['copurchase']}`); item fields for prompts in `{EVIDENCE_FILES['item_fields']}`."
             + (" Prompts list the candidates in the pre-ranker's order (`preranker/`, LightGBM on the evidence "
                "features, which count over `train_sequences.json.gz`): a request must carry the retriever's "
                "scores, and an invalid answer falls back to that order."
                if info.get("candidate_order", "retriever") != "retriever" else ""),
             *_retrieval_lines(metrics), "",
             "## Recipe", "",
             f"`{recipe_name}` (sha256 `{recipe_sha}`), run by `dgr2 pipeline`" + _trained_at(metrics)
             + f"; released at commit `{commit}`.", "",
             f"## Metrics ({metrics.get('test_users')} test users; paired bootstrap 95% CIs)", "",
             "| row | valid | Recall@1 | vs retriever | vs AR | NDCG@3 | shipped | model_sha256 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        valid = f"{r['valid_rate']:.3f}" if r.get("valid_rate") is not None else ""
        vr, va = r.get("vs_retriever") or {}, r.get("vs_ar") or {}
        lines.append(f"| {r['name']} | {valid} | {r['recall@1']:.4f} | {_ci(vr.get('recall@1'))} | "
                     f"{_ci(va.get('recall@1'))} | {r['ndcg@3']:.4f} | {r.get('shipped_as') or ''} | "
                     f"{(r.get('model_sha256') or '')[:16]} |")
    sp = metrics.get("speed")
    lines += ["", "## Speed", ""]
    if sp:
        lines.append(f"Side by side in one process at batch 1, tau {sp.get('tau')}, `{sp.get('commit_rule')}` rule: "
                     f"the student decodes {sp['batch1_speedup']:.2f}x its teacher's tokens/s "
                     f"({sp.get('diffusion_tokens_per_second', 0):.1f} vs {sp.get('ar_tokens_per_second', 0):.1f}; "
                     f"{sp.get('n_prompts')} prompts, {sp.get('repeats')} repeats, {sp.get('torch_threads')} threads).")
    else:
        lines.append("The run measured no speed (its config has no `speed` section).")
    lines += ["", "## Limitations", "",
              "* Items outside `sids.json` cannot be ranked; history items outside it are dropped from prompts.",
              "* The co-purchase evidence is frozen at the training split of this run: new items and new "
              "interactions add nothing until a new run.",
              "* An answer that does not parse to a valid ranking falls back to the retriever order (the valid "
              "rate above says how often).",
              "* Speed-ups depend on the machine, the thread count and the batch size.",
              "", "## Files", "",
              "`release.json` lists every file's sha256 and size; "
              f"{sum(sizes.values()) / 1e6:.1f} MB in all.", ""]
    return "\n".join(lines)


def release(run, out, config=None, force: bool = False, max_mb: float = MAX_MB) -> dict:
    """Write the bundle of run directory `run` at `out` (see the module docstring); returns release.json."""
    run, out = Path(run), Path(out)
    if not run.is_dir():
        raise ReleaseError(f"{run}: no such run directory")
    if out.exists() and not force:
        raise ReleaseError(f"{out}: exists; give --force to replace it")
    pieces = check_run(run, config)
    summary = json.loads((run / "summary.json").read_text(encoding="utf-8"))
    metrics = _metrics(summary, run, pieces["models"])
    commit = current_commit()
    recipe = pieces["recipe"]
    recipe_name = "recipe" + "".join(recipe.suffixes[-1:])
    result = {}

    def save(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        for name, src in pieces["models"].items():
            _copy_model(src.resolve(), tmp / name)
        data_dir = run / "rerank_data"
        info = _write_evidence(data_dir, tmp)
        atomic_write_json(tmp / "build_info.json", info)
        for f in ("sids.json", "test.jsonl"):
            shutil.copyfile(data_dir / f, tmp / f)
        if recipe.suffix == ".json":  # the pipeline's record: where the run lived is not part of the recipe
            settings = json.loads(recipe.read_text(encoding="utf-8"))
            settings.pop("out", None)
            atomic_write_text(tmp / recipe_name, json.dumps(settings, indent=2, sort_keys=True) + "\n")
        else:
            shutil.copyfile(recipe, tmp / recipe_name)
        recipe_sha = file_sha256(tmp / recipe_name)
        atomic_write_json(tmp / "metrics.json", {**metrics, "recipe": {"file": recipe_name, "sha256": recipe_sha},
                                                 "commit": commit})
        n_test = sum(1 for ln in (tmp / "test.jsonl").read_text(encoding="utf-8").splitlines() if ln.strip())
        sizes = {p.relative_to(tmp).as_posix(): p.stat().st_size for p in tmp.rglob("*") if p.is_file()}
        atomic_write_text(tmp / "MODEL_CARD.md", model_card(metrics, recipe_name, recipe_sha, info, commit, n_test,
                                                            sizes))
        files = {}
        for p in sorted(tmp.rglob("*")):
            if p.is_file():
                files[p.relative_to(tmp).as_posix()] = {"sha256": file_sha256(p), "size": p.stat().st_size}
        total = sum(f["size"] for f in files.values())
        if total > max_mb * 1e6:
            raise ReleaseError(f"the bundle would weigh {total / 1e6:.1f} MB, over the {max_mb:g} MB cap "
                               "(--max-mb)")
        doc = {"format": RELEASE_FORMAT, "commit": commit, "run": run.resolve().name,
               "models": {name: {"dir": name, "model_sha256": model_sha256(tmp / name)} for name in pieces["models"]},
               "total_bytes": total, "files": files}
        atomic_write_json(tmp / "release.json", doc)  # last: its presence says the rest is complete
        result.update(doc)

    write_dir_atomically(out, save)
    return result


def verify_release(bundle) -> list[str]:
    """The problems of a bundle against its release.json (empty when every file matches)."""
    bundle = Path(bundle)
    if not (bundle / "release.json").is_file():
        raise FileNotFoundError(f"{bundle / 'release.json'}: missing; not a `dgr2 release` bundle")
    doc = json.loads((bundle / "release.json").read_text(encoding="utf-8"))
    problems = []
    for name, f in doc["files"].items():
        p = bundle / name
        if not p.is_file():
            problems.append(f"{name}: missing")
        elif p.stat().st_size != f["size"] or file_sha256(p) != f["sha256"]:
            problems.append(f"{name}: sha256 or size differs from release.json")
    extra = sorted(p.relative_to(bundle).as_posix() for p in bundle.rglob("*")
                   if p.is_file() and p.name != "release.json" and p.relative_to(bundle).as_posix() not in doc["files"])
    problems += [f"{name}: not listed in release.json" for name in extra]
    return problems
