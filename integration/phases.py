"""The recipe's training chains as data: phases, copy draws, and the validation pick of a model soup.

A stage setting in `stages:` is one mapping or a list of them (phases run in order, each starting
from the one before). A phase's `train_file` may name, beside files of the data directory,

    {copies: {trace_style: scan_brand, random_sids: true, relabel_last_code: true, seed: 14}}

a copy draw (reranker/data/copy_warmup.py), built once into `<data>/copies/` under a name made of
its settings, so two phases asking for the same draw share one file and two draws never collide.
Copy files live below the data directory's top level, so adding a draw for a later phase does not
change the data fingerprint of the stages that ran before it (reranker/stages/pipeline.py hashes
each copy file a stage reads into that stage's identity instead).

`choose_teacher` / `choose_student` ({average_last: [1, 2, 4], metric: recall@1, within: 0.01}): the
candidates are the last phase's model and the uniform weight averages of the last k phases' models;
each is evaluated on the held-out selection users (valid.jsonl, never the test split) and the best by
`metric` (then valid rate, then the fewer members) is what the next stage starts from. `within`
(default 0): candidates whose metric is that close to the best count as tied on it, so the valid
rate decides among them; set it to what the selection split resolves.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

# the `stages` settings, in the order they run
STAGE_KEYS = ("copy_warmup", "sft", "choose_teacher", "ar_rl", "cft", "choose_student", "opd", "rl")
COPIES_DIR = "copies"
COPY_BUILD_KEYS = ("full_prompt", "random_sids", "straight", "lookup", "trace_style", "relabel_last_code",
                   "uniform_pick", "limit", "seed")
CHOOSE_KEYS = ("average_last", "metric", "within", "limit")
MODEL_KEYS = ("size", "base", "qk_norm_gain")
CHOOSE_METRICS = ("recall@1", "ndcg@3", "valid_rate")


def check_model_section(model: dict) -> None:
    """The config's `model` section: known keys, and a gain only for a fresh model (init_model)."""
    from reranker.model import DEFAULT_QK_NORM_GAIN, check_qk_norm_gain

    bad = sorted(set(model) - set(MODEL_KEYS))
    if bad:
        raise ValueError(f"model: unknown key(s) {bad}; allowed: {list(MODEL_KEYS)}")
    try:
        check_qk_norm_gain(model.get("qk_norm_gain", DEFAULT_QK_NORM_GAIN), model.get("base"))
    except ValueError as err:
        raise ValueError(f"model.{err}") from None


def check_copy_build(build, where: str) -> None:
    """A copy draw's settings: a mapping of known keys; `where` names the setting in errors."""
    if not isinstance(build, dict):
        raise ValueError(f"{where}: expected a mapping of copy settings, got {build!r}")
    bad = sorted(set(build) - set(COPY_BUILD_KEYS))
    if bad:
        raise ValueError(f"{where}: unknown key(s) {bad}; allowed: {list(COPY_BUILD_KEYS)}")


def copy_file(build: dict, data_dir: Path, seed: int, where: str) -> str:
    """The data-dir-relative name of the copy draw `build` (built on first use); `where` names the
    setting in errors. `seed` in `build` picks the draw (default: the run's seed)."""
    from reranker.data.copy_warmup import build_copy_warmup

    check_copy_build(build, where)
    build = {**build, "seed": int(build["seed"] if build.get("seed") is not None else seed)}  # always named
    parts = [f"{k}{'' if build[k] is True else build[k]}" for k in sorted(build)
             if build[k] is not None and build[k] is not False]
    name = f"{COPIES_DIR}/copy-" + "-".join(parts) + ".jsonl"
    if not (data_dir / name).is_file():
        (data_dir / COPIES_DIR).mkdir(parents=True, exist_ok=True)
        opts = {k: v for k, v in build.items() if k != "seed"}
        build_copy_warmup(data_dir, out_path=data_dir / name, seed=build["seed"], **opts)
    return name


def _copy_entries(value, where: str) -> list[tuple[int, dict | None]]:
    """(index, copy settings or None for a file name) of each `train_file` entry, checked."""
    entries = value if isinstance(value, list) else [value]
    out = []
    for j, f in enumerate(entries):
        if isinstance(f, dict):
            if set(f) != {"copies"}:
                raise ValueError(f"{where}.train_file[{j}]: a mapping entry must be {{copies: {{...}}}}, got {f!r}")
            check_copy_build(f["copies"] or {}, f"{where}.train_file[{j}].copies")
            out.append((j, f["copies"] or {}))
        else:
            out.append((j, None))
    return out


def _train_files(value, data_dir: Path, seed: int, where: str):
    """`train_file` with every {copies: {...}} entry replaced by its built file's name."""
    entries = value if isinstance(value, list) else [value]
    out = [entries[j] if build is None else copy_file(build, data_dir, seed, f"{where}.train_file[{j}].copies")
           for j, build in _copy_entries(value, where)]
    return out if isinstance(value, list) else out[0]


def _phases(setting, label: str) -> list[tuple[str, dict]]:
    """(where, phase) of a stage setting: one mapping, or a non-empty list of them."""
    phases = setting if isinstance(setting, list) else [setting or {}]
    if not phases:
        raise ValueError(f"stages.{label}: an empty list of phases (leave the setting out to skip the stage)")
    out = []
    for i, phase in enumerate(phases):
        where = f"stages.{label}" + (f"[{i}]" if isinstance(setting, list) else "")
        if not isinstance(phase, dict):
            raise ValueError(f"{where}: expected a mapping of settings, got {phase!r}")
        out.append((where, phase))
    return out


def check_stages(stages) -> None:
    """Every setting of a recipe's `stages` checked before anything runs: the stage names, each
    phase's keys against its stage's defaults, copy draws and choices. A typo in `rl` would
    otherwise surface hours into a run, when its chain starts."""
    from reranker.stages.base import merge_config
    from reranker.stages.registry import get_stage_class

    if not isinstance(stages, dict):
        raise ValueError(f"stages: expected a mapping of stage settings, got {stages!r}")
    unknown = sorted(set(stages) - set(STAGE_KEYS))
    if unknown:
        raise ValueError(f"stages: unknown key(s) {unknown}; allowed, in the order they run: {list(STAGE_KEYS)}")
    for key, setting in stages.items():
        if key.startswith("choose_"):
            check_choose(setting, key)
            continue
        defaults = get_stage_class("sft" if key == "copy_warmup" else key)().default_config()
        for where, phase in _phases(setting, key):
            phase = dict(phase)
            if key == "copy_warmup":
                check_copy_build(phase.pop("build", None) or {}, f"{where}.build")
            if "train_file" in phase:
                _copy_entries(phase["train_file"], where)
            merge_config(defaults, phase, where)


def phase_specs(stage: str, setting, data_dir: Path, seed: int, first_index: int, label: str | None = None,
                defaults: dict | None = None) -> list[dict]:
    """Run specs (reranker.stages.pipeline.run_pipeline) of one stage setting: a mapping, or a list of
    phases; `defaults` fill what a phase leaves out. Run dirs are numbered from `first_index` so
    chains built in several calls never share one."""
    label = label or stage
    specs = []
    for i, (where, phase) in enumerate(_phases(setting, label)):
        conf = {**(defaults or {}), **phase}
        if "train_file" in conf:
            conf["train_file"] = _train_files(conf["train_file"], data_dir, seed, where)
        specs.append({"name": stage, "id": f"{first_index + i:02d}_{label}", "config": conf})
    return specs


def copy_warmup_specs(setting, data_dir: Path, seed: int, first_index: int = 1) -> list[dict]:
    """`copy_warmup`: sft phases over copy examples; each phase's `build` picks its draw."""
    out = []
    for where, phase in _phases(setting, "copy_warmup"):
        phase = dict(phase)
        name = copy_file(phase.pop("build", None) or {}, data_dir, seed, f"{where}.build")
        out.append({"train_file": name, "valid_file": None, **phase})
    return phase_specs("sft", out, data_dir, seed, first_index, label="copy_warmup")


def check_choose(setting, where: str) -> dict:
    if not isinstance(setting, dict):
        raise ValueError(f"stages.{where}: expected a mapping like {{average_last: [1, 2]}}, got {setting!r}")
    bad = sorted(set(setting) - set(CHOOSE_KEYS))
    if bad:
        raise ValueError(f"stages.{where}: unknown key(s) {bad}; allowed: {list(CHOOSE_KEYS)}")
    ks = setting.get("average_last", [1])
    if not (isinstance(ks, list) and ks and all(isinstance(k, int) and k >= 1 for k in ks)):
        raise ValueError(f"stages.{where}.average_last: expected a list of member counts >= 1, got {ks!r}")
    metric = setting.get("metric", "recall@1")
    if metric not in CHOOSE_METRICS:
        raise ValueError(f"stages.{where}.metric: expected one of {list(CHOOSE_METRICS)}, got {metric!r}")
    within = setting.get("within", 0.0)
    if isinstance(within, bool) or not isinstance(within, (int, float)) or not 0 <= within < 1:
        raise ValueError(f"stages.{where}.within: expected a number in [0, 1), got {within!r}")
    return {"average_last": sorted(set(ks)), "metric": metric, "within": float(within), "limit": setting.get("limit")}


def pick_candidate(reports: list[dict], metric: str, within: float = 0.0) -> int:
    """The index of the chosen report: the highest valid rate among those whose `metric` is within
    `within` of the best, then the better metric, then the earlier (fewer members)."""
    top = max(r[metric] for r in reports)
    tied = [i for i, r in enumerate(reports) if r[metric] >= top - within - 1e-12]
    return max(tied, key=lambda i: (reports[i]["valid_rate"], reports[i][metric], -i))


def choose_on_validation(where: str, setting, runs: list[dict], data_dir: Path, ecfg: dict, out: Path,
                         decoder: str, evaluate_rows, run_missing: bool = True) -> tuple[Path, dict]:
    """The model the chain continues from (see the module docstring) and the record of the choice.
    Averages go to `<out>/models/<where>-avg<k>`; the candidates' reports to `<out>/selection/<where>/`.
    `evaluate_rows`: the pipeline's row evaluation (integration.pipeline.evaluate_rows); run_missing=False:
    read back only (NotDoneError for an average or evaluation not made yet)."""
    from reranker.model import average_models
    from reranker.stages.pipeline import model_fingerprint

    from .step_markers import mark_step, not_done, step_done, step_hash

    c = check_choose(setting, where)
    outputs = [Path(r["output_dir"]) for r in runs]
    candidates = []
    seconds = 0.0  # the averaging and the candidates' evaluations, as recorded with their outputs
    for k in c["average_last"]:
        if k > len(outputs):
            raise ValueError(f"stages.{where}.average_last: {k} members asked, the chain has {len(outputs)} runs")
        if k == 1:
            candidates.append(("last run", outputs[-1]))
            continue
        members = outputs[-k:]
        avg = out / "models" / f"{where}-avg{k}"
        h = step_hash("average", [model_fingerprint(m) for m in members])
        if not step_done(avg / ".average_done.json", h):
            if not run_missing:
                not_done(f"{where}: the average of the last {k} runs", avg)
            print(f"  {where}: averaging the last {k} runs", flush=True)
            t0 = time.time()
            average_models(members, avg)
            mark_step(avg / ".average_done.json", h, members=[str(m) for m in members], seconds=time.time() - t0)
        seconds += json.loads((avg / ".average_done.json").read_text()).get("seconds") or 0.0
        candidates.append((f"average of the last {k}", avg))
    ecfg = {**ecfg, "split": "valid", "limit": c["limit"]}
    reps = evaluate_rows([(name, d, decoder) for name, d in candidates], data_dir, ecfg, out / "selection" / where,
                         run_missing)
    best = pick_candidate(reps, c["metric"], c["within"])
    seconds += sum(r.get("wall_seconds") or 0.0 for r in reps if not r.get("same_weights_as"))
    record = {"metric": c["metric"], "within": c["within"], "split": "valid", "n": reps[0]["n"],
              "chosen": candidates[best][0],
              "seconds": seconds,
              "model": os.path.relpath(Path(candidates[best][1]).resolve(), out.resolve()),
              "candidates": [{"name": n, "model_sha256": r["model_sha256"],
                              **{m: r[m] for m in ("recall@1", "ndcg@3", "valid_rate")}}
                             for (n, _), r in zip(candidates, reps)]}
    print(f"  {where}: {record['chosen']} chosen on {record['n']} validation lists "
          + ", ".join(f"{x['name']} {x[c['metric']]:.4f}" for x in record["candidates"]), flush=True)
    return candidates[best][1], record
