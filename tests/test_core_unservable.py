"""Calls no kernel of flaggems reads right go to torch's kernel, for every implementation, on both entries.

Tensors whose values are not what their memory holds (the negative and conjugate bits), zero tensors,
Python subclasses (wrapper subclasses, the fake tensors torch.compile traces with), functorch wrappers and
forward-AD tangents reach the Autograd-key registrations of CompositeImplicitAutograd ops
(``repeat_interleave``, ``group_norm``) as they are: the entry declines them (``binding.unservable``; C++
in the compiled entry).
"""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn.functional as F  # noqa: N812

import flaggems
from flaggems import binding, compiled

DEV = torch.device(flaggems.backend().device_type)


@pytest.fixture(params=["compiled", "python"])
def entry(request, monkeypatch):
    """flaggems enabled through the compiled entry, then through the Python entry."""
    monkeypatch.setenv("FLAGGEMS_ENTRY", request.param)
    compiled.reset()
    flaggems.enable()
    assert flaggems.info()["entry"]["active"] == request.param
    yield request.param
    flaggems.disable()
    compiled.reset()


def native(fn, *args, **kwargs):
    """``fn`` with every op on torch's kernels."""
    with binding.native_scope():
        return fn(*args, **kwargs)


def test_negative_views_through_repeat_interleave(entry):
    z = torch.randn(6, device=DEV)
    repeats = torch.tensor([1, 2, 0, 3, 1, 2], device=DEV)
    for view in (torch._neg_view(z), torch.randn(6, dtype=torch.complex64, device=DEV).conj().imag):
        assert view.is_neg()
        for _ in range(2):  # the first call plans, the second replays (compiled entry)
            assert torch.equal(torch.repeat_interleave(view, 3), native(torch.repeat_interleave, view, 3))
            assert torch.equal(torch.repeat_interleave(view, repeats),
                               native(torch.repeat_interleave, view, repeats))


def test_negative_views_through_group_norm_after_a_plain_plan_of_the_same_layout(entry):
    x = torch.randn(2, 6, 3, 3, device=DEV)
    weight, bias = torch.randn(6, device=DEV), torch.randn(6, device=DEV)
    F.group_norm(x, 3, weight, bias)  # plans the plain layout
    F.group_norm(x, 3, weight, bias)
    for args in ((torch._neg_view(-x), 3, weight, bias), (x, 3, torch._neg_view(-weight), bias),
                 (x, 3, weight, torch._neg_view(-bias))):
        torch.testing.assert_close(F.group_norm(*args), native(F.group_norm, *args), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(F.group_norm(*args), F.group_norm(x, 3, weight, bias), rtol=1e-5, atol=1e-5)


def test_forward_ad_tangents_are_kept(entry):
    x = torch.randn(3, device=DEV)
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(x, torch.ones(3, device=DEV))
        tangent = forward_ad.unpack_dual(torch.repeat_interleave(dual, 2)).tangent
    assert tangent is not None and torch.equal(tangent, torch.ones(6, device=DEV))
    _, jvp = torch.func.jvp(lambda t: torch.repeat_interleave(t, 2), (x,), (torch.ones(3, device=DEV),))
    assert torch.equal(jvp, torch.ones(6, device=DEV))


def test_zero_tensors_subclasses_and_fake_tensors_reach_torch(entry):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.two_tensor import TwoTensor

    assert torch.equal(torch.repeat_interleave(torch._efficientzerotensor(3, device=DEV), 2),
                       torch.zeros(6, device=DEV))
    x = torch.randn(2, 4, 3, device=DEV)
    zero_weight = F.group_norm(x, 2, torch._efficientzerotensor(4, device=DEV))
    assert torch.equal(zero_weight, torch.zeros_like(x))
    pair = TwoTensor(x, x * 2)
    out = F.group_norm(pair, 2)
    assert isinstance(out, TwoTensor)
    torch.testing.assert_close(out.a, native(F.group_norm, x, 2))
    with FakeTensorMode():
        fake = torch.randn(3, device=DEV)
        assert torch.repeat_interleave(fake, 2).shape == (6,)


def test_unservable_names_the_property():
    x = torch.randn(3)
    assert binding.unservable((x, 2), {}) is None
    assert "Negative" in binding.unservable((torch._neg_view(x),), {})
    assert "ZeroTensor" in binding.unservable((x,), {"weight": torch._efficientzerotensor(3)})
    assert "Sparse" in binding.unservable(([x, x.to_sparse()],), {})
    with forward_ad.dual_level():
        assert "forward-AD" in binding.unservable((forward_ad.make_dual(x, x),), {})


class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every aten op the mode sees."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _seen(fn):
    with _OpLog() as log:
        out = fn()
    return log.ops, out


@pytest.mark.parametrize("name", ["group_norm", "repeat_interleave.Tensor", "repeat_interleave.int", "index_select",
                                  "copy_"])
def test_a_dispatch_mode_sees_the_ops_torch_makes(entry, name):
    """A TorchDispatchMode (a user's, or compile's fake and functional modes) sees torch's ops, not a kernel's
    allocations: the Autograd-key routes go to torch's composite while a mode is on the stack."""
    x = torch.randn(2, 4, 3, 3, device=DEV)
    calls = {
        "group_norm": lambda: F.group_norm(x, 2, torch.ones(4, device=DEV), torch.zeros(4, device=DEV)),
        "repeat_interleave.Tensor": lambda: torch.repeat_interleave(x[0, 0, 0], torch.tensor([2, 0, 1],
                                                                                                device=DEV)),
        "repeat_interleave.int": lambda: torch.repeat_interleave(x, 2, dim=1),
        "index_select": lambda: x.index_select(1, torch.tensor([0, 2], device=DEV)),
        "copy_": lambda: torch.empty_like(x).copy_(x.transpose(2, 3)),
    }
    for _ in range(2):  # planned, then replayed
        routed, out = _seen(calls[name])
        torch_ops, expected = native(_seen, calls[name])
        assert routed == torch_ops
        torch.testing.assert_close(out, expected)


def test_zero_tensor_weights_go_to_torch_through_autograd_and_backward(entry):
    """torch's kernels read a ZeroTensor weight's memory as they find it (its own output for the same call can
    differ between runs); flaggems never serves such a call, so its answer is torch's, not a second guess."""
    x = torch.randn(2, 4, 3, 3, device=DEV, requires_grad=True)
    weight = torch._efficientzerotensor(4, device=DEV)
    assert "ZeroTensor" in binding.unservable((x, weight), {})
    F.group_norm(x, 2, weight).sum().backward()  # must not raise; values are torch's (undefined there)
    assert x.grad is not None and x.grad.shape == x.shape
