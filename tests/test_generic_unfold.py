"""unfold (view), unfold_backward (gather) and Tensor.repeat end to end.

On CPU and CUDA the generic plugin does not offer ``unfold`` (its OpImpl
declares PrivateUse1 only: torch's view kernel runs). These tests check the view
implementation against every kit case, force the route on to run ``Tensor.repeat`` through it (what a PrivateUse1
backend gets), and run ``unfold_backward`` through autograd.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ran, run_compiled

import flaggems
from flaggems import testing
from flaggems.plugins.generic import unfold as uf

DEV = torch.device(flaggems.backend().device_type)
A = torch.ops.aten


class _UnfoldEverywhere:
    """Offers the generic ``unfold`` as the generic plugin does on PrivateUse1 backends."""

    @flaggems.hookimpl
    def flaggems_operators(self):
        return [flaggems.OpImpl("unfold", uf.unfold, priority=1)]


@pytest.fixture
def unfold_routed(monkeypatch):
    """What a PrivateUse1 backend gets: ``unfold`` routed to the generic view."""
    from flaggems.runtime import RUNTIME

    flaggems.disable()
    RUNTIME.manager.register(_UnfoldEverywhere(), "unfold-everywhere")
    yield
    flaggems.disable()
    RUNTIME.manager.unregister("unfold-everywhere")


@pytest.mark.parametrize("case", testing.cases_for("unfold"), ids=lambda c: c.name)
def test_view_against_every_kit_case(case):
    item = testing.Item("unfold", "generic", uf.unfold, None, case)
    assert testing.check(item) == "ok"


def test_view_shares_storage_and_offset():
    base = torch.arange(20.0, device=DEV)
    x = base[3:]
    view = uf.unfold(x, 0, 4, 3)
    expected = x.unfold(0, 4, 3)
    assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    assert (view.storage_offset(), view.stride(), view.shape) == (
        expected.storage_offset(), expected.stride(), expected.shape)
    view[0, 1] = -1.0
    assert base[4] == -1.0


def test_unfold_is_offered_on_privateuse1_only():
    """Declared on the OpImpl (dispatch_keys), decided by the policy: CPU and CUDA keep torch's view op."""
    from flaggems.plugins.generic import OPERATORS

    (impl,) = [i for i in OPERATORS if i.op == "unfold"]
    assert impl.dispatch_keys == ("PrivateUse1",)
    route = {r["op"]: r for r in flaggems.routes()}.get("unfold")
    if flaggems.backend().dispatch_key != "PrivateUse1":
        assert route is None or route["chosen"] == "native"


def test_repeat_fp16_default_routes(dispatch_log):
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8, device=DEV, dtype=torch.float16)
    flaggems.disable()
    expected = x.repeat(1, 2, 2)
    flaggems.enable()
    actual = x.repeat(1, 2, 2)
    messages = ran(dispatch_log)
    assert "copy_ -> generic" in messages
    if flaggems.backend().backend.dispatch_key != "PrivateUse1":  # else: a simulated vendor
        assert not any("unfold ->" in m for m in messages), "unfold is not routed on CPU/CUDA"
        assert flaggems.routes("unfold") == []
    assert torch.equal(actual, expected)


def test_repeat_and_unfold_contiguous_through_the_route(unfold_routed, dispatch_log):
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8, device=DEV, dtype=torch.float16)
    signal = torch.randn(40, device=DEV)
    flaggems.disable()
    expected = (x.repeat(1, 2, 2), x.repeat(3, 1, 1, 2), signal.unfold(0, 8, 4).contiguous())
    flaggems.enable()
    actual = (x.repeat(1, 2, 2), x.repeat(3, 1, 1, 2), signal.unfold(0, 8, 4).contiguous())
    assert "unfold -> unfold-everywhere" in ran(dispatch_log)
    for a, e in zip(actual, expected):
        assert a.shape == e.shape and a.stride() == e.stride() and torch.equal(a, e)


@pytest.mark.parametrize("step", [2, 4, 6])
def test_unfold_backward_through_autograd(unfold_routed, dispatch_log, step):
    torch.manual_seed(0)
    x = torch.randn(3, 20, device=DEV, requires_grad=True)
    grad = torch.randn(3, (20 - 4) // step + 1, 4, device=DEV)
    flaggems.disable()
    (expected,) = torch.autograd.grad(x.unfold(1, 4, step), x, grad)
    flaggems.enable()
    (actual,) = torch.autograd.grad(x.unfold(1, 4, step), x, grad)
    messages = ran(dispatch_log)
    assert "unfold -> unfold-everywhere" in messages and "unfold_backward -> generic" in messages
    torch.testing.assert_close(actual, expected, rtol=4 * 2.0**-23, atol=4 * 2.0**-23)


def _against_torch(grad, input_sizes, dim, size, step):
    actual = uf.unfold_backward(grad, input_sizes, dim, size, step)
    expected = A.unfold_backward(grad, input_sizes, dim, size, step)
    assert actual.stride() == expected.stride()
    torch.testing.assert_close(actual, expected, rtol=4 * 2.0**-23, atol=4 * 2.0**-23)


def test_grad_whose_outer_dims_do_not_merge_is_copied_first():
    torch.manual_seed(0)
    input_sizes = [2, 3, 9]
    grad = torch.randn(3, 2, 3, 4, device=DEV).permute(1, 0, 2, 3)  # dims before `dim` swapped
    assert uf._plan(grad, input_sizes, 2, 4, 2) is None
    _against_torch(grad, input_sizes, 2, 4, 2)


def test_int64_offsets_variant(monkeypatch):
    monkeypatch.setattr(uf, "INT32_LIMIT", 16)
    torch.manual_seed(0)
    grad = torch.randn(4, 7, 5, device=DEV).transpose(0, 1).contiguous().transpose(0, 1)
    launcher = uf._plan(grad, [4, 29], 1, 5, 4)[0]
    assert launcher.constexprs["INT64"]
    _against_torch(grad, [4, 29], 1, 5, 4)


@pytest.mark.parametrize("length,size,step", [(14851, 14851, 2), (40, 30, 3), (41, 7, 1)],
                         ids=["one-wide-window", "few-windows", "every-step"])
def test_the_window_walk_is_bounded_by_the_windows_that_exist(length, size, step):
    """An element walks at most min(cdiv(size, step), windows) windows, from the last one that exists: one
    14851-wide window at step 2 once walked 7,426 candidates per element (the kit's hang in CI)."""
    torch.manual_seed(0)
    windows = (length - size) // step + 1
    grad = torch.randn(windows, size, device=DEV)
    assert uf._plan(grad, [length], 0, size, step)[2][5] == min(-(-size // step), windows)
    _against_torch(grad, [length], 0, size, step)


def test_unfold_backward_is_deterministic_with_overlap():
    torch.manual_seed(0)
    grad = torch.randn(125, 8, device=DEV)
    first = uf.unfold_backward(grad, [504], 0, 8, 4)
    assert torch.equal(first, uf.unfold_backward(grad, [504], 0, 8, 4))


def test_unfold_backward_declines_what_it_does_not_know(dispatch_log):
    grad = torch.randn(5, 4, 3, device=DEV)  # 4 windows where unfold gives 3: torch's lenient kernel answers
    flaggems.disable()
    expected = A.unfold_backward(grad, [5, 7], 1, 3, 2)
    flaggems.enable()
    actual = A.unfold_backward(grad, [5, 7], 1, 3, 2)
    assert torch.equal(actual, expected)
    assert any("unfold_backward: generic declined: grad shape" in m for m in ran(dispatch_log))


def test_unfold_backward_kernel_compiles_for_sm90():
    """The interpreter never compiles: build the gather kernel for an H100/H200 target."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    import textwrap

    script = textwrap.dedent("""
        import types
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        import flaggems
        flaggems.backend = lambda: types.SimpleNamespace(dispatch_key="CUDA")  # no backend selection here
        from flaggems.plugins.generic import unfold as uf

        fn = uf._unfold_backward_kernel
        for dtype, constexprs in (("fp32", dict(BLOCK_J=2048, BLOCK_B=1, INNER_ONE=True, INT64=False, F64=False)),
                                  ("bf16", dict(BLOCK_J=32, BLOCK_B=64, INNER_ONE=False, INT64=True, F64=False))):
            sig = {p.name: "constexpr" if p.name in constexprs else ("*" + dtype if p.name in ("grad", "out")
                                                                        else p.annotation_type) for p in fn.params}
            attrs = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}
            src = ASTSource(fn, signature=sig, constexprs=constexprs, attrs=attrs)
            triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        print("ok")
    """)
    run_compiled(script)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and ~16 GB of device memory")
def test_unfold_backward_beyond_2_31_elements_on_the_gpu():
    """Overlapping windows over 2**31 + 64 fp16 elements: 64-bit offsets, against torch's kernel."""
    n, size, step = 2**31 + 64, 64, 32
    grad = torch.randn((n - size) // step + 1, size, device="cuda", dtype=torch.float16)
    expected = A.unfold_backward(grad, [n], 0, size, step)
    with flaggems.enabled():
        actual = A.unfold_backward(grad, [n], 0, size, step)
    for part in (slice(0, 4096), slice(n - 4096, n)):
        torch.testing.assert_close(actual[part], expected[part])
