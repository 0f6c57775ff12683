"""The environment registry, its README table, and the command line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import flaggems
from flaggems import cli, config

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.mark.parametrize("text, value", [("1", True), ("TRUE", True), ("yes", True), ("On", True),
                                         ("0", False), ("false", False), ("no", False), ("off", False),
                                         ("", False)])
def test_one_truth_table(text, value):
    assert config.parse_bool("FLAGGEMS_STRICT", text) is value


def test_bad_boolean_is_an_error():
    with pytest.raises(ValueError, match="FLAGGEMS_STRICT='maybe' is not a boolean"):
        config.get("FLAGGEMS_STRICT", {"FLAGGEMS_STRICT": "maybe"})


def test_force_is_validated():
    with pytest.raises(ValueError, match="expected one of generic, vendor, native"):
        config.get("FLAGGEMS_FORCE", {"FLAGGEMS_FORCE": "fast"})


def test_unknown_names_are_warned():
    env = {"FLAGGEMS_VENDR": "ascend", "FLAGGEMS_OP_copy_": "native", "FLAGGEMS_LOG": "dispatch"}
    assert config.unknown_names(env) == ["FLAGGEMS_VENDR"]
    with pytest.warns(RuntimeWarning, match="unknown environment variable FLAGGEMS_VENDR"):
        config.warn_unknown(env)


def test_readme_table_matches_registry():
    text = README.read_text()
    names = re.findall(r"^\| `(FLAGGEMS_[A-Za-z_<>]+)` \|", text, flags=re.M)
    assert names == list(config.REGISTRY), "README's variable table is out of date: run `flaggems env --markdown`"
    assert config.markdown_table() in text


def test_cli_info_routes_env(capsys):
    assert cli.main(["info"]) == 0
    assert "backend:" in capsys.readouterr().out
    assert cli.main(["routes", "--json"]) == 0
    capsys.readouterr()
    assert cli.main(["env"]) == 0
    assert "FLAGGEMS_VENDOR" in capsys.readouterr().out
    assert cli.main(["routes", "--op", "no_such_op"]) == 1


def test_python_dash_m():
    proc = subprocess.run([sys.executable, "-m", "flaggems", "info", "--json"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert '"backend"' in proc.stdout


def test_unknown_names_get_a_did_you_mean_and_habits_point_to_ours():
    with pytest.warns(RuntimeWarning, match="did you mean FLAGGEMS_VENDOR"):
        config.warn_unknown({"FLAGGEMS_VENDR": "ascend"})
    for habit in ("GEMS_VENDOR", "FLAGGEMS_BACKEND"):
        with pytest.warns(RuntimeWarning, match=f"{habit}=ascend is FlagGems' variable .* set FLAGGEMS_VENDOR=ascend"):
            config.warn_unknown({habit: "ascend"})


def test_cli_version_help_and_configuration_errors(capsys, monkeypatch, tmp_path):
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert capsys.readouterr().out.startswith("flaggems ")
    assert cli.main([]) == 0
    assert "usage: flaggems" in capsys.readouterr().out
    monkeypatch.setenv("FLAGGEMS_ROUTES", str(tmp_path / "missing.toml"))
    assert cli.main(["routes"]) == 2
    assert "FLAGGEMS_ROUTES=" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text("copy_ = \n")
    monkeypatch.setenv("FLAGGEMS_ROUTES", str(bad))
    assert cli.main(["routes"]) == 2
    assert "not valid TOML" in capsys.readouterr().err


def test_info_piped_into_head_ends_quietly():
    proc = subprocess.run(f"{sys.executable} -m flaggems info | head -1", shell=True, capture_output=True,
                          text=True, timeout=120)
    assert "BrokenPipe" not in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("name, value, message", [
    ("FLAGGEMS_CHECK_INDICES", "maybe", "FLAGGEMS_CHECK_INDICES='maybe' is not a boolean"),
    ("FLAGGEMS_GROUPED_SCATTER", "perhaps", "FLAGGEMS_GROUPED_SCATTER='perhaps' is not a boolean"),
    ("FLAGGEMS_LOG", "bogus", r"FLAGGEMS_LOG: unknown channel\(s\) \['bogus'\]"),
    ("FLAGGEMS_ENTRY", "fast", "FLAGGEMS_ENTRY='fast': expected one of auto, compiled, python"),
])
def test_bad_values_fail_enable_naming_the_variable(runtime, monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        flaggems.enable()
    assert not flaggems.is_enabled()


def test_env_shows_current_values(capsys, monkeypatch):
    monkeypatch.setenv("FLAGGEMS_STRICT", "1")
    monkeypatch.setenv("FLAGGEMS_OP_copy_", "native")
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert "FLAGGEMS_STRICT (bool, default False) = '1'" in out and "FLAGGEMS_OP_copy_=native" in out


def test_warnings_point_at_the_users_line(tmp_path):
    """An unknown variable warns at ``import flaggems`` in the user's file, not inside flaggems."""
    import os

    script = tmp_path / "app.py"
    script.write_text("import flaggems  # line 1\n")
    env = {**os.environ, "FLAGGEMS_BOGUS": "1"}
    done = subprocess.run([sys.executable, "-W", "always", str(script)], capture_output=True, text=True, env=env,
                          timeout=120)
    lines = [line for line in done.stderr.splitlines() if "FLAGGEMS_BOGUS" in line]
    assert lines and lines[0].startswith(f"{script}:1: RuntimeWarning"), done.stderr


def test_a_warning_at_enable_points_at_the_caller(runtime):
    from flaggems_fakes.plugins import GenericNeg

    runtime.manager.register(GenericNeg(), "fake-generic")
    with pytest.warns(RuntimeWarning, match="abss") as record:
        flaggems.enable(include=["abss"])
    flaggems.disable()
    assert record[0].filename == __file__
