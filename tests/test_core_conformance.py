"""The conformance kit runs every installed implementation and catches wrong ones."""

from __future__ import annotations

import pytest
import torch

from flaggems import OpImpl, hookimpl, testing
from flaggems.testing import Case
from flaggems_fakes.plugins import AcmeVendor, GenericNeg


def _neg_case(dtype, layout):
    def make(dev):
        x = torch.randn(6, 10, device=dev).to(dtype)
        return ((x.t() if layout == "transposed" else x),), {}
    return Case(f"neg-{layout}-{str(dtype)[6:]}", make)


NEG_CASES = [_neg_case(dt, lay) for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
             for lay in ("contiguous", "transposed")]
NEG_CASES.append(Case("neg-int64-declined", lambda dev: ((torch.arange(5, device=dev),), {})))
NEG_CASES.append(Case("neg-bool-error", lambda dev: ((torch.ones(3, dtype=torch.bool, device=dev),), {}),
                      raises=RuntimeError, match="on a bool tensor is not supported"))


@pytest.fixture
def fake_cases():
    testing.register_cases("neg", NEG_CASES)
    yield
    testing._CASES.pop("neg", None)


def test_kit_runs_every_installed_implementation(runtime, monkeypatch, fake_cases):
    runtime.manager.register(GenericNeg(), "fake-generic")
    runtime.manager.register(AcmeVendor(), "acme")
    monkeypatch.setenv("FLAGGEMS_VENDOR", "acme")
    runtime._active = None
    items = testing.collect(["neg"])
    assert {item.label for item in items} == {"acme", "fake-generic"}
    outcomes = {str(item): testing.check(item) for item in items}
    assert outcomes["neg[fake-generic]-neg-transposed-float32"] == "ok"
    assert outcomes["neg[acme]-neg-contiguous-float64"].startswith("declined: float64")
    assert outcomes["neg[fake-generic]-neg-int64-declined"].startswith("declined")
    assert outcomes["neg[fake-generic]-neg-bool-error"].startswith("declined")


class WrongStrides:
    @hookimpl
    def flaggems_operators(self):
        return [OpImpl("neg", lambda x: torch.neg(x).contiguous(), name="wrong-strides")]


class WrongValues:
    @hookimpl
    def flaggems_operators(self):
        return [OpImpl("neg", lambda x: x.clone(), name="wrong-values")]


class WrongError:
    @hookimpl
    def flaggems_operators(self):
        def neg(x):
            if x.dtype == torch.bool:
                raise ValueError("bool")
            return torch.neg(x)
        return [OpImpl("neg", neg, name="wrong-error")]


@pytest.mark.parametrize("plugin, case, message", [
    (WrongStrides, "neg-transposed-float32", "strides"),
    (WrongValues, "neg-contiguous-float32", "values differ"),
    (WrongError, "neg-bool-error", "raised ValueError"),
])
def test_kit_catches_wrong_implementations(runtime, fake_cases, plugin, case, message):
    runtime.manager.register(plugin(), "bad")
    (item,) = [i for i in testing.collect(["neg"]) if i.case.name == case]
    with pytest.raises(AssertionError, match=message):
        testing.check(item)
