"""The torch binding: routing, declines, native fallback, re-entry, disable."""

from __future__ import annotations

import pytest
import torch
from conftest import in_threads

import flaggems
from flaggems_fakes import kernels
from flaggems_fakes.plugins import AcmeVendor, CopyPlugin, DecliningAdd, GenericNeg

DEV = torch.device(flaggems.backend().device_type)


@pytest.fixture
def calls():
    kernels.CALLS.clear()
    yield kernels.CALLS
    kernels.CALLS.clear()


def test_enable_routes_then_disable_restores_native(runtime, calls):
    runtime.manager.register(GenericNeg(), "fake-generic")
    x = torch.randn(100, device=DEV)
    expected = torch.neg(x)
    flaggems.enable()
    assert flaggems.is_enabled()
    assert torch.equal(torch.neg(x), expected)
    assert calls == ["triton_neg"]
    flaggems.disable()
    assert not flaggems.is_enabled()
    torch.neg(x)
    assert calls == ["triton_neg"], "after disable() the native kernel must run"


def test_routed_result_equals_native_on_strided_input(runtime, calls):
    runtime.manager.register(GenericNeg(), "fake-generic")
    x = torch.randn(8, 13, device=DEV).t()
    expected = torch.neg(x)
    with flaggems.enabled():
        out = torch.neg(x)
    assert calls == ["triton_neg"]
    assert torch.equal(out, expected)


def test_supports_declines_to_native(runtime, calls):
    runtime.manager.register(GenericNeg(), "fake-generic")
    expected = -torch.arange(5, device=DEV)
    with flaggems.enabled():
        out = torch.neg(torch.arange(5, device=DEV))
    assert calls == []
    assert torch.equal(out, expected)


def test_vendor_first_then_generic_on_decline(runtime, calls, monkeypatch):
    runtime.manager.register(GenericNeg(), "fake-generic")
    runtime.manager.register(AcmeVendor(), "acme")
    monkeypatch.setenv("FLAGGEMS_VENDOR", "acme")
    runtime._active = None
    with flaggems.enabled():
        torch.neg(torch.randn(4, device=DEV))
        torch.neg(torch.randn(4, dtype=torch.float64, device=DEV))  # vendor declines float64
    assert calls == ["vendor_neg", "triton_neg"]


def test_native_scope_routes_native_on_every_device(runtime, calls):
    """Tests compute expected values in ``native_scope``: on a GPU too it must reach the native kernel.

    Until run 13 it did so only under the Triton interpreter, so on the GPU an
    "expected" value came from the kernel under test.
    """
    from flaggems.binding import native_scope

    runtime.manager.register(GenericNeg(), "fake-generic")
    x = torch.randn(6, device=DEV)
    with flaggems.enabled():
        with native_scope():
            inside = torch.neg(x)
        assert calls == []
        outside = torch.neg(x)
    assert calls == ["triton_neg"]
    assert torch.equal(inside, outside)


def test_reentry_goes_native_not_recursive(runtime, calls):
    runtime.manager.register(GenericNeg(), "fake-generic")
    x = torch.tensor([-1.5, 2.0], device=DEV)
    with flaggems.enabled():
        out = torch.abs(x)
    assert calls == ["reentrant_abs"]
    assert torch.equal(out, torch.tensor([1.5, 2.0], device=DEV))


@pytest.mark.skipif(DEV.type != "cpu", reason="the Triton interpreter runs on CPU tensors only")
def test_interpreter_internal_copy_does_not_recurse(runtime, calls):
    runtime.manager.register(CopyPlugin(), "fake-copy")
    dst, src = torch.zeros(300, device=DEV), torch.randn(300, device=DEV)
    with flaggems.enabled():
        dst.copy_(src)
    assert torch.equal(dst, src)
    assert calls.count("copy_via_interpreter") >= 1


@pytest.mark.parametrize("with_supports", [False, True], ids=["single-entry", "chain-entry"])
def test_python_scalars_in_tensor_slots_go_native_with_torch_promotion(runtime, calls, with_supports):
    runtime.manager.register(DecliningAdd(with_supports), "fake-add")
    half = torch.ones(3, dtype=torch.float16, device=DEV)
    ints = torch.ones(3, dtype=torch.int32, device=DEV)
    zero_dim = torch.tensor(1.0, dtype=torch.float16, device=DEV)
    expected = [half + 0.5, ints + 0.5, ints + 2, zero_dim + 0.5, half + True]
    with flaggems.enabled():
        results = [half + 0.5, ints + 0.5, ints + 2, zero_dim + 0.5, half + True]
        both_tensors = half + half
    assert calls == ["declining_add"], "implementations never see Python numbers in Tensor slots"
    assert torch.equal(both_tensors, torch.full((3,), 2.0, dtype=torch.float16, device=DEV))
    for got, want in zip(results, expected):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_native_kernel_rewraps_python_scalars():
    from flaggems.binding import NativeKernel

    native = NativeKernel.capture("add.Tensor", flaggems.backend().dispatch_key)
    half = torch.ones(2, dtype=torch.float16, device=DEV)
    assert native(half, 0.5).dtype == torch.float16
    assert native(torch.ones(2, dtype=torch.int32, device=DEV), 0.5).dtype == torch.float32
    assert native(torch.ones(2, dtype=torch.int32, device=DEV), 3).dtype == torch.int32


def test_enable_is_idempotent_and_context_restores(runtime, calls):
    runtime.manager.register(GenericNeg(), "fake-generic")
    flaggems.enable()
    flaggems.enable()
    assert runtime.registered_ops() == ["abs", "neg"]
    with flaggems.enabled(include=["neg"]):
        assert runtime.registered_ops() == ["neg"]
    assert runtime.registered_ops() == ["abs", "neg"]
    flaggems.disable()
    flaggems.disable()
    with flaggems.enabled(exclude=["neg"]):
        assert runtime.registered_ops() == ["abs"]
    assert not flaggems.is_enabled()


def test_enable_disable_thread_safe(runtime, calls):
    runtime.manager.register(GenericNeg(), "fake-generic")
    errors = []

    def flip(_thread: int) -> None:
        try:
            for _ in range(20):
                flaggems.enable()
                flaggems.disable()
        except Exception as exc:  # pragma: no cover - the failure we test for
            errors.append(exc)

    in_threads(flip, 4)
    assert not errors
    assert not flaggems.is_enabled()
    calls.clear()
    torch.neg(torch.ones(2, device=DEV))
    assert calls == []


def test_dispatch_and_fallback_logging(runtime, calls, monkeypatch, caplog):
    runtime.manager.register(GenericNeg(), "fake-generic")
    monkeypatch.setenv("FLAGGEMS_LOG", "dispatch,fallback")
    with caplog.at_level("INFO", logger="flaggems"):
        with flaggems.enabled():
            torch.neg(torch.ones(2, device=DEV))
            torch.neg(torch.ones(2, dtype=torch.int64, device=DEV))
    messages = [r.getMessage() for r in caplog.records]
    assert "neg -> fake-generic" in messages
    assert any("neg: fake-generic declined: dtype torch.int64" in m for m in messages)
    assert "neg -> native" in messages


def test_autograd_still_works_through_routed_op(runtime, calls):
    runtime.manager.register(GenericNeg(), "fake-generic")
    x = torch.randn(5, requires_grad=True, device=DEV)
    expected = -torch.ones(5, device=DEV)
    with flaggems.enabled():
        torch.neg(x).sum().backward()
    assert torch.equal(x.grad, expected)
    assert "triton_neg" in calls
