"""`dgr2 pipeline`: retrieval -> data -> sft -> ar_rl -> convert -> cft -> opd -> rl -> evaluation -> speed.

Every step writes into `<out>/` and is skipped when its output is complete and was made from the
same settings (a hash of the settings that feed it, chained from the step before); training
stages also resume from their last checkpoint after an interruption (reranker/stages/pipeline.py).

    <out>/retrieval/        dgr2 retrieve artifacts
    <out>/rerank_data/      dgr2 data build output
    <out>/baselines.json    the non-LM baselines on the test users (outside rerank_data: every
                            stage's identity hashes that directory's top-level files)
    <out>/models/init/      the initial model
    <out>/runs/ar/          sft, ar_rl   (model dirs under <id>/model)
    <out>/models/naive/     the converted, untrained diffusion model
    <out>/runs/diffusion/   cft, opd, rl
    <out>/models/teacher    -> the final AR model;  <out>/models/student -> the final diffusion model
    <out>/eval/             one JSON report per evaluated row (+ speed.json, the batch-1 side-by-side run)
    <out>/summary.json      the stage table
    <out>/recipe.json       the settings of the latest run (`dgr2 release` ships it)
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from candidate_gen.files import atomic_write_text, file_sha256, model_sha256

from .config import section
from .phases import check_model_section, check_stages, choose_on_validation, copy_warmup_specs, phase_specs
from .step_markers import mark_step, not_done, step_done, step_hash

log = logging.getLogger(__name__)


def _step(name: str, i: int, n: int, msg: str) -> None:
    print(f"[{i}/{n}] {name}: {msg}", flush=True)


def run_full_pipeline(cfg: dict, data_override: str | None = None, only_until: str | None = None,
                      summary_only: bool = False) -> dict:
    """summary_only: run no step, only read back the finished ones and write the summary; a step that
    is not done (or was made from other settings or code) raises NotDoneError naming it. The non-LM
    baselines are the exception: made again when their version changed (no model is trained)."""
    from candidate_gen.retrieve import run_retrieval
    from reranker.data.dataset import FORMAT as DATA_FORMAT, build_rerank_data
    from reranker.diffusion.convert import convert_to_diffusion
    from reranker.eval.baselines import BASELINES_VERSION, run_baselines
    from reranker.stages.base import read_done
    from reranker.stages.pipeline import model_fingerprint, run_pipeline
    from reranker.training.init_model import init_model

    from .config import retrieval_settings

    out = Path(cfg["out"])
    check_stages(section(cfg, "stages"))  # before hours of work, not when a stage's chain starts
    check_model_section(section(cfg, "model"))
    if not summary_only:  # the settings this run was made from: what `dgr2 release` ships and hashes as the recipe
        atomic_write_text(out / "recipe.json", json.dumps(cfg, indent=2, sort_keys=True, default=str) + "\n")
    seed = int(cfg.get("seed", 0))
    n_steps = 7
    timings: dict[str, float] = {}

    # 1. Retrieval.
    t = time.time()
    rs = retrieval_settings(cfg, data_override, str(out / "retrieval"))
    # --data by the directory it names: a relative and an absolute spelling of it are the same step
    h_ret = step_hash("retrieval", section(cfg, "data"), section(cfg, "retrieval"), seed,
                      str(Path(data_override).resolve()) if data_override else None)
    if step_done(out / "retrieval" / ".pipeline_done.json", h_ret):
        _step("retrieval", 1, n_steps, "up to date, skipped")
        retrieval = json.loads((out / "retrieval" / "metrics.json").read_text())
    else:
        if summary_only:
            not_done("retrieval", out / "retrieval")
        _step("retrieval", 1, n_steps, "SASRec + FAISS + candidate lists")
        retrieval = run_retrieval(rs)
        mark_step(out / "retrieval" / ".pipeline_done.json", h_ret)
    timings["retrieval"] = time.time() - t

    # 2. Re-ranking data + baselines.
    t = time.time()
    dcfg = dict(section(cfg, "rerank_data"))
    data_dir = out / "rerank_data"
    items_path = dcfg.pop("items_path", None) or _items_file(rs)
    h_data = step_hash("data", h_ret, dcfg, file_sha256(items_path), seed, DATA_FORMAT)
    if step_done(data_dir / ".pipeline_done.json", h_data):
        _step("data", 2, n_steps, "up to date, skipped")
    else:
        if summary_only:
            not_done("re-ranking data", data_dir)
        _step("data", 2, n_steps, "semantic IDs, tokenizer, teacher traces")
        build_rerank_data(rs.out, items_path, data_dir, seed=seed, **dcfg)
        mark_step(data_dir / ".pipeline_done.json", h_data, seconds=time.time() - t)
    # The non-LM baselines; a stored file made by another version of them, or from other data, is made again.
    baselines_path = out / "baselines.json"
    stored = json.loads(baselines_path.read_text()) if baselines_path.is_file() else {}
    if stored.get("version") != BASELINES_VERSION or stored.get("data_hash", h_data) != h_data:
        _step("data", 2, n_steps, "non-LM baselines on the test users")
        baselines = run_baselines(data_dir, n_boot=int(section(cfg, "eval").get("n_boot", 2000)), seed=seed)
        atomic_write_text(baselines_path, json.dumps({**baselines, "data_hash": h_data}, indent=2))
    timings["data"] = time.time() - t
    if only_until == "data":
        return {"retrieval": retrieval}

    # 3. Initial model, AR stages.
    t = time.time()
    mcfg = section(cfg, "model")
    init_dir = out / "models" / "init"
    h_init = step_hash("init", h_data, mcfg, seed)
    if not step_done(out / "models" / ".init_done.json", h_init):
        if summary_only:
            not_done("initial model", init_dir)
        init_model(data_dir, init_dir, size=mcfg.get("size", "cpu"), base=mcfg.get("base"), seed=seed,
                   qk_norm_gain=mcfg.get("qk_norm_gain"))
        mark_step(out / "models" / ".init_done.json", h_init)
    stages = section(cfg, "stages")
    ecfg = section(cfg, "eval")
    selection: dict[str, dict] = {}
    # run dirs are numbered from 1 along each chain (runs/ar/01_..., runs/diffusion/01_...)
    ar_specs = copy_warmup_specs(stages["copy_warmup"], data_dir, seed, 1) if "copy_warmup" in stages else []
    if "sft" in stages:
        ar_specs += phase_specs("sft", stages["sft"], data_dir, seed, len(ar_specs) + 1)
    _step("ar", 3, n_steps, " -> ".join([s["id"][3:] for s in ar_specs]
                                        + [x for x in ("choose_teacher", "ar_rl") if x in stages]))
    run_missing = not summary_only
    ar_runs = (run_pipeline(ar_specs, init_dir, out / "runs" / "ar", data_dir, seed=seed, run_missing=run_missing)
               if ar_specs else [])
    sft_dir = Path(ar_runs[-1]["output_dir"]) if ar_runs else init_dir
    if "choose_teacher" in stages and ar_runs:
        sft_dir, selection["teacher"] = choose_on_validation("choose_teacher", stages["choose_teacher"], ar_runs,
                                                             data_dir, ecfg, out, "ar", evaluate_rows, run_missing)
    rl_runs = []
    if "ar_rl" in stages:
        rl_runs = run_pipeline(phase_specs("ar_rl", stages["ar_rl"], data_dir, seed, len(ar_specs) + 1), sft_dir,
                               out / "runs" / "ar", data_dir, seed=seed, run_missing=run_missing)
    ar_dir = Path(rl_runs[-1]["output_dir"]) if rl_runs else sft_dir
    timings["ar_stages"] = time.time() - t

    # 4. Conversion and diffusion stages.
    t = time.time()
    block = int(section(cfg, "convert").get("block_size", 32))
    # The decode settings the student is trained and served for (commit rule, EOS hold, tau): recorded
    # in the converted model, carried by every later stage, used by OPD/RL rollouts, eval and serve.
    decode = section(cfg, "convert").get("decode") or {}
    naive_dir = out / "models" / "naive"
    h_conv = step_hash("convert", model_fingerprint(ar_dir), block, decode)
    if not step_done(out / "models" / ".naive_done.json", h_conv):
        if summary_only:
            not_done("conversion", naive_dir)
        _step("convert", 4, n_steps, f"AR -> block diffusion, B = {block}")
        t_conv = time.time()
        convert_to_diffusion(ar_dir, naive_dir, block_size=block, decode=decode)
        mark_step(out / "models" / ".naive_done.json", h_conv, seconds=time.time() - t_conv)
    _step("diffusion", 5, n_steps, " -> ".join(x for x in ("cft", "choose_student", "opd", "rl") if x in stages))
    d_runs = []
    student = naive_dir
    if "cft" in stages:
        cft_runs = run_pipeline(phase_specs("cft", stages["cft"], data_dir, seed, 1), naive_dir,
                                out / "runs" / "diffusion", data_dir, seed=seed, run_missing=run_missing)
        student = Path(cft_runs[-1]["output_dir"])
        if "choose_student" in stages:
            student, selection["student"] = choose_on_validation("choose_student", stages["choose_student"],
                                                                 cft_runs, data_dir, ecfg, out, "diffusion",
                                                                 evaluate_rows, run_missing)
        d_runs.append({"name": "cft", "output_dir": str(student), "runs": cft_runs})
    n_d = sum(len(r["runs"]) for r in d_runs)
    for s in ("opd", "rl"):
        if s in stages:
            # OPD distils from the final teacher unless told otherwise
            specs = phase_specs(s, stages[s], data_dir, seed, n_d + 1,
                                defaults={"teacher": str(ar_dir)} if s == "opd" else None)
            runs = run_pipeline(specs, student, out / "runs" / "diffusion", data_dir, seed=seed,
                                run_missing=run_missing)
            n_d += len(runs)
            student = Path(runs[-1]["output_dir"])
            d_runs.append({"name": s, "output_dir": str(student), "runs": runs})
    timings["diffusion_stages"] = time.time() - t
    # Stable names for the two models a user serves and evaluates (the run dirs are named by stage).
    _link(out / "models" / "teacher", ar_dir)
    if d_runs:
        _link(out / "models" / "student", student)

    all_runs = ar_runs + rl_runs + [x for r in d_runs for x in r["runs"]]

    # 5. Evaluation of every row of the stage table.
    t = time.time()
    rows = [("AR GR2 (sft)", sft_dir, "ar")] if rl_runs else []
    rows += [("AR GR2", ar_dir, "ar"), ("naive conversion", naive_dir, "diffusion")]
    label = {"cft": "+CFT", "opd": "+CFT+OPD", "rl": "+CFT+OPD+RL"}
    rows += [(label.get(r["name"], r["name"]), Path(r["output_dir"]), "diffusion") for r in d_runs]
    _step("eval", 6, n_steps, ", ".join(r[0] for r in rows))
    table = evaluate_rows(rows, data_dir, ecfg, out / "eval", run_missing)
    timings["eval"] = time.time() - t

    # 6. Side-by-side speed of the final student over its teacher at batch 1 (a `speed` section).
    t = time.time()
    speed = None
    if "speed" in cfg and d_runs:
        _step("speed", 7, n_steps, "final student vs AR teacher, batch 1, side by side")
        speed = measure_final_speed(ar_dir, student, data_dir, section(cfg, "speed"),
                                    ecfg, out / "eval" / "speed.json", run_missing)
        speed.pop("speed_key", None)
    timings["speed"] = time.time() - t

    chain = [ar_runs, ("choose_teacher", selection.get("teacher")), rl_runs, ("convert", None),
             *[r["runs"] for r in d_runs if r["name"] == "cft"], ("choose_student", selection.get("student")),
             *[r["runs"] for r in d_runs if r["name"] != "cft"]]
    stage_seconds = recorded_seconds(out, chain, table, speed)
    keep = ("n", "recall@1", "recall@3", "ndcg@3", "ndcg@5", "valid_rate", "fallback_rate", "copy_order_rate",
            "tokens_per_second", "forward_passes_per_token", "mean_generated_tokens", "speedup_vs_ar", "vs_ar",
            "vs_retriever", "failures", "decoder", "model", "model_sha256", "same_weights_as")
    rows = [{"name": "retriever order", "n": table[0]["n"], **table[0]["retriever"]}] if table else []
    rows += [{"name": rep["label"], **{k: rep.get(k) for k in keep}} for rep in table]
    for row in rows[1:]:  # a row's model relative to the run directory: the run can move, `dgr2 release` reads it
        row["model"] = os.path.relpath(Path(row["model"]).resolve(), out.resolve())
    baselines = json.loads(baselines_path.read_text())
    # "test_users" counts the evaluated users of `eval.split` (the test split unless an experiment says otherwise)
    summary = {"name": cfg.get("name"), "split": ecfg.get("split", "test"),
               "test_users": table[0]["n"] if table else 0,
               "tau": next((r["tau"] for r in table if r.get("decoder") == "diffusion"), None), "block_size": block, "rows": rows,
               "retrieval": {k: retrieval.get(k) for k in
               ("recall@10", "ndcg@10", "recall@10_masked", "ndcg@10_masked", "test_users_target_in_top10")},
               "baselines": baselines["methods"],
               "baselines_info": {"test_users": baselines["test_users"]},
               "speed": speed,
               "timings": timings,
               "models": {"teacher": str(out / "models" / "teacher"),
                          "student": str(out / "models" / "student") if d_runs else None},
               # the choices made on the selection users (valid.jsonl), with every candidate's figures
               "selection": selection,
               # each step's seconds as recorded with its output (a step a resumed run skipped keeps the
               # seconds of the run that made it); total_seconds is their sum
               "stage_seconds": stage_seconds,
               "total_seconds": sum(v for v in stage_seconds.values() if v),
               "stage_wall_seconds": {name: (read_done(r["output_dir"]) or {}).get("wall_seconds")
                                      for name, r in run_labels(all_runs)},
               # RL stages keep their start when validation never improves; the steps show they trained
               "stage_optimizer_steps": {name: (read_done(r["output_dir"]) or {}).get("optimizer_steps")
                                         for name, r in run_labels(all_runs)}}
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2))
    return summary


def _link(link: Path, target: Path) -> None:
    """`link` -> `target` as a relative symlink, replaced atomically (a new link, then a rename)."""
    import os

    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(os.path.relpath(Path(target).resolve(), link.parent.resolve()), tmp)
    os.replace(tmp, link)


def start_invocation(out: Path, argv: list[str]) -> dict:
    """Append this call to `<out>/invocations.json` (a run resumed after a kill has several; one
    that never finished has no `finished`): the commit, the start and the machine's load."""
    import datetime as dt
    import os

    from candidate_gen.files import current_commit

    inv = {"commit": current_commit(), "argv": argv, "started": dt.datetime.now(dt.timezone.utc).isoformat(
        timespec="seconds"), "loadavg_start": list(os.getloadavg())}
    _save_invocations(out, read_invocations(out) + [inv])
    return inv


def finish_invocation(out: Path, inv: dict, seconds: float) -> list[dict]:
    import datetime as dt
    import os

    done = {**inv, "finished": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "seconds": seconds, "loadavg_end": list(os.getloadavg())}
    invs = [done if i == inv else i for i in read_invocations(out)]
    _save_invocations(out, invs)
    return invs


def public_argv(argv: list[str]) -> list[str]:
    """argv with the values of --data and --out replaced by DATA and RUN: paths of one machine."""
    roles = {"--data": "DATA", "--out": "RUN"}
    out, role = [], None  # role: what the previous flag's value is
    for a in argv:
        flag, eq, _ = a.partition("=")
        if role:
            out.append(role)
        elif eq and flag in roles:
            out.append(f"{flag}={roles[flag]}")
        else:
            out.append(a)
        role = roles.get(a)
    return out


def read_invocations(out: Path) -> list[dict]:
    path = Path(out) / "invocations.json"
    return json.loads(path.read_text()) if path.is_file() else []


def _save_invocations(out: Path, invs: list[dict]) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(out) / "invocations.json", json.dumps(invs, indent=2))


def recorded_seconds(out: Path, chain: list, table: list[dict], speed: dict | None) -> dict:
    """{step: seconds}, in the order the steps ran, from what each step wrote beside its output:
    retrieval's metrics, the data and conversion markers, each training run's stage_done.json, each
    choice's record (its averaging and evaluations), each evaluation report (a report reused for
    identical weights counts 0) and the speed run. `chain` lists the training part in order: lists of
    runs, and (name, selection record or None) for the steps between them."""
    from reranker.stages.base import read_done

    def marker(path: Path):
        return json.loads(path.read_text()).get("seconds") if path.is_file() else None

    ret = out / "retrieval" / "metrics.json"
    secs = {"retrieval": json.loads(ret.read_text()).get("wall_seconds") if ret.is_file() else None,
            "data": marker(out / "rerank_data" / ".pipeline_done.json")}
    for part in chain:
        if isinstance(part, tuple):
            name, record = part
            secs[name] = (marker(out / "models" / ".naive_done.json") if name == "convert"
                          else (record or {}).get("seconds"))
        else:
            secs.update({name: stage_seconds(read_done(r["output_dir"])) for name, r in run_labels(part)})
    secs["eval"] = sum(r.get("wall_seconds") or 0.0 for r in table if not r.get("same_weights_as"))
    secs["speed"] = (speed or {}).get("seconds")
    return {k: v for k, v in secs.items() if v is not None}


def stage_seconds(done: dict | None) -> float | None:
    """A finished stage's seconds: its last call's wall time, or, for a stage resumed after a kill,
    its training time summed over every attempt (the `train_seconds` its checkpoints carry) when
    that is larger."""
    if not done:
        return None
    return max(done.get("wall_seconds") or 0.0, (done.get("metrics") or {}).get("train_seconds") or 0.0)


def run_labels(runs: list[dict]) -> list[tuple[str, dict]]:
    """(label, run) per run: the run's setting name (`sft`, `copy_warmup`, ...), numbered from 1
    where a setting ran in several phases."""
    names = [Path(r["run_dir"]).name.split("_", 1)[-1] for r in runs]
    seen: dict[str, int] = {}
    out = []
    for name, r in zip(names, runs):
        seen[name] = seen.get(name, 0) + 1
        out.append((name if names.count(name) == 1 else f"{name}_{seen[name]}", r))
    return out


def _items_file(rs) -> Path:
    from candidate_gen.atomic import find_atomic_file

    src = rs.data_dir if rs.data_dir is not None else Path(rs.out) / "source"
    return find_atomic_file(src, "item")


# the eval config's decode settings (reranker.decoding's names); what it leaves out, the model records
EVAL_DECODE_KEYS = ("tau", "max_new_tokens", "commit_rule", "hold_eos")  # the eval section's decode settings


def _decode_options(ecfg: dict, decoder: str, model_dir=None):
    """The eval config's decode settings over what model_dir records over the defaults
    (reranker.decoding.resolve); an invalid one is an error naming it."""
    from reranker.decoding import recorded_in, resolve

    given = {k: ecfg.get(k) for k in EVAL_DECODE_KEYS}
    if decoder != "diffusion":  # the commit rule and EOS hold are diffusion settings; AR ignores them
        given.update(commit_rule=None, hold_eos=None)
    return resolve({**given, "decoder": decoder}, recorded_in(model_dir) if model_dir else None)


def evaluate_rows(rows, data_dir: Path, ecfg: dict, eval_dir: Path, run_missing: bool = True) -> list[dict]:
    """Evaluate each (label, model dir, decoder) on the same test users; CIs vs retriever and vs AR.
    A row whose report was made from the same weights, test file and settings is read back, not
    decoded again (its `eval_key`); run_missing=False: a row without one raises NotDoneError."""
    import numpy as np

    from reranker.eval.evaluate import check_list_orders, engine_for_split, evaluate, load_examples
    from reranker.eval.metrics import compare

    test_file = data_dir / f"{ecfg.get('split', 'test')}.jsonl"
    examples = load_examples(test_file, ecfg.get("limit"))
    test_hash = file_sha256(test_file)
    out, ar_ranks, by_key = [], None, {}
    for label, model_dir, decoder in rows:
        opts = _decode_options(ecfg, decoder, model_dir)
        # The resolved options, not the config subset: what a model directory records counts too.
        weights = model_sha256(model_dir)
        key = step_hash("eval", weights, test_hash, opts.hash_dict(),
                    {k: ecfg.get(k) for k in ("split", "limit", "batch_size")})
        path = eval_dir / f"{label.replace(' ', '_').replace('+', 'p')}.json"
        cached = json.loads(path.read_text()) if path.is_file() else None
        if cached is not None and cached.get("eval_key") == key:
            rep = {**cached, "model_sha256": weights}
            print(f"  eval {label}: up to date, skipped", flush=True)
        elif key in by_key:
            # A stage that kept its start (RL whose validation never improved) wrote the same weights:
            # greedy decoding of the same weights on the same users gives the same report.
            rep = {**by_key[key], "label": label, "model": str(model_dir), "same_weights_as": by_key[key]["label"]}
            atomic_write_text(path, json.dumps(rep, indent=2))
            print(f"  eval {label}: the same weights as {by_key[key]['label']}, its report reused", flush=True)
        else:
            if not run_missing:
                not_done(f"evaluation of {label!r} ({model_dir})", path)
            engine = engine_for_split(model_dir, data_dir, ecfg.get("split", "test"))
            check_list_orders(engine, examples, str(test_file))
            rep = evaluate(engine, examples, opts, int(ecfg.get("batch_size", 8)), workers=int(ecfg.get("workers", 1)))
            # model_sha256: the row's model by the sha256 of its weights, as a release names it
            rep.update(label=label, model=str(model_dir), eval_key=key, model_sha256=weights)
            atomic_write_text(path, json.dumps(rep, indent=2))
        by_key.setdefault(key, rep)
        if label == "AR GR2":
            ar_ranks = rep["ranks"]
        out.append(rep)
    for rep in out:
        if ar_ranks is not None and rep["label"] != "AR GR2":
            rep["vs_ar"] = compare(np.asarray(ar_ranks), np.asarray(rep["ranks"]))
    ar_tps = next((r["tokens_per_second"] for r in out if r["label"] == "AR GR2"), None)
    for rep in out:
        rep["speedup_vs_ar"] = rep["tokens_per_second"] / ar_tps if ar_tps else None
    return out


SPEED_KEYS = ("n_prompts", "repeats", "warmup", "threads")


def measure_final_speed(ar_dir: Path, diff_dir: Path, data_dir: Path, scfg: dict, ecfg: dict, path: Path,
                        run_missing: bool = True) -> dict:
    """The final student against its teacher at batch 1, side by side in this process (`dgr2 speed`'s
    measure_speed: same prompts, same threads, interleaved repeats, medians), at the evaluation's tau
    and decode settings. Read back when made from the same weights and settings."""
    from reranker.engine import RerankEngine
    from reranker.eval.evaluate import load_examples
    from reranker.eval.speed import speed_benchmark_from_engines

    opts = _decode_options(ecfg, "diffusion", diff_dir)
    settings = {k: scfg.get(k) for k in SPEED_KEYS}
    key = step_hash("speed", model_sha256(ar_dir), model_sha256(diff_dir), settings, opts.hash_dict(),
                {k: ecfg.get(k) for k in ("split",)})
    if path.is_file():
        cached = json.loads(path.read_text())
        if cached.get("speed_key") == key:
            print("  speed: up to date, skipped", flush=True)
            return cached
    if not run_missing:
        not_done("the batch-1 speed measurement", path)
    t0 = time.time()
    examples = load_examples(data_dir / f"{ecfg.get('split', 'test')}.jsonl", int(scfg.get("n_prompts", 8)))
    engine_ar, engine_diff = RerankEngine.load(ar_dir, data_dir), RerankEngine.load(diff_dir, data_dir)
    rep = speed_benchmark_from_engines(
        engine_ar, engine_diff, examples, n_prompts=int(scfg.get("n_prompts", 8)), accuracy=False,
        batch_sizes=(1,), taus=(opts.tau,), max_new_tokens=opts.max_new_tokens, repeats=int(scfg.get("repeats", 3)),
        warmup=int(scfg.get("warmup", 1)), threads=scfg.get("threads"), lengths=(), forward_blocks=(),
        commit_rule=opts.commit_rule, hold_eos=opts.hold_eos, window=opts.window, reuse_settled=opts.reuse_settled,
        lookup_drafts=opts.lookup_drafts, compute_dtype=opts.compute_dtype)
    # the student as it is served: with lookup drafts when it records them (the plain point is timed beside it)
    point = next(p for p in rep["batches"][0]["points"] if p["lookup_drafts"] == opts.lookup_drafts)
    out = {"seconds": time.time() - t0, "batch1_speedup": point["speedup"], "speedup_paired": point["speedup_paired"], "tau": opts.tau,
           "batch_size": 1, "commit_rule": opts.commit_rule, "hold_eos": opts.hold_eos,
           "lookup_drafts": opts.lookup_drafts,
           "ar_tokens_per_second": rep["batches"][0]["ar"]["tokens_per_second"]["median"],
           "diffusion_tokens_per_second": point["tokens_per_second"]["median"],
           "diffusion_tokens_per_step": point.get("tokens_per_step"),
           "n_prompts": rep["settings"]["n_prompts"], "repeats": rep["settings"]["repeats"],
           "torch_threads": rep["machine"].get("torch_threads"), "speed_key": key}
    if opts.lookup_drafts:  # the same student without the drafts, timed in the same repeats
        plain = next(p for p in rep["batches"][0]["points"] if not p["lookup_drafts"])
        out["without_lookup_drafts"] = {"batch1_speedup": plain["speedup"], "speedup_paired": plain["speedup_paired"],
                                        "diffusion_tokens_per_step": plain.get("tokens_per_step")}
    atomic_write_text(path, json.dumps(out, indent=2))
    return out


def format_summary(summary: dict) -> str:
    rows = summary["rows"]
    n_base = summary.get("baselines_info", {}).get("test_users")
    baselines = [{"name": n, **b["metrics"]} for n, b in summary.get("baselines", {}).items() if n != "retriever"]
    w = max([22] + [len(r["name"]) for r in rows + baselines])  # the name column fits the longest name
    users = f"{summary.get('test_users')} {summary.get('split', 'test')} users"
    lines = [f"language-model rows and the retriever row: {users}; "
             f"baseline rows (random, co-purchase sorts, learned scorer): all {n_base or '?'} test users",
             f"{'row':{w}s} {'R@1':>7s} {'R@3':>7s} {'NDCG@3':>7s} {'valid':>7s} {'tok/s':>8s} {'speed-up':>8s}"
             f"  R@1 vs AR (95% CI)"]
    for r in rows[:1] + baselines + rows[1:]:
        valid = f"{r['valid_rate']:7.3f}" if r.get("valid_rate") is not None else f"{'-':>7s}"
        tps = f"{r['tokens_per_second']:8.1f}" if r.get("tokens_per_second") else f"{'-':>8s}"
        sp = f"{r['speedup_vs_ar']:.2f}x" if r.get("speedup_vs_ar") else "-"
        ci = r.get("vs_ar", {}) or {}
        ci = (f"  {ci['recall@1']['diff']:+.4f} [{ci['recall@1']['ci_low']:+.4f}, {ci['recall@1']['ci_high']:+.4f}]"
              if ci.get("recall@1") else "")
        kept = (f"  (kept its start on validation: the weights of {r['same_weights_as']})"
                if r.get("same_weights_as") else "")
        lines.append(f"{r['name']:{w}s} {r['recall@1']:7.4f} {r['recall@3']:7.4f} {r['ndcg@3']:7.4f} {valid} {tps} "
                     f"{sp:>8s}{ci}{kept}")
    steps = summary.get("stage_optimizer_steps") or {}
    if steps:
        lines.append("optimizer steps: " + ", ".join(f"{k} {v}" for k, v in steps.items()))
    sp = summary.get("speed")
    if sp:
        paired = sp.get("speedup_paired") or {}
        lines.append(f"speed, side by side at batch 1 (tau {sp['tau']}, {sp.get('commit_rule')} rule): final student "
                     f"{sp['batch1_speedup']:.2f}x its AR teacher (paired {paired.get('min', float('nan')):.2f}-"
                     f"{paired.get('max', float('nan')):.2f}x over {sp.get('repeats')} repeats, "
                     f"{sp.get('torch_threads')} threads)"
                     + (f", {sp['diffusion_tokens_per_step']:.2f} tokens per step"
                        if sp.get("diffusion_tokens_per_step") else ""))
        plain = sp.get("without_lookup_drafts")
        if plain:
            lines.append(f"  with lookup drafts; without them, in the same repeats: {plain['batch1_speedup']:.2f}x "
                         f"({plain['diffusion_tokens_per_step']:.2f} tokens per step)")
    return "\n".join(lines)
