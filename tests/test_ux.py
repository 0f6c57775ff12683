"""What a new user meets first: the command line's messages, exit codes and warnings, and the bench's labels.

Each test is one defect a first use ran into (issue 42): the bench warning about
its own workloads, invalid variables ``info``/``env`` let pass, a vendor name
without a hint to install its package, warnings pointing at the console script,
the CPU-only entry line read as an error, ``routes --op`` without a suggestion,
a kit that tested nothing, smoke rows labelled with full sizes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import flaggems
from flaggems import backends, cli, config, userwarn
from flaggems.bench import runner, shapes
from flaggems.bench.workload import Workload, smoke_label
from flaggems.testing import random_cases
from flaggems_fakes.plugins import AcmeVendor


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("FLAGGEMS_")}


# -- flaggems bench: its own workloads, its labels, its inputs ---------------------------------------------
def test_bench_sends_only_implemented_ops_to_enable(tmp_path, capsys):
    """``--op unfold`` names clone/unfold/repeat, which nothing (or nothing on this backend) implements: no warning;
    its smoke results say the sizes that ran (the compact smoke report prints one line per op, never a full size)."""
    routed = {row["op"] for row in flaggems.routes()}
    assert runner.implemented(("unfold", "clone", "repeat", "copy_")) == tuple(
        op for op in ("unfold", "clone", "repeat", "copy_") if op in routed)
    path = tmp_path / "out.json"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli.main(["bench", "--smoke", "--op", "unfold", "--json", str(path)]) == 0
    captured = capsys.readouterr()
    assert not [w for w in caught if "enable(include=...)" in str(w.message)]
    assert "enable(include=...)" not in captured.err and "warning" not in captured.err.lower()
    assert "unfold" in captured.out and "[16777216]" not in captured.out  # the smoke size, not the full one
    results = json.loads(path.read_text())["results"]
    assert {r["label"] for r in results} >= {"unfold(0,64,32).contiguous() [256]", "repeat(1,2,2) 2x4x8"}
    assert {r["workload"] for r in results} >= {"unfold(0,64,32).contiguous() [16777216]"}  # the key stays


def test_every_smoke_label_differs_where_the_sizes_do():
    for workload in shapes.all_workloads():
        if any(workload.params.get(k) != v for k, v in workload.smoke.items()):
            assert workload.label(smoke=True) != workload.name, workload.key
        assert workload.label(smoke=False) == workload.name


def test_a_plugin_workload_gets_its_smoke_label_derived():
    assert smoke_label("neg [16M]", {"n": 1 << 24}, {"n": 1 << 10}) == "neg [1K]"
    assert smoke_label("expand 1024 -> 1024x1024", {"src": (1024,), "dst": (1024, 1024)},
                       {"src": (16,), "dst": (8, 16)}) == "expand 16 -> 8x16"
    # one number for two sizes, or a size the name does not spell: the smoke sizes follow the name
    assert smoke_label("tokens 4x512 kv4", {"batch": 4, "seq": 512, "kv": 4}, {"batch": 1, "seq": 3, "kv": 2}) \
        == "tokens 4x512 kv4 (smoke: batch=1, seq=3, kv=2)"
    assert smoke_label("fwd G32", {"groups": 32}, {"groups": 2}) == "fwd G32 (smoke: groups=2)"
    assert smoke_label("same", {"n": 3}, {"n": 3}) == "same"


def test_workload_inputs_are_seeded_and_the_callers_generator_is_left_alone():
    def build(device, n):
        return (torch.randn(n, device=device),)  # torch's default generator, as a plugin may write it

    workload = Workload("neg", "neg [64]", "fp32", build, lambda inputs: -inputs[0], {"n": 64}, {"n": 8},
                        routes=("neg",))
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    first, second = workload.make("cpu"), workload.make("cpu")
    assert torch.equal(torch.rand(3), expected), "make() must not move the caller's generator"
    assert first[0] is not second[0] and torch.equal(first[0], second[0])


# -- flaggems info / env: the same rules as enable() ------------------------------------------------------
def test_env_marks_and_info_reports_what_enable_refuses(monkeypatch, capsys):
    monkeypatch.setenv("FLAGGEMS_STRICT", "maybe")
    monkeypatch.setenv("FLAGGEMS_LOG", "bogus")
    problems = config.problems()
    assert set(problems) == {"FLAGGEMS_STRICT", "FLAGGEMS_LOG"}
    with pytest.raises(ValueError, match="FLAGGEMS_STRICT='maybe' is not a boolean"):
        config.validate()
    assert cli.main(["env"]) == 2
    captured = capsys.readouterr()
    assert "FLAGGEMS_STRICT (bool, default False) = 'maybe'  INVALID" in captured.out
    assert "FLAGGEMS_LOG (list, default ()) = 'bogus'  INVALID" in captured.out
    assert "FLAGGEMS_VENDOR (str" in captured.out and "FLAGGEMS_VENDOR (str, default '') = (not set)  INVALID" \
        not in captured.out
    assert cli.main(["info"]) == 2
    captured = capsys.readouterr()
    assert "backend:" in captured.out
    assert "FLAGGEMS_STRICT='maybe' is not a boolean" in captured.err and "unknown channel(s) ['bogus']" in captured.err
    assert cli.main(["info", "--json"]) == 2
    assert set(json.loads(capsys.readouterr().out)["invalid_variables"]) == {"FLAGGEMS_STRICT", "FLAGGEMS_LOG"}
    monkeypatch.setenv("FLAGGEMS_STRICT", "1")
    monkeypatch.delenv("FLAGGEMS_LOG")
    assert config.problems() == {} and cli.main(["info"]) == 0 and cli.main(["env"]) == 0


# -- FLAGGEMS_VENDOR naming a first-party plugin that is not installed ---------------------------------
@pytest.mark.parametrize("vendor, dist, folder", [("ascend", "flaggems-ascend", "flaggems_ascend"),
                                                  ("kunlunxin", "flaggems-kunlunxin", "flaggems_kunlunxin"),
                                                  ("hygon", "flaggems-hygon", "flaggems_hygon")])
def test_a_first_party_vendor_not_installed_says_what_to_install(vendor, dist, folder):
    with pytest.raises(ValueError) as raised:
        backends.select([], vendor)
    message = str(raised.value)
    assert f"FLAGGEMS_VENDOR={vendor!r} is not a known backend; valid: cpu, nvidia" in message
    assert f"pip install ./{folder}" in message and f"pip install {dist}" in message


def test_a_misspelled_vendor_gets_a_suggestion():
    with pytest.raises(ValueError, match="did you mean ascend"):
        backends.select([], "ascnd")
    acme = AcmeVendor().flaggems_backends()[0]
    with pytest.raises(ValueError, match=r"valid: acme, cpu, nvidia; did you mean acme\?$"):
        backends.select([acme], "Acme")


def test_the_cli_gives_the_install_hint(runtime, monkeypatch, capsys):
    monkeypatch.setenv("FLAGGEMS_VENDOR", "ascend")  # no plugin registered: flaggems-ascend "not installed"
    assert cli.main(["info"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flaggems: error: FLAGGEMS_VENDOR='ascend' is not a known backend")
    assert "pip install ./flaggems_ascend" in err


# -- warnings: at the user's line, or one clean line in the command --------------------------------------
def test_a_warning_under_enabled_points_at_the_users_with_line(tmp_path):
    script = tmp_path / "app.py"
    script.write_text("import flaggems\nwith flaggems.enabled(include=['no_such_op']):\n    pass\n")
    done = subprocess.run([sys.executable, "-W", "always", str(script)], capture_output=True, text=True,
                          env=_clean_env(), timeout=120)
    lines = [line for line in done.stderr.splitlines() if "no_such_op" in line and "RuntimeWarning" in line]
    assert lines and lines[0].startswith(f"{script}:2: RuntimeWarning"), done.stderr
    assert "contextlib" not in done.stderr


def _console_script() -> str | None:
    path = os.path.join(os.path.dirname(sys.executable), "flaggems")
    return path if os.path.exists(path) else None


@pytest.mark.parametrize("how", ["console script", "python -m"])
def test_the_command_prints_warnings_as_one_clean_line(how):
    if how == "console script":
        if _console_script() is None:
            pytest.skip("no flaggems console script next to this interpreter")
        command = [_console_script(), "env"]
    else:
        command = [sys.executable, "-m", "flaggems", "env"]
    done = subprocess.run(command, capture_output=True, text=True, env={**_clean_env(), "FLAGGEMS_BOGUS": "1"},
                          timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "FLAGGEMS_BOGUS" in line]
    assert lines[0].startswith("flaggems: warning: unknown environment variable FLAGGEMS_BOGUS is ignored")
    assert "RuntimeWarning" not in done.stderr and "from flaggems.cli import main" not in done.stderr
    assert "sys:1" not in done.stderr


def test_one_line_warnings_still_obey_the_filters(capsys):
    with userwarn.command_line():
        userwarn.warn("flaggems: something to say")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(RuntimeWarning, match="something else"):
                userwarn.warn("flaggems: something else")
    assert capsys.readouterr().err == "flaggems: warning: something to say\n"


# -- flaggems info's entry line without a GPU ------------------------------------------------------------
def test_no_cuda_driver_on_a_cpu_backend_reads_as_the_normal_state():
    entry = {"active": "compiled", "reason": "built against torch 2.13.0+cpu; no CUDA driver (libcuda.so.1 not found)"}
    line = cli.entry_line(entry, {"device_type": "cpu", "interpreter": True})
    assert line == ("entry: compiled  (built against torch 2.13.0+cpu; CPU only: this machine has no CUDA driver, "
                    "as expected without a GPU)")
    # where a GPU backend is active, a missing driver is a problem: the reason stays as it is
    assert "libcuda.so.1 not found" in cli.entry_line(entry, {"device_type": "cuda", "interpreter": False})


def test_info_prints_that_line(capsys):
    assert cli.main(["info"]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("entry: ")]
    if flaggems.backend().device_type == "cpu":
        assert "not found" not in line


# -- flaggems routes --op: did you mean ------------------------------------------------------------------
def test_routes_suggests_close_op_names(capsys):
    assert cli.main(["routes", "--op", "copy"]) == 1
    assert "no implementation routes 'copy': it runs natively; did you mean copy_" in capsys.readouterr().err
    assert cli.main(["routes", "--op", "bogus"]) == 1
    err = capsys.readouterr().err
    assert "no implementation routes 'bogus'" in err and "routed ops: " in err and "copy_" in err
    assert cli.main(["routes", "--op", "copy_"]) == 0


# -- flaggems kit: says so when it tested nothing ------------------------------------------------------------
def test_kit_names_the_backend_that_implements_the_op(runtime, capsys):
    runtime.manager.register(AcmeVendor(), "acme")  # its probe says no: the active backend is another one
    assert cli.main(["kit", "--op", "neg", "--cases", "1"]) == 1
    err = capsys.readouterr().err
    assert "no implementation of neg is installed for the" in err
    assert "run it with FLAGGEMS_VENDOR=acme flaggems kit --op neg" in err


def test_kit_that_ran_no_case_fails(monkeypatch, capsys):
    def declined(*args, **kwargs):
        return [random_cases.Tally("neg", "acme", "direct", declined=5)]

    monkeypatch.setattr(random_cases, "run_kit", declined)
    assert cli.main(["kit", "--op", "neg"]) == 1
    captured = capsys.readouterr()
    assert "warning: neg: no implementation ran any case" in captured.out
    assert "no case ran: nothing was tested" in captured.err

    def passed(*args, **kwargs):
        return [random_cases.Tally("neg", "acme", "direct", passed=3)]

    monkeypatch.setattr(random_cases, "run_kit", passed)
    assert cli.main(["kit", "--op", "neg"]) == 0
    assert "implementations tested: neg [acme]" in capsys.readouterr().out


def test_kit_entries_only_skips_the_direct_calls(monkeypatch, capsys):
    seen = []

    def record(cases, ops, seed, modes, impl, **kwargs):
        seen.append(modes)
        return [random_cases.Tally("neg", "acme", mode, passed=1) for mode in modes]

    monkeypatch.setattr(random_cases, "run_kit", record)
    assert cli.main(["kit", "--op", "neg", "--entry", "compiled", "--entries-only"]) == 0
    assert cli.main(["kit", "--op", "neg", "--entry", "compiled"]) == 0
    assert seen == [("compiled",), ("direct", "compiled")]
    assert "modes compiled\n" in capsys.readouterr().out


# -- flaggems build: the first enable()'s compile, ahead of time -----------------------------------------------
def test_build_command_reports_the_folder_and_failure(monkeypatch, capsys):
    from flaggems import compiled

    monkeypatch.setattr(compiled, "is_built", lambda: False)
    monkeypatch.setattr(compiled, "build", lambda: (True, "/cache/x", "built against torch 9"))
    assert cli.main(["build"]) == 0
    assert "built against torch 9" in capsys.readouterr().out
    monkeypatch.setattr(compiled, "build", lambda: (False, "/cache/x", "cannot build: no C++ compiler"))
    assert cli.main(["build"]) == 1
    assert "cannot build: no C++ compiler" in capsys.readouterr().err


def test_each_environment_and_ninja_builds_its_own_entry(monkeypatch):
    """Two environments sharing the cache with different ninja binaries rebuilt in turn: the folder's name
    now depends on the interpreter's environment and the tools."""
    from flaggems import compiled

    first = compiled._build_name()
    monkeypatch.setattr(compiled.sys, "prefix", "/another/venv")
    assert compiled._build_name() != first
    monkeypatch.undo()
    monkeypatch.setattr(compiled, "_tool_identity", lambda name: f"{name}:other")
    assert compiled._build_name() != first
