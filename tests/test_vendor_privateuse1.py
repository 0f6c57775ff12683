"""flaggems on a real PrivateUse1 device without hardware: the CPU-backed ``npu`` of ``tests/fakes``.

The ``ascend`` tox env sets ``FAKE_TORCH_NPU=1``: the Ascend probe finds the
``torch_npu`` stand-in, the backend is ``ascend`` on the PrivateUse1 key (not
simulated), and Triton, which has no driver for it, runs in its interpreter.
The conformance kit runs there too (tests/test_conformance.py).
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import install_acme, ran

import flaggems
from flaggems.binding import native_scope
from flaggems.runtime import RUNTIME

pytestmark = pytest.mark.skipif(os.environ.get("FAKE_TORCH_NPU") != "1" or flaggems.backend().device_type != "npu",
                                reason="needs the fake npu (FAKE_TORCH_NPU=1, flaggems-ascend installed)")
NPU = "npu"


@pytest.fixture(autouse=True)
def copy_routed(monkeypatch):
    """copy_ through flaggems here: these tests exercise its PrivateUse1 registration (Ascend leaves it native)."""
    monkeypatch.setenv("FLAGGEMS_OP_copy_", "generic")


def test_backend_is_ascend_on_privateuse1_not_simulated():
    info = flaggems.info()["backend"]
    assert (info["name"], info["dispatch_key"], info["simulated"], info["interpreter"]) == (
        "ascend", "PrivateUse1", False, True)
    assert "no Triton driver for 'npu'" in info["reason"]


def test_unfold_routes_on_privateuse1_only(dispatch_log):
    x = torch.arange(24.0, device=NPU).reshape(4, 6)
    view = x.unfold(1, 3, 2)
    assert "unfold -> generic" in ran(dispatch_log)
    with native_scope():
        expected = x.cpu().unfold(1, 3, 2)
    assert view.device.type == "npu" and view.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert view.stride() == expected.stride() and torch.equal(view.cpu(), expected)


def test_ops_run_on_the_npu(dispatch_log):
    x = torch.randn(5, 7, device=NPU)
    out = torch.empty(7, 5, device=NPU).copy_(x.t())
    repeats = torch.tensor([1, 0, 3, 2, 1], device=NPU)
    rep = torch.repeat_interleave(x, repeats, dim=0)  # its workspace is keyed by torch's stream of the npu
    served = ran(dispatch_log)
    assert "copy_ -> generic" in served and any(s.startswith("repeat_interleave") and "generic" in s for s in served)
    with native_scope():
        assert torch.equal(out.cpu(), x.cpu().t()) and torch.equal(rep.cpu(), x.cpu().repeat_interleave(
            repeats.cpu(), dim=0))


def test_compiled_entry_replays_on_privateuse1():
    x = torch.randn(64, device=NPU)
    with flaggems.enabled():
        if RUNTIME._binding.registry is None:
            pytest.skip("compiled entry not active")
        for _ in range(3):
            y = torch.empty(32, device=NPU).copy_(x[::2])
        stats = RUNTIME.plan_stats()["aten::copy_@PrivateUse1"]
    assert stats["replay"] >= 1
    with native_scope():
        assert torch.equal(y.cpu(), x.cpu()[::2])


@pytest.fixture
def acme_on_the_npu(runtime, monkeypatch):
    """The vendor guide's plugin (examples/acme_gems), its device being the CPU-backed PrivateUse1 npu.

    Only the backend record changes (an Acme device that presents itself as ``npu``); the plugin's
    operators, cases, tuning and variables are the example's own.
    """
    from flaggems import ProbeResult

    yield from install_acme(runtime, monkeypatch, device_type=NPU,
                            probe=lambda: ProbeResult(True, "an Acme device seen as the fake npu"))


def test_a_third_party_plugin_passes_the_kit_on_privateuse1(acme_on_the_npu):
    """The guide's plugin adds neg, tunes the shared copy kernel, and passes the kit on PrivateUse1."""
    from flaggems import testing
    from flaggems.toolkit import context, elementwise_policy

    active = flaggems.backend()
    assert (active.name, active.dispatch_key, active.simulated, active.interpreter) == (
        "acme", "PrivateUse1", False, True)
    (route,) = flaggems.routes("neg")
    assert route["chosen"] == "acme"
    items = testing.collect(["neg"])
    assert items and {i.label for i in items} == {"acme"}
    outcomes = {i.case.name: testing.check(i) for i in items}
    assert outcomes.pop("transposed").startswith("declined")  # its supports() sends it on; native serves it
    assert set(outcomes.values()) == {"ok"}, outcomes
    context.reset()
    assert elementwise_policy().max_ctas == 12  # its tuning, read by the shared kernel
    x = torch.randn(40, 24, device=NPU)
    with flaggems.enabled():
        y, z = x.t().contiguous(), torch.neg(x)
    with native_scope():
        assert y.device.type == NPU and torch.equal(y.cpu(), x.cpu().t().contiguous())
        assert torch.equal(z.cpu(), -x.cpu())
