"""``aten::group_norm`` routed: ``F.group_norm`` / ``nn.GroupNorm`` forward and backward through our kernels.

Expected values are torch's composite, computed in a native scope (every op
native, its backward included). Shapes are small: the kernels run in Triton's
interpreter on a machine without a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the usual spelling
from conftest import ran
from torch.autograd import forward_ad

import flaggems
from flaggems import autograd, testing
from flaggems.binding import native_scope
from flaggems.plugins.generic import group_norm as gn
from flaggems.plugins.generic import group_norm_op

DEV = torch.device(flaggems.backend().device_type)
CL, CL3D = torch.channels_last, torch.channels_last_3d
F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
FORWARD_ULPS = {F16: 4, BF16: 4, F32: 64, F64: 64}
BACKWARD_ULPS = {F16: 4, BF16: 4, F32: 256, F64: 256}
ROUTED = "group_norm -> generic"


def make(shape, dtype=F32, fmt=None, weight=True, bias=True, grad=False, param_dtype=None, seed=0):
    """``(x, weight, bias)`` of ``shape``; each requires grad when ``grad`` says so."""
    torch.manual_seed(seed)
    x = torch.randn(shape, device=DEV, dtype=F64).to(dtype)
    x = x if fmt is None else x.contiguous(memory_format=fmt)
    C = shape[1]
    w = (torch.randn(C, device=DEV, dtype=F64) * 0.5 + 1).to(param_dtype or dtype) if weight else None
    b = (torch.randn(C, device=DEV, dtype=F64) * 0.5).to(param_dtype or dtype) if bias else None
    if grad:
        for t in (x, w, b):
            if t is not None:
                t.requires_grad_()
    return x, w, b


def wanted(x, w, b):
    """The tensors among ``x, w, b`` that require grad."""
    return [t for t in (x, w, b) if t is not None and t.requires_grad]


def torch_result(x, groups, w, b, dy=None, eps=1e-5):
    """torch's output (and its gradients for ``dy``), every op native."""
    with native_scope():
        y = F.group_norm(x, groups, w, b, eps)
        return y, (() if dy is None else torch.autograd.grad(y, wanted(x, w, b), dy))


def assert_close(actual, expected, ulps):
    """Within ``ulps`` of the dtype (bfloat16: one more, the interpreter truncates where torch rounds)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    extra = 1 if actual.dtype == BF16 and actual.device.type == "cpu" else 0
    tol = (ulps + extra) * testing.ULP[actual.dtype]
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


@pytest.fixture(autouse=True)
def our_node_for_gradients(request, monkeypatch):
    """Calls that need a gradient take our autograd node (the size policy is tested on its own below)."""
    if "composite_policy" not in request.keywords:
        monkeypatch.setattr(group_norm_op, "in_place_grad", lambda input: True)


@pytest.fixture
def spy(monkeypatch):
    """Record the arguments our forward and backward kernels receive (``calls["fwd"]``, ``calls["bwd"]``)."""
    calls = {"fwd": [], "bwd": []}
    forward, backward = gn.native_group_norm, gn.native_group_norm_backward

    def fwd(*args, **kwargs):
        calls["fwd"].append(args)
        return forward(*args, **kwargs)

    def bwd(*args, **kwargs):
        calls["bwd"].append(args)
        return backward(*args, **kwargs)

    monkeypatch.setattr(gn, "native_group_norm", fwd)
    monkeypatch.setattr(gn, "native_group_norm_backward", bwd)
    return calls


def test_routed():
    (route,) = flaggems.routes("group_norm")
    assert route["chosen"] == "generic"
    assert route["chain"] == ["generic", "native"]


@pytest.mark.parametrize("shape,groups,dtype,fmt,affine", [
    ((2, 6, 3, 4), 3, F32, None, (True, True)),
    ((2, 10, 3, 3), 5, F32, CL, (True, True)),
    ((1, 12, 2, 3), 1, F32, CL, (False, False)),
    ((2, 6, 2, 3), 6, F32, None, (True, False)),
    ((2, 6, 2, 3), 3, F32, None, (False, True)),
    ((3, 12), 4, F32, None, (True, True)),
    ((2, 6, 5), 2, F64, None, (True, True)),
    ((2, 8, 2, 2, 3), 4, F32, CL3D, (True, True)),
    ((2, 6, 3, 3), 3, F16, CL, (True, True)),
    ((2, 6, 3, 3), 3, BF16, None, (True, True)),
    ((2, 6, 3, 3), 3, F64, CL, (True, True)),
], ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) and isinstance(v[0], int) else None)
def test_forward_matches_torch(dispatch_log, shape, groups, dtype, fmt, affine):
    x, w, b = make(shape, dtype, fmt, *affine)
    y = F.group_norm(x, groups, w, b)
    expected, _ = torch_result(x, groups, w, b)
    assert ROUTED in ran(dispatch_log)
    assert y.is_contiguous(memory_format=fmt or torch.contiguous_format)
    if DEV.type == "cpu":  # torch keeps the suggested format on CPU (on CUDA its composite returns contiguous)
        assert y.stride() == expected.stride()
    assert_close(y, expected, FORWARD_ULPS[dtype])


@pytest.mark.parametrize("fmt", [CL, CL3D])
def test_channels_last_read_in_place_and_kept(dispatch_log, spy, fmt):
    shape = (2, 10, 3, 4) if fmt == CL else (1, 10, 2, 3, 2)
    x, w, b = make(shape, fmt=fmt, grad=True)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            y = torch.nn.functional.group_norm(x, 5, w, b)
        assert spy["fwd"][-1][0] is x  # the caller's tensor itself: no contiguous copy on the way
        assert y.is_contiguous(memory_format=fmt)
        assert y.requires_grad == grad
    dy = torch.randn(shape, device=DEV).contiguous(memory_format=fmt)
    y.backward(dy)
    (dy_seen, x_seen, *_), = spy["bwd"]
    assert x_seen is x and dy_seen.is_contiguous(memory_format=fmt)
    assert x.grad.is_contiguous(memory_format=fmt)  # dx in x's layout, every device


def test_nn_group_norm_unet_block_channels_last_fp16(dispatch_log, spy):
    """Diffusers' GroupNorm(32, 320) on a channels_last fp16 activation (small spatial size)."""
    module = torch.nn.GroupNorm(32, 320).to(DEV, F16)
    x = torch.randn(1, 320, 2, 3, device=DEV, dtype=F16).contiguous(memory_format=CL)
    with torch.no_grad():
        y = module(x)
        expected, _ = torch_result(x, 32, module.weight, module.bias)
    assert spy["fwd"][-1][0] is x and y.is_contiguous(memory_format=CL)
    assert_close(y, expected, FORWARD_ULPS[F16])


GRAD_CASES = [
    # shape, groups, dtype, fmt, weight, bias
    ((2, 6, 3, 4), 3, F32, None, True, True),
    ((2, 10, 3, 3), 5, F32, CL, True, True),
    ((2, 10, 3, 3), 5, F64, CL, True, True),
    ((2, 6, 3, 4), 3, F64, None, False, False),
    ((2, 6, 2, 3), 1, F32, CL, False, False),
    ((2, 6, 2, 3), 6, F32, CL, True, True),
    ((2, 6, 2, 3), 6, F64, None, True, False),
    ((2, 12, 5), 4, F32, None, True, True),
    ((3, 6), 2, F64, None, True, True),
    ((1, 8, 2, 2, 3), 2, F32, CL3D, True, True),
]


@pytest.mark.parametrize("shape,groups,dtype,fmt,weight,bias", GRAD_CASES)
def test_gradients_match_torch(dispatch_log, spy, shape, groups, dtype, fmt, weight, bias):
    x, w, b = make(shape, dtype, fmt, weight, bias, grad=True)
    dy = torch.randn(shape, device=DEV, dtype=dtype)
    y = F.group_norm(x, groups, w, b)
    assert autograd.is_node(y.grad_fn)
    grads = torch.autograd.grad(y, wanted(x, w, b), dy)
    expected_y, expected_grads = torch_result(x, groups, w, b, dy)
    assert ROUTED in ran(dispatch_log) and len(spy["bwd"]) == 1
    assert_close(y, expected_y, FORWARD_ULPS[dtype])
    for actual, expected in zip(grads, expected_grads, strict=True):
        if actual.shape == x.shape:  # the input's gradient: in the input's memory format on every device
            assert actual.is_contiguous(memory_format=fmt or torch.contiguous_format)
        else:
            assert actual.stride() == expected.stride() or actual.dim() == 1
        assert_close(actual, expected, BACKWARD_ULPS[dtype])


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_half_gradients(dispatch_log, dtype):
    x, w, b = make((2, 6, 3, 3), dtype, CL, grad=True)
    dy = torch.randn(2, 6, 3, 3, device=DEV, dtype=dtype)
    y = F.group_norm(x, 3, w, b)
    grads = torch.autograd.grad(y, (x, w, b), dy)
    expected_y, expected_grads = torch_result(x, 3, w, b, dy)
    assert_close(y, expected_y, FORWARD_ULPS[dtype])
    for actual, expected in zip(grads, expected_grads, strict=True):
        assert_close(actual, expected, BACKWARD_ULPS[dtype] * 2)  # dweight/dbias: 18-term sums rounded to half


@pytest.mark.skipif(DEV.type != "cpu", reason="torch accepts mixed dtypes on CPU only")
def test_mixed_bf16_input_fp32_affine_gradients(dispatch_log):
    x, w, b = make((2, 6, 3, 3), BF16, grad=True, param_dtype=F32)
    dy = torch.randn(2, 6, 3, 3, device=DEV, dtype=BF16)
    y = F.group_norm(x, 3, w, b)
    grads = torch.autograd.grad(y, (x, w, b), dy)
    expected_y, expected_grads = torch_result(x, 3, w, b, dy)
    assert ROUTED in ran(dispatch_log)
    assert_close(y, expected_y, FORWARD_ULPS[BF16])
    assert [g.dtype for g in grads] == [BF16, F32, F32]
    assert_close(grads[0], expected_grads[0], BACKWARD_ULPS[BF16])
    for actual, expected in zip(grads[1:], expected_grads[1:]):
        assert_close(actual, expected, 2**16)  # fp32 sums of bf16 products: torch's and ours differ in order


@pytest.mark.parametrize("needs,mask", [
    ("x", [True, False, False]), ("w", [False, True, False]), ("b", [False, False, True]),
    ("wb", [False, True, True]), ("xb", [True, False, True]),
])
def test_output_mask_asks_only_the_gradients_needed(dispatch_log, spy, needs, mask):
    x, w, b = make((2, 6, 2, 2))
    for name, t in zip("xwb", (x, w, b)):
        t.requires_grad_(name in needs)
    y = F.group_norm(x, 3, w, b)
    grads = torch.autograd.grad(y, wanted(x, w, b), torch.ones_like(y) + x.detach())
    (*_, output_mask), = spy["bwd"]
    assert list(output_mask) == mask
    for actual, expected in zip(grads, torch_result(x, 3, w, b, torch.ones_like(y) + x.detach())[1]):
        assert_close(actual, expected, BACKWARD_ULPS[F32])


def test_no_grad_and_inference_mode_run_the_forward_only(dispatch_log, spy):
    x, w, b = make((2, 6, 2, 2), grad=True)
    expected, _ = torch_result(x, 3, w, b)
    with torch.no_grad():
        y = F.group_norm(x, 3, w, b)
    with torch.inference_mode():
        z = F.group_norm(x, 3, w, b)
    detached = F.group_norm(x.detach(), 3)  # nothing requires grad
    assert not (y.requires_grad or z.requires_grad or detached.requires_grad)
    assert len(spy["fwd"]) == 3
    assert_close(y, expected.detach(), FORWARD_ULPS[F32])
    assert_close(z, expected.detach(), FORWARD_ULPS[F32])


def test_double_backward_matches_torch(dispatch_log, spy):
    """A gradient penalty: ``create_graph`` with a ``grad_output`` that needs no grad (``ones``)."""
    x, w, b = make((2, 6, 2, 2), F64, CL, grad=True)

    def penalty():
        y = F.group_norm(x, 3, w, b)
        dx, dw = torch.autograd.grad(y, (x, w), torch.ones_like(y) + x.detach(), create_graph=True)
        return torch.autograd.grad((dx * dx).sum() + (dw * dw).sum(), (x, w))  # bias: no second order

    actual = penalty()
    with native_scope():
        expected = penalty()
    assert not autograd.is_node(actual[0].grad_fn) and spy["fwd"]
    for a, e in zip(actual, expected):
        assert_close(a, e, BACKWARD_ULPS[F64])


def _error(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - whatever torch raises is the expectation
        return type(exc), str(exc)
    raise AssertionError("no error raised")


@pytest.mark.parametrize("args", [
    pytest.param(lambda: (torch.randn(6, device=DEV), 3, None, None), id="rank-1"),
    pytest.param(lambda: (torch.randn(2, 6, 3, device=DEV), 4, None, None), id="groups-not-dividing-c"),
    pytest.param(lambda: (torch.randn(2, 6, 3, device=DEV), 0, None, None), id="zero-groups"),
    pytest.param(lambda: (torch.randn(2, 6, 3, device=DEV), 3, torch.ones(5, device=DEV), None), id="weight-size"),
    pytest.param(lambda: (torch.randn(2, 6, 3, device=DEV), 3, torch.ones(6, 1, device=DEV), None), id="weight-2d"),
    pytest.param(lambda: (torch.randn(2, 6, 3, device=DEV), 3, None, torch.ones(4, device=DEV)), id="bias-size"),
    pytest.param(lambda: (torch.randn(2, 6, 3, device=DEV), 3, torch.ones(6, device=DEV, dtype=F64), None),
                 id="weight-dtype"),
    pytest.param(lambda: (torch.ones(2, 6, 3, device=DEV, dtype=torch.int32), 3, None, None), id="int-input"),
])
@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
def test_errors_are_torchs(dispatch_log, args, grad):
    x, groups, w, b = args()
    if grad and x.dtype.is_floating_point:
        x.requires_grad_()
    with native_scope():
        expected = _error(lambda: torch.group_norm(x, groups, w, b))  # aten: F.group_norm checks some first
    assert _error(lambda: torch.group_norm(x, groups, w, b)) == expected
    assert any(m.startswith("group_norm: generic declined") for m in ran(dispatch_log))


def test_bias_grad_without_weight_declines_to_torch(dispatch_log):
    """torch's backward raises here; flaggems leaves the call to it, so the same error comes."""
    x, _, b = make((2, 6, 2, 2), weight=False, grad=True)
    dy = torch.randn(2, 6, 2, 2, device=DEV)
    expected = _error(lambda: torch_result(x, 3, None, b, dy))
    assert _error(lambda: F.group_norm(x, 3, None, b).backward(dy)) == expected
    assert any("bias needs grad without a weight" in m for m in ran(dispatch_log))


@pytest.mark.parametrize("fmt", [None, CL])
def test_empty_batch(dispatch_log, fmt):
    """The kernels decline empty input: torch's composite computes it, gradients included."""
    x, w, b = make((0, 6, 2, 2), fmt=fmt, grad=True)
    y = F.group_norm(x, 3, w, b)
    grads = torch.autograd.grad(y, (x, w, b), torch.ones_like(y), allow_unused=True)
    expected_y, expected_grads = torch_result(x, 3, w, b, torch.ones_like(y))
    assert y.shape == expected_y.shape and y.stride() == expected_y.stride()
    for actual, expected in zip(grads, expected_grads):
        assert torch.equal(actual, expected)
    assert any("group_norm: generic declined: empty input" in m for m in ran(dispatch_log))


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # torch's jvp decompositions
def test_forward_ad_declines_to_torch(dispatch_log):
    x, w, b = make((2, 6, 2, 2))
    tangent = torch.randn_like(x)
    with forward_ad.dual_level():
        y = F.group_norm(forward_ad.make_dual(x, tangent), 3, w, b)
        actual = forward_ad.unpack_dual(y).tangent
        with native_scope():
            expected = forward_ad.unpack_dual(F.group_norm(forward_ad.make_dual(x, tangent), 3, w, b)).tangent
    assert actual is not None  # torch's composite ran (the mean/rstd under it are our native_group_norm's)
    assert_close(actual, expected, FORWARD_ULPS[F32])
    assert any("forward-AD tangent" in m for m in ran(dispatch_log))  # declined by the entry (binding.unservable)


def test_grad_our_kernels_decline_falls_back_to_torchs_backward(dispatch_log, spy):
    """A ``grad_out`` the backward kernels decline (a negative view): torch's kernel computes the gradients."""
    x, w, b = make((2, 6, 2, 3), fmt=CL, grad=True)
    dy = torch.randn(2, 6, 2, 3, device=DEV)
    y = F.group_norm(x, 3, w, b)
    grads = torch.autograd.grad(y, (x, w, b), torch._neg_view(dy))
    (dy_seen, *_), = spy["bwd"]
    assert dy_seen.is_neg()  # which the kernels decline
    expected = torch_result(x, 3, w, b, -dy)[1]
    for actual, wanted_grad in zip(grads, expected):
        assert_close(actual, wanted_grad, BACKWARD_ULPS[F32])


def test_backward_fallback_matches_torch():
    """The fallback itself (called directly): torch's operands, torch's gradients."""
    x, w, _ = make((2, 6, 2, 3), fmt=CL)
    dy = torch.randn(2, 6, 2, 3, device=DEV)
    _, mean, rstd = torch.ops.aten.native_group_norm(x.contiguous(), w, None, 2, 6, 6, 3, 1e-5)
    grads = group_norm_op._backward_fallback(torch._neg_view(dy), x, mean, rstd, w, (2, 6, 6, 3), [True] * 3)
    fmt = CL if DEV.type == "cpu" else torch.contiguous_format  # what torch's autograd formula passes
    expected = torch.ops.aten.native_group_norm_backward((-dy).contiguous(memory_format=fmt),
                                                         x.contiguous(memory_format=fmt), mean, rstd, w,
                                                         2, 6, 6, 3, [True] * 3)
    for actual, wanted_grad in zip(grads, expected):
        assert_close(actual, wanted_grad, 0)


@pytest.mark.composite_policy
@pytest.mark.parametrize("fmt", [None] + ([CL] if DEV.type == "cpu" else []))
def test_gradient_calls_without_a_copy_go_through_torchs_composite_onto_our_kernels(dispatch_log, fmt):
    """Where the composite would not copy the input, it serves the call that needs a gradient; its
    native_group_norm and backward run our kernels."""
    x, w, b = make((2, 6, 3, 4), fmt=fmt, grad=True)
    dy = torch.randn(2, 6, 3, 4, device=DEV)
    assert not group_norm_op.in_place_grad(x)
    y = F.group_norm(x, 3, w, b)
    assert not autograd.is_node(y.grad_fn)
    grads = torch.autograd.grad(y, (x, w, b), dy)
    expected_y, expected_grads = torch_result(x, 3, w, b, dy)
    served = ran(dispatch_log)
    assert "native_group_norm -> generic" in served and "native_group_norm_backward -> generic" in served
    assert_close(y, expected_y, FORWARD_ULPS[F32])
    for actual, expected in zip(grads, expected_grads, strict=True):
        assert_close(actual, expected, BACKWARD_ULPS[F32])


@pytest.mark.composite_policy
def test_only_an_input_the_composite_would_copy_takes_our_node():
    x = torch.randn(2, 6, 3, 4, device=DEV)
    assert not group_norm_op.in_place_grad(x)  # dense: no copy to save
    assert group_norm_op.in_place_grad(x[:, :, :, :3])  # not dense: the composite copies it on every device
    cl = x.contiguous(memory_format=CL)
    assert group_norm_op.in_place_grad(cl) == (DEV.type != "cpu")  # torch's CPU composite keeps channels_last
