"""The `dgr2` entry point: sub-commands with their own parsers get every argument, -h included;
`dgr2 --help` imports no model or serving library."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from integration.cli import main


@pytest.mark.parametrize("command", ["loadtest", "client"])
def test_pass_through_commands_show_their_own_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "-h"])
    assert e.value.code == 0
    assert f"usage: dgr2 {command}" in capsys.readouterr().out


def test_report_rejects_a_malformed_row(tmp_path, capsys):
    assert main(["report", "stages", "--row", "no-equals-sign", "--out", str(tmp_path / "x.json")]) == 2
    assert "LABEL=PATH" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("text, message", [("{oops", "invalid JSON"), ("[1, 2]", "expected a JSON object")])
def test_config_json_errors_name_the_flag(tmp_path, text, message):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("name: c\n")
    with pytest.raises(SystemExit, match=f"--config-json: {message}"):
        main(["data", "build", "--config", str(cfg), "--config-json", text])


# Libraries that take seconds to import; the parser (every command's --help) needs none of them,
# each command imports what it uses when it runs.
HEAVY = ("torch", "transformers", "recbole", "faiss", "grpc", "matplotlib")
_PROBE = """
import contextlib, io, json, sys
from integration.cli import build_parser, main
build_parser()
for argv in (["--help"], ["serve", "--help"], ["eval", "--help"], ["train", "--help"]):
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv)
        except SystemExit:
            pass
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY))))
"""


def test_help_imports_no_heavy_library():
    # A fresh interpreter: this test process has imported torch already (conftest).
    probe = f"HEAVY = {HEAVY!r}\n" + _PROBE
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2], check=True).stdout
    assert json.loads(out.splitlines()[-1]) == []
