"""Stage plugins: a third-party package that declares an entry point in `diffusion_gr2.stages`
is found by name and runs in a pipeline after the real SFT stage; finished stages are skipped;
unknown names and config keys fail with clear errors."""
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from test_sft import FAST, make_sft_world
from reranker.stages.registry import UnknownStageError, available_stages, get_stage

torch.set_num_threads(1)

PLUGIN = '''
"""A third-party stage: copies the model and writes a note (stands in for any user stage)."""
from reranker.stages.base import Stage, StageResult


class NoteStage(Stage):
    name = "note"

    def default_config(self):
        return {"text": "hello"}

    def run(self, ctx):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if ctx.is_main:
            AutoModelForCausalLM.from_pretrained(str(ctx.input_dir)).save_pretrained(str(ctx.output_dir))
            AutoTokenizer.from_pretrained(str(ctx.input_dir)).save_pretrained(str(ctx.output_dir))
            (ctx.output_dir / "note.txt").write_text(ctx.config["text"])
        return StageResult(metrics={"chars": len(ctx.config["text"])}, optimizer_steps=0)
'''

PYPROJECT = '''
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "dgr2-note-stage"
version = "0.0.1"

[project.entry-points."diffusion_gr2.stages"]
note = "dgr2_note_stage:NoteStage"

[tool.setuptools]
py-modules = ["dgr2_note_stage"]
'''


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    """pip-install the plugin package into a private target dir (no network, no build isolation)."""
    root = tmp_path_factory.mktemp("plugin")
    src, site = root / "src", root / "site"
    src.mkdir()
    (src / "pyproject.toml").write_text(textwrap.dedent(PYPROJECT))
    (src / "dgr2_note_stage.py").write_text(textwrap.dedent(PLUGIN))
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--no-index", "--disable-pip-version-check", "--target", str(site), str(src)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert list(site.glob("dgr2_note_stage-*.dist-info/entry_points.txt"))
    return site


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return make_sft_world(tmp_path_factory.mktemp("stages"))


def test_unknown_stage_names_the_registered_ones():
    with pytest.raises(UnknownStageError) as exc:
        get_stage("sftt")
    msg = str(exc.value)
    assert "'sftt'" in msg and "sft" in msg and "diffusion_gr2.stages" in msg
    assert "sft" in available_stages()


def test_unknown_config_key_and_stage_fail_before_training(world, tmp_path):
    from reranker.stages.pipeline import run_pipeline

    init, data = world
    with pytest.raises(ValueError, match="unknown config key 'epochz'.*epochs"):
        run_pipeline([{"name": "sft", "config": {"epochz": 1}}], init, tmp_path / "runs", data,
                     progress=False, device="cpu")
    with pytest.raises(UnknownStageError, match="nope"):
        run_pipeline([{"name": "sft", "config": FAST}, {"name": "nope"}], init, tmp_path / "runs", data,
                     progress=False, device="cpu")
    assert not (tmp_path / "runs").exists()  # nothing ran


def test_plugin_stage_runs_after_sft_and_done_stages_are_skipped(world, plugin_site, tmp_path, monkeypatch, capsys):
    from transformers import AutoModelForCausalLM

    from reranker.stages.pipeline import run_pipeline

    monkeypatch.syspath_prepend(str(plugin_site))
    stage = get_stage("note")
    assert type(stage).__module__ == "dgr2_note_stage" and stage.default_config() == {"text": "hello"}
    assert {"sft", "note"} <= set(available_stages())

    init, data = world
    runs = tmp_path / "runs"
    specs = [{"name": "sft", "config": FAST}, {"name": "note", "config": {"text": "ranked"}}]

    def run(specs):
        return run_pipeline(specs, init, runs, data, progress=False, device="cpu")

    first = run(specs)
    assert [s["status"] for s in first] == ["done", "done"]
    assert first[0]["optimizer_steps"] == 4
    out = runs / "02_note" / "model"
    assert (out / "note.txt").read_text() == "ranked"
    done = json.loads((out / "stage_done.json").read_text())
    assert done["stage"] == "note" and done["metrics"] == {"chars": 6}
    # the plugin's input was the SFT output: identical weights
    a = AutoModelForCausalLM.from_pretrained(str(runs / "01_sft" / "model")).state_dict()
    b = AutoModelForCausalLM.from_pretrained(str(out)).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[")]
    assert len(lines) == 2 and lines[0].startswith("[1/2] sft: done") and lines[1].startswith("[2/2] note: done")

    again = run(specs)
    assert [s["status"] for s in again] == ["skipped", "skipped"]
    assert again[0]["metrics"] == first[0]["metrics"]

    # A changed downstream config reruns only that stage; a changed upstream config reruns both.
    specs[1]["config"] = {"text": "changed"}
    assert [s["status"] for s in run(specs)] == ["skipped", "done"]
    assert (out / "note.txt").read_text() == "changed"
    specs[0]["config"] = {**FAST, "lr": 1e-3}
    assert [s["status"] for s in run(specs)] == ["done", "done"]
    summary = json.loads((runs / "pipeline_summary.json").read_text())
    assert [s["output_dir"] for s in summary] == ["01_sft/model", "02_note/model"]
