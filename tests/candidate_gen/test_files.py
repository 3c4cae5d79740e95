"""candidate_gen.files, the shared I/O module: atomic writes, JSON lines, result files."""
import json
import os
import stat
from pathlib import Path

import pytest

import candidate_gen.files as files
from candidate_gen.files import (atomic_write_json, atomic_write_text, iter_jsonl, read_jsonl, read_results,
                                 replace_dir, write_dir_atomically, write_jsonl, write_result)


def test_atomic_write_text_makes_parents_leaves_no_temp_and_is_world_readable(tmp_path):
    path = atomic_write_text(tmp_path / "a" / "b.txt", "x")
    atomic_write_text(path, "y")
    assert path.read_text() == "y"
    assert os.listdir(path.parent) == ["b.txt"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_atomic_write_json_is_sorted_and_indented(tmp_path):
    assert atomic_write_json(tmp_path / "d.json", {"b": 1, "a": 2}).read_text() == '{\n  "a": 2,\n  "b": 1\n}\n'


def test_replace_dir_and_write_dir_atomically_swap_whole_directories(tmp_path):
    dst = tmp_path / "model"
    write_dir_atomically(dst, lambda d: (d.mkdir(), (d / "old.txt").write_text("1")))
    src = tmp_path / "new"
    src.mkdir()
    (src / "new.txt").write_text("2")
    assert replace_dir(src, dst) == dst
    assert os.listdir(dst) == ["new.txt"] and not src.exists()
    write_dir_atomically(dst, lambda d: (d.mkdir(), (d / "third.txt").write_text("3")))
    assert os.listdir(dst) == ["third.txt"]
    assert sorted(os.listdir(tmp_path)) == ["model"]  # no .tmp- or .old- directories left


_KILLED_MID_SAVE = """
import os, signal, sys
from candidate_gen.files import write_dir_atomically

def save(d):
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"half")
    os.kill(os.getpid(), signal.SIGKILL)  # as a machine loss would: no finally, no cleanup

write_dir_atomically(sys.argv[1], save)
"""


def _killed_save(dst) -> list[str]:
    """Names beside `dst` after a writer of `dst` was SIGKILLed mid-save."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-c", _KILLED_MID_SAVE, str(dst)], cwd=repo,
                         env={**os.environ, "PYTHONPATH": str(repo)}, capture_output=True, text=True)
    assert res.returncode == -9, res.stderr
    return sorted(os.listdir(dst.parent))


def test_a_save_killed_midway_leaves_a_temp_dir_that_the_next_write_removes(tmp_path):
    """A kill during a stage's best-model save left `.model.partial.tmp-*` behind for good."""
    dst = tmp_path / "model.partial"
    left = _killed_save(dst)
    assert len(left) == 1 and left[0].startswith(".model.partial.tmp-"), left
    write_dir_atomically(dst, lambda d: (d.mkdir(), (d / "w.txt").write_text("1")))
    assert sorted(os.listdir(tmp_path)) == ["model.partial"]
    # The stage finishes without another save: promoting `<out>.partial` to `<out>` sweeps it too.
    _killed_save(dst)
    assert replace_dir(dst, tmp_path / "model") == tmp_path / "model"
    assert sorted(os.listdir(tmp_path)) == ["model"]


def test_sweep_keeps_what_a_live_process_is_writing(tmp_path):
    dst = tmp_path / "m"
    mine = tmp_path / f".m.tmp-{os.getpid()}-0123abcd"  # this process: live
    legacy = tmp_path / ".m.tmp-89abcdef"  # the name had no pid before
    other = tmp_path / ".other.tmp-89abcdef"
    for d in (mine, legacy, other):
        d.mkdir()
    assert files.sweep_stale_siblings(dst) == [legacy]
    assert sorted(os.listdir(tmp_path)) == sorted([mine.name, other.name])


def test_a_save_that_raises_leaves_no_temp_dir(tmp_path):
    def save(d):
        d.mkdir()
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_dir_atomically(tmp_path / "m", save)
    assert os.listdir(tmp_path) == []


def test_read_text_lines_drops_a_bom_and_names_the_line_of_a_bad_byte(tmp_path):
    p = tmp_path / "t.txt"
    p.write_bytes(b"\xef\xbb\xbfa\r\nb\rc\n")
    assert files.read_text_lines(p) == ["a\n", "b\n", "c\n"]
    p.write_bytes(b"ok\n\xef\xbb\xbfstill ok\nbad \xc3(\n")
    with pytest.raises(KeyError, match=r"t.txt: line 3: column 5: byte 0xc3 is not valid UTF-8"):
        files.read_text_lines(p, KeyError)


def test_jsonl_round_trip_skips_blank_lines_and_keeps_unicode(tmp_path):
    rows = [{"a": 1, "t": "é"}, {"b": [1, 2]}]
    path = write_jsonl(tmp_path / "r.jsonl", rows)
    assert path.read_text(encoding="utf-8") == '{"a":1,"t":"é"}\n{"b":[1,2]}\n'
    assert write_jsonl(tmp_path / "s.jsonl", rows, ensure_ascii=True).read_text().startswith('{"a":1,"t":"\\u00e9"}')
    path.write_text(path.read_text(encoding="utf-8") + "\n  \n", encoding="utf-8")
    assert read_jsonl(path) == rows
    assert read_jsonl(path, limit=1) == rows[:1]
    assert [n for n, _ in iter_jsonl(path)] == [1, 2]


@pytest.mark.parametrize("lines, required, message", [
    (['{"a": 1}', "{oops"], None, r"r.jsonl:2: invalid JSON \(Expecting property name"),
    (["[1]"], None, r"r.jsonl:1: expected a JSON object, got list"),
    (['{"a": 1}'], {"b": int}, r"r.jsonl:1: field 'b' is missing"),
    (['{"a": true}'], {"a": int}, r"r.jsonl:1: field 'a': expected int, got True"),
])
def test_read_jsonl_errors_name_file_line_and_field(tmp_path, lines, required, message):
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=message):
        read_jsonl(path, required)


def test_read_jsonl_check_and_missing_file(tmp_path):
    path = write_jsonl(tmp_path / "r.jsonl", [{"a": 1}, {"a": -1}])
    with pytest.raises(ValueError, match=r"r.jsonl:2: field 'a': negative"):
        read_jsonl(path, check=lambda r: "field 'a': negative" if r["a"] < 0 else None)
    with pytest.raises(FileNotFoundError, match="nope.jsonl: file not found"):
        read_jsonl(tmp_path / "nope.jsonl")


def test_iter_jsonl_raises_the_callers_error_class(tmp_path):
    class TraceError(ValueError):
        pass

    path = tmp_path / "t.jsonl"
    path.write_text("{bad\n")
    with pytest.raises(TraceError, match="t.jsonl:1: invalid JSON"):
        list(iter_jsonl(path, error=TraceError))


def test_iter_jsonl_names_the_line_of_a_bad_byte_and_drops_a_bom(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}\r\n\n{"t": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:3: column 11: byte 0xe9 is not valid UTF-8"):
        list(iter_jsonl(path))
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}\r\n\n{"t": "caf\xc3\xa9"}\n')
    assert list(iter_jsonl(path)) == [(1, {"a": 1}), (3, {"t": "café"})]


def test_write_result_records_command_commit_and_date(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "current_commit", lambda: "abc1234")
    path = write_result(tmp_path / "res" / "x.json", {"value": 1}, "dgr2 x")
    doc = json.loads(path.read_text())
    assert doc["command"] == "dgr2 x" and doc["commit"] == "abc1234" and doc["date"] and doc["value"] == 1
    assert read_results(tmp_path / "res") == {"x": doc}
    assert read_results(tmp_path / "none") == {}


def test_a_changed_result_or_model_file_does_not_make_the_code_dirty(tmp_path, monkeypatch):
    import subprocess

    from candidate_gen.files import current_commit

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    for f in ("code.py", "docs/results/x.json", "models/m/config.json", "README.md"):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("1")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    monkeypatch.chdir(tmp_path)
    clean = current_commit()
    assert len(clean) >= 7 and not clean.endswith("-dirty")
    (tmp_path / "docs/results/x.json").write_text("2")  # what a command writes: still this commit's code
    (tmp_path / "models/m/config.json").write_text("2")
    (tmp_path / "README.md").write_text("2")
    assert current_commit() == clean
    (tmp_path / "code.py").write_text("2")
    assert current_commit() == clean + "-dirty"
