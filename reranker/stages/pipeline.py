"""Run one stage or a chain of stages: config merge, skip-if-done, resume, atomic hand-over.

    run_stage("sft", "models/init", "models/sft", "data/examples", {"epochs": 2}, "runs")
    run_pipeline([{"name": "sft", "config": {...}}, {"name": "ar_rl"}], "models/init", "runs", "data/examples")

A stage's identity is the hash of (stage name, merged config, seed, input model, data files).
A finished stage leaves `<out>/stage_done.json` carrying it; asking again for the same thing
skips the stage, asking for anything different redoes it. An interrupted stage resumes from
the checkpoints in its run dir (tagged with the same hash). The input model's identity is the
upstream stage's hash when it has one, so changing stage 1 redoes everything after it.

Under torchrun every rank calls the same functions; rank 0 alone writes and the others wait
at barriers. Module entry (used by the DDP test and by torchrun launches):

    python -m reranker.stages.pipeline --stage sft --input IN --output OUT --data DATA --config-json '{...}'
    torchrun --nproc_per_node=2 -m reranker.stages.pipeline --stage sft ...
    python -m reranker.stages.pipeline --pipeline stages.yaml --input IN --runs RUNS --data DATA
"""
from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

from candidate_gen.files import atomic_write_json, replace_dir
from reranker.stages.base import DONE_FILE, NotDoneError, StageContext, config_hash, merge_config, read_done
from reranker.stages.registry import get_stage, get_stage_class
from reranker.training import distributed as D

PARTIAL_SUFFIX = ".partial"
_SMALL = 4 << 20  # files up to this size are hashed whole; bigger ones by size + head + tail


def _hash_file(h, path: Path) -> None:
    size = path.stat().st_size
    h.update(f"{size}\0".encode())
    with open(path, "rb") as f:
        if size <= _SMALL:
            h.update(f.read())
        else:  # weights: a full read of a multi-GB file per lookup is not worth it
            h.update(f.read(1 << 20))
            f.seek(size - (1 << 20))
            h.update(f.read(1 << 20))


def model_fingerprint(model_dir) -> str:
    """The upstream stage's hash if the directory is a stage output, else a content hash."""
    model_dir = Path(model_dir)
    done = read_done(model_dir)
    if done and done.get("config_hash"):
        return "stage:" + done["config_hash"]
    if not model_dir.is_dir():
        raise FileNotFoundError(f"input model directory not found: {model_dir}")
    h = hashlib.sha256()
    for p in sorted(q for q in model_dir.rglob("*") if q.is_file() and not q.name.startswith(".")):
        h.update(str(p.relative_to(model_dir)).encode() + b"\0")
        _hash_file(h, p)
    return "files:" + h.hexdigest()


def data_fingerprint(data_dir) -> str:
    """Content hash of the data dir's top-level *.jsonl / *.json files ("none" without one)."""
    if data_dir is None:
        return "none"
    data_dir = Path(data_dir)
    h = hashlib.sha256()
    for p in sorted(data_dir.glob("*.json*")):
        # dotfiles are bookkeeping (the pipeline's done-marker records a wall time), not data
        if p.is_file() and p.suffix in (".jsonl", ".json") and not p.name.startswith("."):
            h.update(p.name.encode() + b"\0")
            _hash_file(h, p)
    return h.hexdigest()


def stage_identity(name: str, cfg: dict, seed: int, input_dir, data_dir) -> dict:
    """What a stage's hash is made of: its name, merged config, seed, input model and data."""
    hashed = dict(cfg)
    if isinstance(cfg.get("teacher"), str) and cfg["teacher"]:
        # a teacher model (OPD) counts by what it is, not by how its path was spelled
        hashed["teacher"] = model_fingerprint(cfg["teacher"])
    identity = {"stage": name, "config": hashed, "seed": int(seed),
                "input": model_fingerprint(input_dir), "data": data_fingerprint(data_dir)}
    nested = nested_file_fingerprints(data_dir, cfg)
    if nested:  # files below the data dir's top level that this stage reads (copy draws)
        identity["files"] = nested
    return identity


def nested_file_fingerprints(data_dir, cfg: dict) -> dict:
    """Content hashes of the `train_file` / `valid_file` entries below the data dir's top level:
    `data_fingerprint` covers the top-level files every stage shares, and a file only some stages
    read (integration/phases.py keeps copy draws in `<data>/copies/`) counts only for them."""
    if data_dir is None:
        return {}
    out = {}
    for key in ("train_file", "valid_file"):
        value = cfg.get(key)
        for f in value if isinstance(value, list) else [value]:
            if isinstance(f, str) and len(Path(f).parts) > 1 and not Path(f).is_absolute():
                path = Path(data_dir) / f
                if path.is_file():
                    h = hashlib.sha256()
                    _hash_file(h, path)
                    out[f] = h.hexdigest()
    return out


def _say(line: str) -> None:
    if D.is_main():
        print(line, flush=True)


def _summary_line(i: int, n: int, s: dict) -> str:
    head = f"[{i}/{n}] {s['name']}:"
    if s["status"] == "skipped":
        return f"{head} skipped (done, {s['config_hash'][:10]})"
    m = s.get("metrics") or {}
    extra = "".join(f", {k} {m[k]:.4f}" for k in ("best_val_loss", "last_train_loss") if isinstance(m.get(k), float))
    return f"{head} done, {s['optimizer_steps']} steps in {s['wall_seconds']:.1f}s{extra}"


def run_stage(name: str, input_dir, output_dir, data_dir=None, config: dict | None = None, runs_dir=None, *,
              run_dir=None, seed: int = 0, progress: bool = True, force: bool = False, device: str = "auto",
              run_missing: bool = True) -> dict:
    """Run stage `name` from model `input_dir` into `output_dir` (skipped when already done
    with the same hash, unless `force`). Checkpoints/TensorBoard go to `run_dir`, by default
    `<runs_dir>/<name>` or, without runs_dir, `<output_dir>.run`. Returns a summary dict.
    run_missing=False: a stage that is not done raises NotDoneError instead of training."""
    env = D.init_distributed(device)
    stage = get_stage(name)
    cfg = merge_config(stage.default_config(), config, name)
    output_dir = Path(output_dir)
    if run_dir is None:
        run_dir = Path(runs_dir) / name if runs_dir is not None else output_dir.with_name(output_dir.name + ".run")
    run_dir = Path(run_dir)
    identity = stage_identity(name, cfg, seed, input_dir, data_dir)
    h = config_hash(identity)
    summary = {"name": name, "output_dir": str(output_dir), "run_dir": str(run_dir), "config_hash": h}

    done = read_done(output_dir)
    if done is not None and done.get("config_hash") == h and not force:
        return {**summary, "status": "skipped", "metrics": done.get("metrics", {}),
                "optimizer_steps": done.get("optimizer_steps", 0), "wall_seconds": 0.0}

    if not run_missing:
        why = ("not trained yet" if done is None else
               f"made from other settings or inputs (config_hash {done.get('config_hash')}, now {h})")
        raise NotDoneError(f"stage {name!r} in {output_dir}: {why}")
    partial = output_dir.with_name(output_dir.name + PARTIAL_SUFFIX)
    if env.is_main:
        if force:  # a forced rerun must not resume from this hash's checkpoints
            shutil.rmtree(partial, ignore_errors=True)
            shutil.rmtree(run_dir, ignore_errors=True)
        partial.mkdir(parents=True, exist_ok=True)
        run_dir.mkdir(parents=True, exist_ok=True)
    D.barrier()
    ctx = StageContext(name=name, input_dir=Path(input_dir), output_dir=partial, final_dir=output_dir,
                       data_dir=Path(data_dir) if data_dir is not None else None, config=cfg, run_dir=run_dir,
                       seed=int(seed), rank=env.rank, world_size=env.world_size, local_rank=env.local_rank,
                       device=str(env.device), progress=progress, config_hash=h)
    t0 = time.perf_counter()
    result = stage.run(ctx)
    wall = time.perf_counter() - t0
    D.barrier()
    if env.is_main:
        if not (partial / "config.json").is_file():
            raise RuntimeError(f"stage {name!r} finished without saving a model into {partial}")
        record = {
            "stage": name,
            "config_hash": h,
            "config": cfg,
            "seed": int(seed),
            "input_fingerprint": identity["input"],
            "data_fingerprint": identity["data"],
            "metrics": result.metrics,
            "optimizer_steps": int(result.optimizer_steps),
            "wall_seconds": wall,
            "world_size": env.world_size,
            "finished_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }
        # stage_done.json goes in before the rename: `<out>` appears complete or not at all.
        atomic_write_json(partial / DONE_FILE, record)
        replace_dir(partial, output_dir)
    D.barrier()
    return {**summary, "status": "done", "metrics": result.metrics,
            "optimizer_steps": int(result.optimizer_steps), "wall_seconds": wall}


def _spec_dirname(i: int, spec: dict) -> str:
    return spec.get("id") or f"{i:02d}_{spec['name']}"


def run_pipeline(stage_specs: list[dict], start_model_dir, runs_dir, data_dir=None, *, seed: int = 0,
                 progress: bool = True, device: str = "auto", run_missing: bool = True) -> list[dict]:
    """Run stages in order, each one's output model feeding the next.

    A spec is {"name": ..., "config": {...}} plus optional "id" (run dir name, default
    "NN_name"), "output" (model dir, default <runs_dir>/<id>/model), "data" (overrides
    data_dir) and "seed". Names and configs are all checked before anything trains.
    Layout: <runs_dir>/<id>/{model/, checkpoints/, tensorboard/, metrics.jsonl}.
    run_missing=False: only read back stages already done (run_stage)."""
    runs_dir = Path(runs_dir)
    specs = [dict(s) for s in stage_specs]
    seen = set()
    for i, spec in enumerate(specs, start=1):
        if "name" not in spec:
            raise ValueError(f"stage spec #{i} has no 'name': {spec}")
        unknown = set(spec) - {"name", "config", "id", "output", "data", "seed"}
        if unknown:
            raise ValueError(f"stage spec #{i} ({spec['name']}): unknown keys {sorted(unknown)}")
        cls = get_stage_class(spec["name"])  # fails fast on a typo in the last stage
        merge_config(cls().default_config(), spec.get("config"), spec["name"])
        d = _spec_dirname(i, spec)
        if d in seen:
            raise ValueError(f"two stages share the run dir name {d!r}; give one an 'id'")
        seen.add(d)

    summaries = []
    model_dir = Path(start_model_dir)
    for i, spec in enumerate(specs, start=1):
        run_dir = runs_dir / _spec_dirname(i, spec)
        out = Path(spec["output"]) if spec.get("output") else run_dir / "model"
        s = run_stage(spec["name"], model_dir, out, spec.get("data", data_dir), spec.get("config"),
                      run_dir=run_dir, seed=int(spec.get("seed", seed)), progress=progress, device=device,
                      run_missing=run_missing)
        _say(_summary_line(i, len(specs), s))
        summaries.append(s)
        model_dir = out
    if D.is_main() and run_missing:  # (read back only: the file already says this)
        rel = [{**s, "output_dir": _rel(s["output_dir"], runs_dir), "run_dir": _rel(s["run_dir"], runs_dir)}
               for s in summaries]
        # several chains may share a runs dir (the pipeline runs ar_rl after choosing the teacher):
        # each call adds or updates its runs, keeping the others
        path = runs_dir / "pipeline_summary.json"
        earlier = json.loads(path.read_text()) if path.is_file() else []
        ours = {r["run_dir"] for r in rel}
        merged = sorted([r for r in earlier if r.get("run_dir") not in ours] + rel, key=lambda r: r["run_dir"])
        atomic_write_json(path, merged)
    return summaries


def _rel(path: str, base: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(base.resolve()))
    except ValueError:
        return str(path)


def clear_stage(output_dir, run_dir) -> None:
    """Forget a stage entirely: its output, partial output and checkpoints."""
    output_dir = Path(output_dir)
    for p in (output_dir, output_dir.with_name(output_dir.name + PARTIAL_SUFFIX), Path(run_dir)):
        shutil.rmtree(p, ignore_errors=True)


def _load_yaml_or_json(path) -> object:
    text = Path(path).read_text(encoding="utf-8")
    if str(path).endswith(".json"):
        return json.loads(text)
    import yaml

    return yaml.safe_load(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m reranker.stages.pipeline", description=__doc__.split("\n\n")[0])
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--stage", help="run one registered stage")
    what.add_argument("--pipeline", help="YAML/JSON file: a list of stage specs, or {stages: [...]}")
    ap.add_argument("--input", required=True, help="input (start) model directory")
    ap.add_argument("--output", help="output model directory (--stage)")
    ap.add_argument("--data", help="data directory with the examples JSONL files")
    ap.add_argument("--runs", help="runs directory (--pipeline: required; --stage: run dir parent)")
    ap.add_argument("--run-dir", help="exact run dir for --stage")
    ap.add_argument("--config-json", default=None, help="stage config overrides as JSON (--stage)")
    ap.add_argument("--config", default=None, help="stage config overrides as a YAML/JSON file (--stage)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--force", action="store_true", help="rerun even if stage_done.json matches")
    args = ap.parse_args(argv)

    try:
        if args.stage:
            if not args.output:
                ap.error("--stage needs --output")
            cfg = {}
            if args.config:
                cfg.update(_load_yaml_or_json(args.config) or {})
            if args.config_json:
                cfg.update(json.loads(args.config_json))
            s = run_stage(args.stage, args.input, args.output, args.data, cfg, args.runs, run_dir=args.run_dir,
                          seed=args.seed, progress=not args.no_progress, force=args.force, device=args.device)
            _say(_summary_line(1, 1, s))
        else:
            if not args.runs:
                ap.error("--pipeline needs --runs")
            specs = _load_yaml_or_json(args.pipeline)
            if isinstance(specs, dict):
                specs = specs.get("stages", [])
            run_pipeline(specs, args.input, args.runs, args.data, seed=args.seed,
                         progress=not args.no_progress, device=args.device)
    finally:
        D.destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
