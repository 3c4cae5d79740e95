"""The `dgr2` entry point: sub-commands with their own parsers get every argument, -h included."""

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


@pytest.mark.parametrize("text, message", [("{oops", "not valid JSON"), ("[1, 2]", "expected a JSON object")])
def test_config_json_errors_name_the_flag(tmp_path, text, message):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("name: c\n")
    with pytest.raises(SystemExit, match=f"--config-json: {message}"):
        main(["data", "build", "--config", str(cfg), "--config-json", text])
