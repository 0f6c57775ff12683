"""Discovery, isolation of broken plugins, backend selection, lazy import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flaggems
from flaggems import Backend, OpImpl, hookimpl
from flaggems.manager import PluginError
from flaggems_fakes.plugins import AcmeVendor, BrokenProbe, GenericNeg, Misspelled, Raising

BROKEN_DIST = Path(__file__).parent / "fixtures" / "broken_dist"


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FLAGGEMS_")}
    environ.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=120)


def broken_env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(BROKEN_DIST), os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path, **extra}


INFO = "import json, flaggems; print(json.dumps(flaggems.info()))"


def test_broken_entry_point_never_breaks_import():
    proc = run_python(INFO, **broken_env())
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    plugins = {p["name"]: p for p in info["plugins"]}
    assert plugins["broken"]["status"] == "failed"
    assert "libacme.so" in plugins["broken"]["error"]
    assert plugins["generic"]["status"] == "loaded"
    assert "'broken'" in proc.stderr and "flaggems-broken 0.3" in proc.stderr and "libacme.so" in proc.stderr


def test_broken_plugin_shown_by_cli():
    proc = run_python("from flaggems.cli import main; main(['info'])", **broken_env())
    assert proc.returncode == 0, proc.stderr
    assert "failed" in proc.stdout and "broken" in proc.stdout and "libacme.so" in proc.stdout


@pytest.mark.parametrize("env", [{"FLAGGEMS_DISABLE_PLUGINS": "broken"}, {"FLAGGEMS_PLUGINS": "generic"}])
def test_allow_and_deny_lists_apply_before_import(env):
    proc = run_python(INFO, **broken_env(**env))
    assert proc.returncode == 0, proc.stderr
    assert "libacme" not in proc.stderr
    plugins = {p["name"]: p for p in json.loads(proc.stdout)["plugins"]}
    assert plugins["broken"]["status"] == "skipped"
    assert plugins["generic"]["status"] == "loaded"


def test_strict_mode_turns_broken_plugin_into_error():
    proc = run_python("import flaggems", **broken_env(FLAGGEMS_STRICT="1"))
    assert proc.returncode != 0 and "PluginError" in proc.stderr


def test_import_is_lazy():
    code = ("import sys, flaggems; "
            "print(sorted(m for m in sys.modules if m.startswith(('triton', 'flaggems.plugins.generic.'))))")
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", "import flaggems must not import triton or kernel modules"


def test_misspelled_hook_is_rejected_naming_the_plugin(runtime):
    with pytest.warns(RuntimeWarning, match="'typo-plugin'.*flaggems_operator"):
        record = runtime.manager.register(Misspelled(), "typo-plugin")
    assert record.status == "failed"
    assert "typo-plugin" not in runtime.manager.loaded()


def test_raising_hook_disables_only_that_plugin(runtime):
    runtime.manager.register(GenericNeg(), "fake-generic")
    runtime.manager.register(Raising(), "raiser")
    with pytest.warns(RuntimeWarning, match="'raiser'.*boom"):
        rows = flaggems.routes()
    assert {r["op"] for r in rows} == {"abs", "neg"}
    assert runtime.manager.records["raiser"].status == "failed"


def test_raising_hook_in_strict_mode(runtime, monkeypatch):
    monkeypatch.setenv("FLAGGEMS_STRICT", "1")
    runtime.manager.register(Raising(), "raiser")
    with pytest.raises(PluginError, match="raiser"):
        flaggems.routes()


def test_unknown_vendor_lists_valid_names(runtime, monkeypatch):
    runtime.manager.register(AcmeVendor(), "acme")
    monkeypatch.setenv("FLAGGEMS_VENDOR", "nosuch")
    with pytest.raises(ValueError, match="FLAGGEMS_VENDOR='nosuch' is not a known backend; valid: ") as err:
        flaggems.backend()
    valid = str(err.value).split("valid: ")[1].split(", ")
    assert {"acme", "cpu", "nvidia"} <= set(valid) and valid == sorted(valid)


def test_vendor_without_hardware_is_simulated(runtime, monkeypatch):
    runtime.manager.register(AcmeVendor(), "acme")
    monkeypatch.setenv("FLAGGEMS_VENDOR", "acme")
    info = flaggems.info()
    assert info["backend"]["name"] == "acme" and info["backend"]["simulated"] is True
    assert "no acme device" in info["backend"]["reason"]
    expected_key = "CUDA" if flaggems.backend().device_type == "cuda" else "CPU"
    assert info["backend"]["dispatch_key"] == expected_key


def test_available_vendor_selected_automatically(runtime):
    vendor = AcmeVendor()
    vendor.available = True
    runtime.manager.register(vendor, "acme")
    active = flaggems.backend()
    assert active.name == "acme" and not active.simulated and active.dispatch_key == "PrivateUse1"
    assert active.reason.startswith("probe: acme device found")


def test_raising_probe_counts_as_unavailable(runtime):
    runtime.manager.register(BrokenProbe(), "brokenprobe")
    probes = {p["backend"]: p for p in flaggems.info()["probes"]}
    assert probes["brokenprobe"]["available"] is False
    assert "OSError: driver missing" in probes["brokenprobe"]["reason"]


def test_cpu_backend_sets_triton_interpreter(runtime):
    active = flaggems.backend()
    if active.interpreter:
        assert os.environ.get("TRITON_INTERPRET") == "1"



class _BrokenNeg:
    """A plugin whose neg implementation points at a module that does not exist."""

    @hookimpl
    def flaggems_operators(self):
        return [OpImpl("neg", "flaggems_fakes.no_such_module:neg"),
                OpImpl("abs", "flaggems_fakes.kernels:reentrant_abs")]


def test_an_implementation_that_fails_to_import_is_disabled_alone(runtime):
    runtime.manager.register(_BrokenNeg(), "broken")
    with pytest.warns(RuntimeWarning, match=r"plugin 'broken': the neg implementation failed to import"):
        flaggems.enable()
    try:
        routes = {r["op"]: r for r in flaggems.routes()}
        assert routes["neg"]["chosen"] == "native"
        assert any("disabled" in note for note in routes["neg"]["notes"])
        assert routes["abs"]["chosen"] == "broken"
        x = torch.arange(4.0)
        assert torch.equal(torch.neg(x), torch.tensor([-0.0, -1.0, -2.0, -3.0]))
    finally:
        flaggems.disable()


class _TwinAcme(AcmeVendor):
    """Another plugin declaring a backend named 'acme'."""


class _Beta(AcmeVendor):
    """A second vendor plugin whose device is present too."""

    available = True

    @hookimpl
    def flaggems_backends(self):
        return [Backend("beta", vendor="beta", device_type="acme", dispatch_key="PrivateUse1", probe=self.probe)]

    @hookimpl
    def flaggems_operators(self, backend):
        return [OpImpl("neg", "flaggems_fakes.kernels:vendor_neg")]  # no vendor named


def test_two_backends_with_one_name_are_an_error_naming_both(runtime):
    runtime.manager.register(AcmeVendor(), "acme")
    runtime.manager.register(_TwinAcme(), "acme-twin")
    with pytest.raises(PluginError, match=r"backend 'acme' is declared twice") as raised:
        flaggems.backend()
    assert "plugin 'acme'" in str(raised.value) and "plugin 'acme-twin'" in str(raised.value)


def test_two_vendor_plugins_claiming_the_device_are_an_error(runtime, monkeypatch):
    acme = AcmeVendor()
    acme.available = True
    runtime.manager.register(acme, "acme")
    runtime.manager.register(_Beta(), "beta")
    with pytest.raises(PluginError, match=r"two vendor plugins claim .*FLAGGEMS_VENDOR") as raised:
        flaggems.backend()
    assert "plugin 'acme'" in str(raised.value) and "plugin 'beta'" in str(raised.value)
    monkeypatch.setenv("FLAGGEMS_VENDOR", "beta")
    assert flaggems.backend().name == "beta"


def test_a_vendor_plugin_must_name_the_vendor_of_its_implementations(runtime, monkeypatch):
    monkeypatch.setenv("FLAGGEMS_VENDOR", "beta")
    runtime.manager.register(_Beta(), "beta")
    with pytest.warns(RuntimeWarning, match=r"plugin 'beta'.* neg implementation must name its vendor"):
        routes = {r["op"]: r for r in flaggems.routes()}
    assert "neg" not in routes or routes["neg"]["chosen"] == "native"


def test_an_allowlist_keeps_the_default_plugin():
    env = {k: v for k, v in os.environ.items() if k != "FLAGGEMS_VENDOR"}  # a vendor env's vendor is not allowed
    env["FLAGGEMS_PLUGINS"] = "ascend"
    code = ("import flaggems, json; "
            "print(json.dumps([p['name'] for p in flaggems.info()['plugins'] if p['status'] == 'loaded']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "generic" in json.loads(proc.stdout.strip().splitlines()[-1])


def _probe_helper(x):
    return x


def test_selecting_a_driven_backend_undoes_the_interpreter(monkeypatch):
    """An interpreted backend (a device without a Triton driver) switches the process to the interpreter;
    a driven backend selected later switches it back: TRITON_INTERPRET and Triton's own helpers (left
    interpreted, later GPU compiles fail: seen on the H200 after a test selected such a backend)."""
    import types

    from triton.runtime.jit import JITFunction

    from flaggems import backends

    module = types.ModuleType("triton.language._flaggems_probe")
    module.helper = original = JITFunction(_probe_helper)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(backends, "_INTERPRETER_CHANGES", {})
    backends.prepare_interpreter(types.SimpleNamespace(interpreter=True))
    assert os.environ["TRITON_INTERPRET"] == "1" and module.helper is not original
    backends.prepare_interpreter(types.SimpleNamespace(interpreter=False))
    assert "TRITON_INTERPRET" not in os.environ and module.helper is original
