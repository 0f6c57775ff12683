"""The README's vendor-plugin guide is a runnable package (examples/acme_gems): it works as the README says.

The plugin is registered as its entry point would register it and selected
with ``FLAGGEMS_VENDOR=acme`` (simulated: no Acme device here). It adds
``aten::neg`` (the generic plugin has none) with its kit cases and a bench
workload, tunes the shared copy kernel and declares ``FLAGGEMS_ACME_NEG_BLOCK``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

import flaggems
from flaggems import config, testing
from flaggems.binding import native_scope

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "acme_gems"


@pytest.fixture
def acme(runtime, monkeypatch):
    """Generic and acme plugins installed, acme selected (simulated on the device that exists)."""
    monkeypatch.syspath_prepend(str(EXAMPLE / "src"))
    import acme_gems

    import flaggems.plugins.generic as generic

    runtime.manager.register(generic, "generic")
    runtime.manager.register(acme_gems, "acme")
    runtime.declare_env_vars()
    monkeypatch.setenv("FLAGGEMS_VENDOR", "acme")
    monkeypatch.setattr(testing, "_LOADED", False)  # the kit reads the plugin's cases anew
    yield runtime
    config.REGISTRY.pop("FLAGGEMS_ACME_NEG_BLOCK", None)
    sys.modules.pop("acme_gems", None)


def test_readme_shows_the_example_files_as_they_are():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(?:python|toml)\n# (examples/acme_gems/[^\n]+)\n(.*?)```", readme, re.S)
    shown = {path: body for path, body in blocks}
    assert set(shown) >= {"examples/acme_gems/pyproject.toml", "examples/acme_gems/src/acme_gems/__init__.py",
                          "examples/acme_gems/src/acme_gems/neg.py"}
    for path, body in shown.items():
        assert (ROOT / path).read_text() == body, f"README's {path} differs from the file"


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
