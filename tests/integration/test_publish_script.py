"""scripts/publish-beauty.sh with a stand-in `dgr2` that logs its calls: every step runs once, in
order; a second call skips them all; a failed step stops the script and is redone on the next call."""
import os
import stat
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "publish-beauty.sh"


def fake_dgr2(tmp_path: Path, fail_on: str = "") -> Path:
    fake = tmp_path / "dgr2"
    fake.write_text(f"""#!/usr/bin/env bash
echo "$*" >> "{tmp_path}/calls.log"
if [[ -n "{fail_on}" && "$*" == *"{fail_on}"* ]]; then exit 3; fi
if [[ "$1" == serve ]]; then exec sleep 30; fi  # exec: a TERM ends it at once
exit 0
""")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return fake


def run(tmp_path, fake, **env):
    return subprocess.run(["bash", str(SCRIPT), str(tmp_path / "run")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "DGR2": str(fake), **env})


def test_publish_runs_every_step_once_and_resumes(tmp_path):
    fake = fake_dgr2(tmp_path)
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    for old in ("stages-beauty.json", "service-load.json", "forward-cost-cpu-2threads.json"):
        (results / old).write_text("{}")
    first = run(tmp_path, fake)
    assert first.returncode == 0, first.stderr
    calls = (tmp_path / "calls.log").read_text().splitlines()
    # the earlier Beauty results go to the archive first; a machine cost table of no model stays
    assert calls[0] == "bench --archive docs/results/stages-beauty.json docs/results/service-load.json"
    firsts = [c.split()[0] for c in calls[1:]]
    order = ["pipeline", "results", "baselines", "report", "release", "eval", "speed", "e2e", "bench"]
    assert [c for c in dict.fromkeys(firsts) if c in order] == order
    (table,) = [c for c in calls if c.startswith("pipeline")]
    assert "--summary-only" in table  # publishing reads the run back; it never trains
    e2e = [c for c in calls if c.startswith("e2e")]
    assert len(e2e) == 2 and "--add-to" not in e2e[0] and "--add-to" in e2e[1]  # a step per re-ranker
    assert sum(c.startswith("serve ") for c in calls) == 2  # the teacher and the student, each its own server
    (load,) = [c for c in calls if c.startswith("loadtest")]
    assert "ar=127.0.0.1:50061,diffusion=127.0.0.1:50062" in load and "--n 5000" in load
    # finished configurations are kept in docs/results, one file per release, so a stopped call resumes
    assert "--resume-file docs/results/service-load-runs-" in load  # committed: any machine resumes it
    assert any(c.startswith("e2e") and "--run " + str(tmp_path / "run") in c for c in calls)
    markers = sorted(p.name for p in (tmp_path / "run" / "publish").iterdir())
    assert "loadtest.done" in markers and "bench.done" in markers
    second = run(tmp_path, fake)
    assert second.returncode == 0 and (tmp_path / "calls.log").read_text().splitlines() == calls
    assert "done before, skipped" in second.stdout


def test_a_failed_step_stops_the_script_and_runs_again_next_time(tmp_path):
    first = run(tmp_path, fake_dgr2(tmp_path, fail_on="release"))
    assert first.returncode == 3
    assert not (tmp_path / "run" / "publish" / "release.done").exists()
    assert (tmp_path / "run" / "publish" / "table.done").exists()
    (tmp_path / "calls.log").unlink()
    again = run(tmp_path, fake_dgr2(tmp_path))
    assert again.returncode == 0
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert calls[0].startswith("release") and not any(c.startswith("pipeline") for c in calls)


def test_only_runs_the_named_steps_and_leaves_the_others_unmarked(tmp_path):
    done = run(tmp_path, fake_dgr2(tmp_path), ONLY="loadtest,bench")
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert [c.split()[0] for c in calls if not c.startswith(("serve", "client"))] == ["loadtest", "bench"]
    markers = sorted(p.name for p in (tmp_path / "run" / "publish").iterdir() if p.suffix == ".done")
    assert markers == ["bench.done", "loadtest.done"]
    assert "[release] not in ONLY=loadtest,bench, skipped" in done.stdout
