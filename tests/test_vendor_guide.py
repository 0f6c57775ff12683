"""The vendor-plugin guide (docs/vendor-guide.md) is a runnable package (examples/acme_gems): it works as written.

The plugin is registered as its entry point would register it and selected
with ``FLAGGEMS_VENDOR=acme`` (simulated: no Acme device here). It adds
``aten::neg`` (the generic plugin has none) with its kit cases and a bench
workload, tunes the shared copy kernel and declares ``FLAGGEMS_ACME_NEG_BLOCK``.
The guide's shell commands run end to end on the plugin installed from a copy
of the example, outside the checkout.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import install_acme

import flaggems
from flaggems import config, testing
from flaggems.binding import native_scope

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "acme_gems"
GUIDE = ROOT / "docs" / "vendor-guide.md"


@pytest.fixture
def acme(runtime, monkeypatch):
    """Generic and acme plugins installed, acme selected (simulated on the device that exists)."""
    yield from install_acme(runtime, monkeypatch)


def test_the_guide_shows_the_example_files_as_they_are():
    guide = GUIDE.read_text()
    blocks = re.findall(r"```(?:python|toml)\n# (examples/acme_gems/[^\n]+)\n(.*?)```", guide, re.S)
    shown = {path: body for path, body in blocks}
    assert set(shown) >= {"examples/acme_gems/pyproject.toml", "examples/acme_gems/src/acme_gems/__init__.py",
                          "examples/acme_gems/src/acme_gems/neg.py", "examples/acme_gems/src/acme_gems/probe.py",
                          "examples/acme_gems/src/acme_gems/cases.py"}
    for path, body in shown.items():
        assert (ROOT / path).read_text() == body, f"the guide's {path} differs from the file"
    assert "docs/vendor-guide.md" in (ROOT / "README.md").read_text(), "the README points to the guide"


def test_the_plugin_routes_its_new_op_and_passes_the_kit(acme):
    (route,) = flaggems.routes("neg")
    assert route["chosen"] == "acme" and flaggems.backend().simulated
    items = testing.collect(["neg"])
    assert {i.label for i in items} == {"acme"} and len(items) == 7
    outcomes = {i.case.name: testing.check(i) for i in items}
    assert outcomes.pop("transposed").startswith("declined")  # supports() sends it on; native serves it
    assert set(outcomes.values()) == {"ok"}


def test_tuning_reaches_the_shared_kernel(acme):
    from flaggems.toolkit import context, elementwise_policy

    context.reset()
    assert elementwise_policy().max_ctas == 12
    x = torch.randn(64, 48, device=flaggems.backend().device_type)
    with flaggems.enabled():
        y = x.t().contiguous()
    with native_scope():
        assert torch.equal(y, x.t().contiguous())


def test_its_variable_is_declared_validated_and_read(acme, monkeypatch):
    assert "FLAGGEMS_ACME_NEG_BLOCK" in config.REGISTRY
    assert config.unknown_names({"FLAGGEMS_ACME_NEG_BLOCK": "64"}) == []
    from acme_gems import neg as acme_neg

    monkeypatch.setenv("FLAGGEMS_ACME_NEG_BLOCK", "64")
    x = torch.randn(200, device=flaggems.backend().device_type)
    with native_scope():
        expected = -x
    with flaggems.enabled():
        assert torch.equal(torch.neg(x), expected)
    assert (64, False) in acme_neg._LAUNCHERS
    monkeypatch.setenv("FLAGGEMS_ACME_NEG_BLOCK", "100")
    with pytest.raises(ValueError, match="FLAGGEMS_ACME_NEG_BLOCK=100: expected a power of two"):
        flaggems.enable()


def test_its_bench_workload_is_listed(acme):
    from flaggems.bench.shapes import all_workloads, select

    (workload,) = select(all_workloads(), ops=["neg"])
    assert workload.name == "neg [16M]" and workload.routes == ("neg",)
    assert workload.label(smoke=True) == "neg [1K]"  # a smoke row says what it runs
    first, second = workload.make("cpu", smoke=True), workload.make("cpu", smoke=True)
    assert first[0] is not second[0] and torch.equal(first[0], second[0])  # fresh inputs, the same values


def _guide_commands() -> list[str]:
    (block,) = re.findall(r"```bash\n# the guide's commands[^\n]*\n(.*?)```", GUIDE.read_text(), re.S)
    return [line.strip() for line in block.splitlines() if line.strip()]


def _install_example(site: Path, work: Path) -> None:
    """``pip install examples/acme_gems`` from a copy, into ``site`` (its entry point as pip writes it).

    Where this environment cannot build it (no setuptools), the same files are written by hand: the
    package, and a dist-info with the entry points of the example's pyproject.toml.
    """
    copy = work / "acme_gems"
    shutil.copytree(EXAMPLE, copy, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
           "--target", str(site), str(copy)]
    if subprocess.run(pip, capture_output=True, text=True, timeout=120).returncode == 0:
        return
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    shutil.copytree(copy / "src" / "acme_gems", site / "acme_gems", dirs_exist_ok=True)
    info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    groups = project["entry-points"]
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in points.items())
        for group, points in groups.items()))


def _command_folder(folder: Path) -> Path:
    """A folder holding only ``flaggems`` (this environment's console script), for the front of ``PATH``.

    Not the environment's whole scripts folder: its ``ninja`` would then build the compiled entry, where this
    process used another one, and two ninja versions sharing the entry's cache rebuild it each time (~50 s).
    """
    folder.mkdir()
    script = Path(sys.executable).parent / "flaggems"
    if script.exists():
        (folder / "flaggems").symlink_to(script)
    else:
        (folder / "flaggems").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m flaggems "$@"\n')
        (folder / "flaggems").chmod(0o755)
    return folder


def test_the_guides_commands_run_as_written(tmp_path):
    """Install the example, then each command of the guide in a shell, outside the checkout: rc 0, and neg ran
    through the plugin (its route, its bench row, its kit cases)."""
    commands = _guide_commands()
    assert commands[0].startswith("pip install") and "examples/acme_gems" in commands[0]
    site, work = tmp_path / "site", tmp_path / "work"
    work.mkdir()
    _install_example(site, work)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLAGGEMS_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PATH"] = os.pathsep.join([str(_command_folder(tmp_path / "bin")), env.get("PATH", "")])
    out: dict[str, str] = {}
    for command in commands[1:]:
        assert command.startswith("FLAGGEMS_VENDOR=acme "), f"the guide must select the backend: {command}"
        done = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
        assert "Warning" not in done.stderr and "warning:" not in done.stderr, f"{command}\n{done.stderr}"
        out[command.split()[2]] = done.stdout
    assert "chosen: acme" in out["routes"]
    assert "FLAGGEMS_ACME_NEG_BLOCK" in out["env"]
    (row,) = [line for line in out["bench"].splitlines() if line.startswith("neg ")]
    # one workload, one check against torch, passed, none failed; and what ran
    assert re.match(r"neg\s+1\s+1\s+1\s+0\s+[\d.]+\s+neg -> acme$", row), row
    assert "MISMATCH" not in out["bench"]
    assert "implementations tested: neg [acme]" in out["kit"] and " 0 failed" in out["kit"]
    passed = int(re.search(r"(\d+) passed", out["kit"]).group(1))
    assert passed > 0


def test_a_plugin_variable_outside_its_prefix_is_refused(runtime):
    class Bad:
        @flaggems.hookimpl
        def flaggems_env_vars(self):
            return [config.EnvVar("FLAGGEMS_OTHER_X", "int", 1, "x", lambda n, t: int(t))]

    runtime.manager.register(Bad(), "bad")
    with pytest.warns(RuntimeWarning, match=r"plugin 'bad'.*FLAGGEMS_OTHER_X, but its variables must be named "
                                            r"FLAGGEMS_BAD_<NAME>"):
        runtime.declare_env_vars()
    assert "FLAGGEMS_OTHER_X" not in config.REGISTRY
