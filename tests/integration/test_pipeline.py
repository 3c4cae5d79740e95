"""`dgr2 pipeline` end to end on tiny synthetic data and tiny models, and its skip-when-done."""
import json
from pathlib import Path

import pytest

from integration.pipeline import format_summary, run_full_pipeline

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16, "intermediate_size": 64, "max_position_embeddings": 1024}


@pytest.fixture(scope="module")
def config(tmp_path_factory, tiny_catalog):
    out = tmp_path_factory.mktemp("pipe") / "out"
    return {
        "name": "tiny", "seed": 0, "out": str(out),
        "data": {"dir": str(tiny_catalog)},
        "retrieval": {"crossfit_folds": 2, "sasrec": {"epochs": 1, "hidden_size": 16, "inner_size": 32, "n_layers": 1,
                                                      "n_heads": 1, "train_batch_size": 256,
                                                      "MAX_ITEM_LIST_LENGTH": 20}},
        "rerank_data": {"n_selection_users": 60, "tokenizer_vocab": 500, "max_train_examples": 40},
        "model": {"size": TINY},
        "convert": {"block_size": 8, "decode": {"commit_rule": "prefix", "hold_eos": True}},
        "stages": {
            "copy_warmup": {"epochs": 1, "batch_size": 8},
            # two phases, the second on the lists mixed with a copy draw; the teacher is the better on
            # validation of the last phase and the average of both
            "sft": [{"epochs": 1, "batch_size": 8, "max_valid_examples": 8},
                    {"train_file": ["train.jsonl", {"copies": {"random_sids": True, "seed": 3}}], "epochs": 1,
                     "batch_size": 8, "max_valid_examples": 8}],
            "choose_teacher": {"average_last": [1, 2]},
            "ar_rl": {"steps": 1, "prompts_per_step": 1, "group_size": 2, "max_valid_examples": 4,
                      "max_new_tokens": 16, "max_draw_rounds": 1},
            "cft": [{"max_steps": 2, "batch_size": 8, "max_valid_examples": 8, "decode_examples": 2},
                    {"max_steps": 2, "batch_size": 8, "max_valid_examples": 8, "decode_examples": 2,
                     "suffix_fraction": 0.5}],
            "choose_student": {"average_last": [1, 2], "metric": "valid_rate", "limit": 4},
            "opd": {"max_steps": 1, "batch_size": 1, "group_size": 2, "max_new_tokens": 16, "eval_examples": 2,
                    "max_valid_examples": 4},
            "rl": {"steps": 1, "prompts_per_step": 1, "group_size": 2, "max_valid_examples": 4,
                   "max_new_tokens": 16, "max_draw_rounds": 1},
        },
        "eval": {"limit": 6, "batch_size": 3, "max_new_tokens": 16, "n_boot": 50},
        "speed": {"n_prompts": 2, "repeats": 1, "warmup": 0},
    }


def test_pipeline_runs_every_stage_then_skips(config, capsys):
    summary = run_full_pipeline(config)
    names = [r["name"] for r in summary["rows"]]
    assert names == ["retriever order", "AR GR2 (sft)", "AR GR2", "naive conversion", "+CFT", "+CFT+OPD",
                     "+CFT+OPD+RL"]
    for row in summary["rows"][1:]:
        assert 0.0 <= row["recall@1"] <= 1.0 and 0.0 <= row["valid_rate"] <= 1.0
        assert row["tokens_per_second"] > 0
    assert "retriever order" in format_summary(summary)
    assert list(summary["stage_wall_seconds"]) == ["copy_warmup", "sft_1", "sft_2", "ar_rl", "cft_1", "cft_2", "opd",
                                                   "rl"]
    assert (Path(config["out"]) / "rerank_data" / "copies" / "copy-random_sids-seed3.jsonl").is_file()
    assert list(summary["stage_seconds"]) == ["retrieval", "data", "copy_warmup", "sft_1", "sft_2", "choose_teacher",
                                              "ar_rl", "convert", "cft_1", "cft_2", "choose_student", "opd", "rl",
                                              "eval", "speed"]
    assert all(v > 0 for v in summary["stage_seconds"].values())
    assert summary["total_seconds"] == pytest.approx(sum(summary["stage_seconds"].values()))
    # the choices were made on the selection users, every candidate's figures recorded
    sel = summary["selection"]
    assert [c["name"] for c in sel["teacher"]["candidates"]] == ["last run", "average of the last 2"]
    assert sel["teacher"]["split"] == "valid" and sel["student"]["n"] == 4 and sel["student"]["metric"] == "valid_rate"
    best = max(c["valid_rate"] for c in sel["student"]["candidates"])
    assert next(c for c in sel["student"]["candidates"] if c["name"] == sel["student"]["chosen"])["valid_rate"] == best
    assert summary["rows"][1]["model_sha256"] == next(c["model_sha256"] for c in sel["teacher"]["candidates"]
                                                      if c["name"] == sel["teacher"]["chosen"])
    sp = summary["speed"]
    assert sp["batch_size"] == 1 and sp["tau"] == 0.9 and sp["batch1_speedup"] > 0 and sp["repeats"] == 1
    assert "side by side at batch 1" in format_summary(summary)
    # The decode settings given at conversion are recorded in the student and used by every
    # diffusion row's evaluation and the speed run (the eval section sets none).
    out = Path(config["out"])
    assert json.loads((out / "models" / "student" / "config.json").read_text())["decode_settings"] == {
        "decoder": "diffusion", "commit_rule": "prefix", "hold_eos": True}
    for name in ("naive_conversion", "pCFT", "pCFTpOPDpRL"):
        rep = json.loads((out / "eval" / f"{name}.json").read_text())
        assert (rep["decoder"], rep["commit_rule"], rep["hold_eos"]) == ("diffusion", "prefix", True)
    assert (sp["commit_rule"], sp["hold_eos"]) == ("prefix", True)
    # Every model row names its weights by sha256, as `sha256sum` prints it for the one weights file.
    import hashlib
    student_weights = (out / "models" / "student" / "model.safetensors").read_bytes()
    assert summary["rows"][-1]["model_sha256"] == hashlib.sha256(student_weights).hexdigest()
    assert all(len(r["model_sha256"]) == 64 for r in summary["rows"][1:])
    # rows name their models relative to the run directory (the run can move; `dgr2 release` reads them)
    assert all(not Path(r["model"]).is_absolute() and (out / r["model"] / "config.json").is_file()
               for r in summary["rows"][1:])
    capsys.readouterr()
    again = run_full_pipeline(config)
    log = capsys.readouterr().out
    assert "retrieval: up to date, skipped" in log and "data: up to date, skipped" in log
    assert [r["recall@1"] for r in again["rows"]] == [r["recall@1"] for r in summary["rows"]]
    # Training stages were skipped too: the stage outputs carry the first run's wall-clock.
    assert again["stage_wall_seconds"] == summary["stage_wall_seconds"]
    assert "skipped" in log
    # and every evaluation and the speed run were read back, not decoded again
    assert log.count("up to date, skipped") >= 2 + len(summary["rows"]) - 1 + 1, log
    assert "eval +CFT+OPD+RL: up to date, skipped" in log and "speed: up to date, skipped" in log
    assert "averaging" not in log and again["selection"] == summary["selection"]
    # a skipped step keeps the seconds recorded by the run that made it
    assert again["stage_seconds"] == summary["stage_seconds"]
    assert again["speed"] == sp


def test_summary_only_reads_a_finished_run_back_and_runs_nothing(config, tmp_path, capsys):
    """`dgr2 pipeline --summary-only` (what publishing a finished run calls): the summary of the run
    as it is, no step run and no call recorded; a step made from other settings stops it with one
    line naming that step, before it trains."""
    from integration.cli import main

    out = Path(config["out"])
    run_full_pipeline(config)  # the module's run, finished (made by the test above when run with it)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text(json.dumps(config))  # YAML reads JSON
    record, results = tmp_path / "record.json", tmp_path / "stages.json"
    capsys.readouterr()
    assert main(["pipeline", "--config", str(cfg_file), "--summary-only", "--record", str(record),
                 "--results", str(results)]) == 0
    log = capsys.readouterr().out
    assert "skipped" in log and "averaging" not in log
    assert json.loads(results.read_text())["rows"] == json.loads((out / "summary.json").read_text())["rows"]
    assert json.loads(record.read_text())["invocations"] == []  # the module's run was not a CLI call
    changed = {p for p in out.rglob("*") if p.is_file() and before.get(p) != p.stat().st_mtime_ns}
    assert {p.name for p in changed} <= {"summary.json", "stages.png"}, changed  # the summary, nothing else
    other = {**config, "stages": {**config["stages"], "rl": {**config["stages"]["rl"], "lr": 1e-3}}}
    cfg_file.write_text(json.dumps(other))
    (rl_done,) = (out / "runs" / "diffusion").glob("*_rl/model/stage_done.json")
    done_before = rl_done.read_text()
    assert main(["pipeline", "--config", str(cfg_file), "--summary-only"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stage 'rl'" in err[0] and "made from other settings or inputs" in err[0], err
    assert rl_done.read_text() == done_before


def test_the_record_names_data_and_run_directories_by_role():
    from integration.pipeline import public_argv

    argv = ["pipeline", "--config", "c.yaml", "--data", "/srv/x", "--out=/tmp/run", "--record", "r.json"]
    assert public_argv(argv) == ["pipeline", "--config", "c.yaml", "--data", "DATA", "--out=RUN", "--record", "r.json"]


def test_data_written_in_an_older_format_is_built_again(config, tmp_path, monkeypatch, capsys):
    """A run directory from before a change to the rendered text (the data FORMAT) must not pass as
    up to date: its prompts and traces are not what the code now writes and serves."""
    import reranker.data.dataset as dataset

    cfg = {**config, "out": str(tmp_path / "out")}
    run_full_pipeline(cfg, only_until="data")
    capsys.readouterr()
    run_full_pipeline(cfg, only_until="data")
    assert "data: up to date, skipped" in capsys.readouterr().out
    monkeypatch.setattr(dataset, "FORMAT", dataset.FORMAT + "-next")
    run_full_pipeline(cfg, only_until="data")
    log = capsys.readouterr().out
    assert "retrieval: up to date, skipped" in log and "data: up to date" not in log
    assert "data: semantic IDs, tokenizer, teacher traces" in log


def test_pipeline_runs_on_a_dataset_without_brand_timestamps_or_titles(config, tiny_catalog, tmp_path, caplog):
    """Many RecBole atomic datasets have no brand column, no real timestamps and no titles: the
    pipeline runs (retrieval, data, baselines, a training stage, evaluation), what is absent is
    left out of the prompts with one note in the log, and ties keep file order."""
    import copy
    import json
    import logging

    from candidate_gen.atomic import find_atomic_file, load_interactions
    from candidate_gen.split import filter_sequences
    from candidate_gen.synthetic import SyntheticConfig, write_synthetic
    from reranker.text.prompt import parse_candidate_evidence

    # The fixture's catalog, less its brands, titles and timestamps.
    bare = write_synthetic(tmp_path / "catalog", SyntheticConfig(n_users=300, seed=3, brand_column=False, titles=False,
                                                                 timestamps="tied"), name="tiny")
    cfg = copy.deepcopy(config)
    cfg.update(out=str(tmp_path / "out"), data={"dir": str(bare)}, stages={"sft": config["stages"]["sft"]})
    cfg.pop("speed")
    with caplog.at_level(logging.INFO):
        summary = run_full_pipeline(cfg)
    assert [r["name"] for r in summary["rows"]] == ["retriever order", "AR GR2", "naive conversion"]
    assert summary["rows"][1]["n"] > 0 and 0.0 <= summary["rows"][1]["valid_rate"] <= 1.0
    assert {"copurchase_recent_brand", "learned_scorer"} <= set(summary["baselines"])
    notes = [r.getMessage() for r in caplog.records if r.name in ("candidate_gen.atomic", "reranker.data.dataset")
             and ("timestamp" in r.getMessage() or "no item has" in r.getMessage())]
    assert len(notes) == 2, notes
    assert "every row has timestamp 0.0" in notes[0] and "no item has a title / brand" in notes[1]

    out = Path(cfg["out"])
    # Every timestamp ties: file order gives each user the sequence the real timestamps give.
    real = filter_sequences(load_interactions(find_atomic_file(tiny_catalog, "inter"))).by_user
    assert json.loads((out / "retrieval" / "sequences.json").read_text()) == real
    report = json.loads((out / "rerank_data" / "build_report.json").read_text())
    assert report["absent_item_fields"] == ["title", "brand"]
    for split in ("train", "test"):
        for line in (out / "rerank_data" / f"{split}.jsonl").read_text().splitlines():
            row = json.loads(line)
            prompt = row["prompt_messages"][1]["content"]
            assert "brand" not in prompt and "; category " in prompt
            assert len(parse_candidate_evidence(prompt, len(row["candidates"]))) == len(row["candidates"])


def test_copy_draws_and_phases_build_their_own_files(tmp_path):
    import json

    from integration.phases import check_choose, copy_warmup_specs, phase_specs
    from integration.pipeline import run_labels
    from tests.reranker.data.test_copy_warmup import SIDS

    rows = [{"candidate_sids": SIDS, "prompt_messages": [{"role": "user", "content": "x\nRank all 10."}],
             "assistant": "y"} for _ in range(3)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    specs = copy_warmup_specs([{"build": {"straight": 5}, "max_steps": 7},
                               {"build": {"full_prompt": True, "random_sids": True}, "lr": 1e-3}], tmp_path, 0)
    assert [s["id"] for s in specs] == ["01_copy_warmup", "02_copy_warmup"]
    assert [s["config"]["train_file"] for s in specs] == ["copies/copy-seed0-straight5.jsonl",
                                                          "copies/copy-full_prompt-random_sids-seed0.jsonl"]
    assert specs[0]["config"]["max_steps"] == 7 and "build" not in specs[0]["config"]
    assert len((tmp_path / "copies/copy-seed0-straight5.jsonl").read_text().splitlines()) == 5
    # copy draws live below the top level: the data fingerprint every stage shares is unchanged
    assert not list(tmp_path.glob("copy*.jsonl"))
    assert copy_warmup_specs({"epochs": 1}, tmp_path, 7)[0]["config"]["train_file"] == "copies/copy-seed7.jsonl"
    # seed 0 is a seed, not "no seed": a draw named without one would take the run's
    assert phase_specs("sft", {"train_file": {"copies": {"seed": 0}}}, tmp_path, 5, 1)[0]["config"][
        "train_file"] == "copies/copy-seed0.jsonl"
    # an sft phase mixes the real lists with a seeded draw; the same draw is one file, another seed another
    phases = phase_specs("sft", [{"train_file": ["train.jsonl", {"copies": {"random_sids": True, "seed": 3}}]},
                                 {"train_file": {"copies": {"random_sids": True, "seed": 3}}},
                                 {"train_file": [{"copies": {"random_sids": True, "seed": 4}}]}], tmp_path, 0, 3)
    assert [s["id"] for s in phases] == ["03_sft", "04_sft", "05_sft"]
    assert phases[0]["config"]["train_file"] == ["train.jsonl", "copies/copy-random_sids-seed3.jsonl"]
    assert phases[1]["config"]["train_file"] == "copies/copy-random_sids-seed3.jsonl"
    a, b = (tmp_path / "copies/copy-random_sids-seed3.jsonl"), (tmp_path / "copies/copy-random_sids-seed4.jsonl")
    assert a.read_text() != b.read_text()
    runs = [{"run_dir": f"r/{s['id']}"} for s in specs + phases]
    assert [n for n, _ in run_labels(runs)] == ["copy_warmup_1", "copy_warmup_2", "sft_1", "sft_2", "sft_3"]
    (spec,) = copy_warmup_specs({"build": {"random_sids": True, "limit": 2}}, tmp_path, 0)
    assert len((tmp_path / spec["config"]["train_file"]).read_text().splitlines()) == 2
    with pytest.raises(ValueError, match=r"stages.copy_warmup.build: unknown key\(s\) \['shuffle'\]"):
        copy_warmup_specs({"build": {"shuffle": True}}, tmp_path, 0)
    with pytest.raises(ValueError, match=r"copy_warmup\[1\]: expected a mapping"):
        copy_warmup_specs([{}, "fast"], tmp_path, 0)
    with pytest.raises(ValueError, match=r"stages.sft\[0\].train_file\[0\]: a mapping entry must be"):
        phase_specs("sft", [{"train_file": [{"copy": {}}]}], tmp_path, 0, 1)
    with pytest.raises(ValueError, match=r"choose_student.average_last: expected a list"):
        check_choose({"average_last": 2}, "choose_student")
    with pytest.raises(ValueError, match=r"choose_teacher.metric: expected one of"):
        check_choose({"metric": "loss"}, "choose_teacher")
    with pytest.raises(ValueError, match=r"choose_teacher.within: expected a number in \[0, 1\), got 'x'"):
        check_choose({"within": "x"}, "choose_teacher")


def test_pick_candidate_ties_within_the_resolution_go_to_the_valid_rate():
    from integration.phases import pick_candidate

    reps = [{"recall@1": 0.3405, "valid_rate": 0.9948}, {"recall@1": 0.3364, "valid_rate": 0.9985},
            {"recall@1": 0.3200, "valid_rate": 1.0}]
    assert pick_candidate(reps, "recall@1") == 0  # no tolerance: the best metric
    assert pick_candidate(reps, "recall@1", 0.01) == 1  # 0.3364 is within 0.01: the more valid one
    assert pick_candidate(reps, "recall@1", 0.05) == 2
    same = [{"recall@1": 0.3, "valid_rate": 0.99}, {"recall@1": 0.3, "valid_rate": 0.99}]
    assert pick_candidate(same, "recall@1", 0.01) == 0  # a full tie: the fewer members


def test_every_stage_setting_is_checked_before_the_run_starts(config, tmp_path):
    """A typo in a late stage fails the command at once, naming the setting, with nothing written;
    the shipped recipes pass the same check."""
    import copy

    from integration.config import load_config
    from integration.phases import check_stages

    cases = [({"rl": {"stpes": 3}}, r"stages\.rl'.*unknown config key 'stpes'"),
             ({"cft": [{}, {"train_file": ["train.jsonl", {"copies": {"sead": 1}}]}]},
              r"stages\.cft\[1\]\.train_file\[1\]\.copies: unknown key\(s\) \['sead'\]"),
             ({"opd": []}, r"stages\.opd: an empty list of phases"),
             ({"choose_student": {"metric": "loss"}}, r"choose_student\.metric"),
             ({"copy_warmup": {"build": {"straigth": 5}}}, r"stages\.copy_warmup\.build: unknown key"),
             ({"distill": {}}, r"stages: unknown key\(s\) \['distill'\]")]
    for bad, message in cases:
        cfg = copy.deepcopy(config)
        cfg.update(out=str(tmp_path / "out"), stages={**config["stages"], **bad})
        with pytest.raises(ValueError, match=message):
            run_full_pipeline(cfg)
        assert not (tmp_path / "out").exists()
    for path in sorted(Path(__file__).resolve().parents[2].glob("configs/*.yaml")):
        check_stages(load_config(path)["stages"])


def test_a_stage_reading_a_copy_draw_is_identified_by_its_content(tmp_path):
    from reranker.stages.pipeline import nested_file_fingerprints

    (tmp_path / "copies").mkdir()
    (tmp_path / "copies" / "c.jsonl").write_text("a\n")
    cfg = {"train_file": ["train.jsonl", "copies/c.jsonl"], "valid_file": "valid.jsonl"}
    before = nested_file_fingerprints(tmp_path, cfg)
    assert list(before) == ["copies/c.jsonl"]
    (tmp_path / "copies" / "c.jsonl").write_text("b\n")
    assert nested_file_fingerprints(tmp_path, cfg) != before
    assert nested_file_fingerprints(tmp_path, {"train_file": "train.jsonl"}) == {}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_quick_start_commands_work_on_what_the_pipeline_wrote(config):
    """The README's quick start, run as written against a pipeline run's output directory
    (`artifacts/demo` replaced by the tiny run's), the same way the RecBole snippet is tested."""
    import json
    import re
    import shlex
    import subprocess
    import sys
    import time

    run_full_pipeline(config)  # skipped when done
    out = Path(config["out"])
    for name in ("teacher", "student"):
        assert (out / "models" / name / "config.json").is_file(), name
    text = Path(__file__).resolve().parents[2].joinpath("README.md").read_text()
    block = re.search(r"<!-- quickstart -->\n```bash\n(.*?)```", text, re.S).group(1)
    port = str(_free_port())
    bin_dir = Path(sys.executable).parent
    lines = [ln.split("#")[0].strip() for ln in block.splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith((". ", "source "))]
    assert any(ln.startswith("dgr2 serve") for ln in lines) and any("client rerank" in ln for ln in lines)
    server = None
    outputs = []
    try:
        for ln in lines:
            ln = ln.replace("artifacts/demo", str(out)).replace("50051", port)
            if ln.startswith("kill"):
                server.terminate()
                assert server.wait(timeout=30) == 0
                server = None
                continue
            background = ln.endswith("&")
            argv = shlex.split(ln.rstrip("&").strip())
            argv[0] = str(bin_dir / argv[0])
            if background:
                server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                health = [str(bin_dir / "dgr2"), "client", "health", "--target", f"127.0.0.1:{port}", "--timeout", "2"]
                deadline = time.time() + 120
                while subprocess.run(health, capture_output=True).returncode != 0:
                    assert server.poll() is None, server.stderr.read()
                    assert time.time() < deadline, "server did not become healthy in 120 s"
                    time.sleep(0.5)
                continue
            res = subprocess.run(argv, capture_output=True, text=True, timeout=300)
            assert res.returncode == 0, f"{ln}\n{res.stdout}\n{res.stderr}"
            outputs.append((ln, res.stdout))
    finally:
        if server is not None:
            server.kill()
    answers = [json.loads(o) for ln, o in outputs if "client rerank" in ln]
    assert answers and all(len(a["items"]) == len(json.loads(
        (out / "rerank_data" / "test.jsonl").read_text().splitlines()[0])["candidates"]) for a in answers)
    assert any("Recall@1" in o or "recall@1" in o for ln, o in outputs if " eval " in ln)


def test_release_bundle_serves_evaluates_and_times_from_itself_alone(config, tmp_path):
    """`dgr2 release` on the pipeline run; the bundle moved to a fresh directory and the run renamed
    away, so nothing outside the bundle can be read: eval from the bundle gives the final diffusion
    row's ranks on the same users, a gRPC Rerank against `serve` on the bundle gives eval's ranking
    of the same prompt, speed runs, and release.json's sha256s match the files."""
    import hashlib
    import os
    import shutil
    import subprocess
    import sys
    import time

    from integration.cli import main
    from integration.release import ReleaseError, release, verify_release
    from reranker.engine import RerankEngine, RerankRequest
    from reranker.eval.evaluate import load_examples
    from reranker.service.client import RerankerClient, to_dict

    summary = run_full_pipeline(config)  # skipped when done
    out = Path(config["out"])
    staged = tmp_path / "staged" / "bundle"
    release(out, staged)
    with pytest.raises(ReleaseError, match="exists; give --force"):
        release(out, staged)
    doc = release(out, staged, force=True)  # replaced whole, no leftovers beside it
    assert sorted(p.name for p in staged.parent.iterdir()) == ["bundle"]
    assert {"teacher", "student"} == set(doc["models"]) and doc["total_bytes"] < 60e6
    names = set(doc["files"])
    assert {"student/model.safetensors", "teacher/config.json", "student/tokenizer.json", "test.jsonl",
            "copurchase.npz", "item_fields.json", "sids.json", "build_info.json", "MODEL_CARD.md",
            "metrics.json", "recipe.json"} <= names
    assert not any("stage_done" in n or "optimizer" in n or "checkpoint" in n for n in names), names
    # The saved evidence renders every test prompt exactly as the run's retrieval artifacts do.
    examples = load_examples(out / "rerank_data" / "test.jsonl")
    reqs = [RerankRequest(r["history"], r["candidates"], r.get("scores"), r.get("user")) for r in examples]
    run_engine = RerankEngine.load(out / "models" / "student", out / "rerank_data")
    bundle_engine = RerankEngine.load(staged / "student", staged)
    assert [bundle_engine.prompt_ids(r) for r in reqs] == [run_engine.prompt_ids(r) for r in reqs]
    del run_engine, bundle_engine

    final = summary["rows"][-1]
    final_report = json.loads((out / "eval" / "pCFTpOPDpRL.json").read_text())
    bundle = tmp_path / "fresh" / "amazon-tiny"
    bundle.parent.mkdir()
    shutil.move(str(staged), str(bundle))
    hidden = out.with_name(out.name + "-hidden")
    os.rename(out, hidden)  # the run is unreachable until the end of this test
    server = None
    try:
        metrics = json.loads((bundle / "metrics.json").read_text())
        student_sha = hashlib.sha256((bundle / "student" / "model.safetensors").read_bytes()).hexdigest()
        assert metrics["rows"][-1]["model_sha256"] == student_sha and metrics["rows"][-1]["shipped_as"] == "student"
        assert all(r["model_sha256"] for r in metrics["rows"][1:]) and metrics["rows"][0]["model_sha256"] is None
        assert doc["models"]["student"]["model_sha256"] == student_sha
        card = (bundle / "MODEL_CARD.md").read_text()
        recipe_sha = hashlib.sha256((bundle / "recipe.json").read_bytes()).hexdigest()
        assert metrics["recipe"] == {"file": "recipe.json", "sha256": recipe_sha} and recipe_sha in card
        # the settings, not where the run lived (a machine's path)
        shipped = json.loads((bundle / "recipe.json").read_text())
        assert "out" not in shipped and shipped["stages"] == json.loads((hidden / "recipe.json").read_text())["stages"]
        assert student_sha[:16] in card and "Side by side" in card and doc["commit"] in card

        report, outputs = tmp_path / "eval.json", tmp_path / "outputs.jsonl"
        ecfg = config["eval"]
        assert main(["eval", "--model", str(bundle / "student"), "--data", str(bundle), "--limit", str(final["n"]),
                     "--batch-size", str(ecfg["batch_size"]), "--max-new-tokens", str(ecfg["max_new_tokens"]),
                     "--out", str(report), "--outputs", str(outputs)]) == 0
        rep = json.loads(report.read_text())
        assert rep["n"] == final["n"] and rep["recall@1"] == final["recall@1"]
        assert rep["ranks"] == final_report["ranks"] and rep["valid_rate"] == final["valid_rate"]
        assert (rep["commit_rule"], rep["hold_eos"]) == ("prefix", True)  # what the student records

        assert main(["speed", "--ar", str(bundle / "teacher"), "--diffusion", str(bundle / "student"),
                     "--data", str(bundle), "--n-prompts", "1", "--batch-sizes", "1", "--taus", "0.9",
                     "--repeats", "1", "--warmup", "0", "--lengths", "", "--forward-blocks", "",
                     "--exact-decoders", "", "--no-accuracy", "--max-new-tokens", "16"]) == 0

        port = _free_port()
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        # no --data: a model inside a bundle serves with the bundle's data
        server = subprocess.Popen([sys.executable, "-m", "integration.cli", "serve", "--model", str(bundle / "student"),
                                   "--port", str(port)], cwd=tmp_path, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        row = json.loads((bundle / "test.jsonl").read_text().splitlines()[0])
        first = json.loads(outputs.read_text().splitlines()[0])
        with RerankerClient(f"127.0.0.1:{port}") as client:
            deadline = time.time() + 120
            while not client.wait_until_serving(timeout=2):
                assert server.poll() is None, server.stderr.read()
                assert time.time() < deadline, "server did not become healthy in 120 s"
            answer = to_dict(client.rerank(row["candidates"], row["history"], row.get("scores"), row.get("user") or "",
                                           max_new_tokens=ecfg["max_new_tokens"]))
        ranked = [it["item_id"] for it in sorted(answer["items"], key=lambda it: it["new_rank"])]
        assert ranked == [row["candidates"][i] for i in first["permutation"]]
    finally:
        if server is not None:
            server.kill()
            server.wait(timeout=30)
        os.rename(hidden, out)
    assert verify_release(bundle) == [] and main(["release", "--verify", str(bundle)]) == 0
    (bundle / "sids.json").write_text("{}")
    assert verify_release(bundle) == ["sids.json: sha256 or size differs from release.json"]
    assert main(["release", "--verify", str(bundle)]) == 1


def test_release_names_what_a_run_lacks_and_refuses_an_existing_bundle(tmp_path):
    from integration.release import ReleaseError, release

    run = tmp_path / "run"
    (run / "models" / "teacher").mkdir(parents=True)
    (run / "models" / "teacher" / "config.json").write_text("{}")
    (run / "rerank_data").mkdir()
    (run / "rerank_data" / "sids.json").write_text("{}")
    with pytest.raises(ReleaseError) as e:
        release(run, tmp_path / "bundle")
    msg = str(e.value)
    for piece in ("models/teacher/*.safetensors", "models/student/config.json", "rerank_data/build_info.json",
                  "rerank_data/test.jsonl", "summary.json", "eval/", "recipe.json"):
        assert piece in msg, piece
    assert "rerank_data/sids.json" not in msg
    assert not (tmp_path / "bundle").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    (tmp_path / "bundle").mkdir()
    with pytest.raises(ReleaseError, match=r"bundle: exists; give --force"):
        release(run, tmp_path / "bundle")
    with pytest.raises(ReleaseError, match="no such run directory"):
        release(tmp_path / "nowhere", tmp_path / "other")


def test_a_model_outside_a_bundle_needs_data(tmp_path):
    from reranker.engine import RerankEngine

    (tmp_path / "bundle" / "student").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"--data: needed, .*student is not inside a release bundle"):
        RerankEngine.data_dir_for(tmp_path / "bundle" / "student")
    (tmp_path / "bundle" / "release.json").write_text("{}")
    assert RerankEngine.data_dir_for(tmp_path / "bundle" / "student") == (tmp_path / "bundle").resolve()
    assert RerankEngine.data_dir_for(tmp_path / "bundle" / "student", "elsewhere") == Path("elsewhere")


def test_a_teacher_counts_by_its_weights_and_bookkeeping_files_are_not_data(tmp_path):
    """Two spellings of one teacher path give one stage identity (a resumed run may name its --out
    another way), and the data fingerprint ignores dotfiles (the pipeline's done-marker)."""
    import os

    from reranker.stages.pipeline import data_fingerprint, stage_identity

    teacher = tmp_path / "out" / "teacher"
    teacher.mkdir(parents=True)
    (teacher / "config.json").write_text("{}")
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "config.json").write_text("{}")
    other = os.path.relpath(teacher, os.getcwd())
    a = stage_identity("opd", {"teacher": str(teacher)}, 0, tmp_path / "in", None)
    assert a == stage_identity("opd", {"teacher": other}, 0, tmp_path / "in", None)
    (teacher / "model.safetensors").write_bytes(b"w")
    assert a != stage_identity("opd", {"teacher": str(teacher)}, 0, tmp_path / "in", None)
    (tmp_path / "train.jsonl").write_text("{}\n")
    before = data_fingerprint(tmp_path)
    (tmp_path / ".pipeline_done.json").write_text('{"seconds": 3.0}')
    assert data_fingerprint(tmp_path) == before
    (tmp_path / "valid.jsonl").write_text("{}\n")
    assert data_fingerprint(tmp_path) != before
