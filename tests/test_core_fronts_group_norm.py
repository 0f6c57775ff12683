"""``flaggems.fronts.group_norm``: torch's group-norm semantics handed to a stand-in vendor kernel.

The kernels below compute with torch's own native kernels (in a native scope)
on the normalised calls the front hands them: every result must equal torch's.
"""

from __future__ import annotations

import pytest
import torch
from torch.autograd import forward_ad
from torch.utils._python_dispatch import TorchDispatchMode

from flaggems import Decline
from flaggems.binding import native_scope
from flaggems.fronts import group_norm as front
from flaggems.planner import ALLOCATING

A = torch.ops.aten
CL, CL3D = torch.channels_last, torch.channels_last_3d
F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64


def forward_kernel(call: front.ForwardCall) -> None:
    """A vendor forward stand-in: torch's kernel on a dense copy, written into the front's outputs."""
    with native_scope():
        x = call.input.contiguous(memory_format=front.suggest_memory_format(call.input))
        w, b = (None if p is None else p.contiguous() for p in (call.weight, call.bias))
        y, mean, rstd = A.native_group_norm(x, w, b, call.N, call.C, call.HxW, call.group, call.eps)
        call.y.copy_(y)
        call.mean.copy_(mean)
        call.rstd.copy_(rstd)


def backward_kernel(call: front.BackwardCall) -> None:
    """A vendor backward stand-in: torch's kernel, only the gradients the call holds filled."""
    with native_scope():
        fmt = front.native_format(call.input)
        dy, x = call.grad_out.contiguous(memory_format=fmt), call.input.contiguous(memory_format=fmt)
        w = None if call.weight is None else call.weight.contiguous()
        grads = A.native_group_norm_backward(dy, x, call.mean, call.rstd, w, call.N, call.C, call.HxW, call.group,
                                             list(call.mask))
        for out, grad in zip((call.dx, call.dweight, call.dbias), grads):
            if out is not None:
                out.copy_(grad)


native_group_norm, native_group_norm_backward = front.entries(forward_kernel, backward_kernel)
group_norm = front.group_norm_entry(forward_kernel)


def args_of(x: torch.Tensor, group: int) -> tuple[int, int, int, int]:
    N, C, HxW = front.dims(x)
    return N, C, HxW, group


def native(op, *args):
    with native_scope():
        return op(*args)


def assert_same(actual, expected):
    for a, e in zip(actual, expected, strict=True):
        assert (a is None) == (e is None)
        if a is not None:
            assert a.dtype == e.dtype and a.shape == e.shape and a.stride() == e.stride()
            torch.testing.assert_close(a, e, rtol=0, atol=0)


# --------------------------------------------------------------------------- forward and backward
@pytest.mark.parametrize("shape,group,dtype,fmt,affine", [
    ((2, 6, 3, 4), 3, F32, None, (True, True)),
    ((2, 10, 3, 3), 5, F32, CL, (True, True)),
    ((1, 12, 2, 3), 1, F64, CL, (False, False)),
    ((2, 6, 2, 3), 6, BF16, None, (True, False)),
    ((2, 6, 5), 2, F16, None, (False, True)),
    ((3, 12), 4, F32, None, (True, True)),
    ((2, 8, 2, 2, 3), 4, F32, CL3D, (True, True)),
])
def test_a_kernel_behind_the_entries_matches_torch(shape, group, dtype, fmt, affine):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype)
    x = x if fmt is None else x.contiguous(memory_format=fmt)
    C = shape[1]
    w = torch.randn(C, dtype=dtype) if affine[0] else None
    b = torch.randn(C, dtype=dtype) if affine[1] else None
    dims = args_of(x, group)
    expected = native(A.native_group_norm, x, w, b, *dims, 1e-5)
    actual = native_group_norm(x, w, b, *dims, 1e-5)
    assert_same(actual, expected)
    assert actual[0].is_contiguous(memory_format=fmt or torch.contiguous_format)  # the input's suggested format
    dy = torch.randn_like(x)
    mask = [True, w is not None, b is not None and w is not None]
    _, mean, rstd = expected
    assert_same(native_group_norm_backward(dy, x, mean, rstd, w, *dims, mask),
                native(A.native_group_norm_backward, dy, x, mean, rstd, w, *dims, mask))


def test_half_input_with_float_parameters_gets_float_statistics_on_cpu():
    x, w, b = torch.randn(2, 6, 3, 3, dtype=BF16), torch.randn(6), torch.randn(6)
    actual = native_group_norm(x, w, b, 2, 6, 9, 3, 1e-5)
    assert actual[1].dtype == actual[2].dtype == F32
    assert_same(actual, native(A.native_group_norm, x, w, b, 2, 6, 9, 3, 1e-5))
    assert front.stat_dtype(x, (w, b)) == F32
    assert front.stat_dtype(x.to("meta"), (w.to("meta"), None)) is None  # torch's kernels reject it off CPU


@pytest.mark.parametrize("mask", [[True, False, False], [False, True, False], [False, False, True],
                                  [False, True, True], [True, True, True]])
def test_only_the_gradients_output_mask_asks_for(mask):
    x, w = torch.randn(2, 6, 3, 4), torch.randn(6)
    _, mean, rstd = native(A.native_group_norm, x, w, None, 2, 6, 12, 3, 1e-5)
    dy = torch.randn_like(x)
    actual = native_group_norm_backward(dy, x, mean, rstd, w, 2, 6, 12, 3, mask)
    assert [g is not None for g in actual] == mask
    assert_same(actual, native(A.native_group_norm_backward, dy, x, mean, rstd, w, 2, 6, 12, 3, mask))


def test_no_gradient_asked_calls_no_kernel():
    seen = []
    _, backward = front.entries(forward_kernel, seen.append)
    x = torch.randn(2, 6, 3)
    assert backward(x, x, torch.zeros(2, 3), torch.ones(2, 3), None, 2, 6, 3, 3, [False] * 3) == (None,) * 3
    assert not seen


def test_dx_layout_follows_torchs_kernel():
    """The suggested format on CPU, contiguous elsewhere (here: meta); the input's own strides where dense."""
    cl = torch.empty(2, 6, 3, 4).contiguous(memory_format=CL)
    assert front.dx_format(cl) == (True, CL)
    assert front.dx_format(cl.to("meta")) == (False, torch.contiguous_format)
    assert front.dx_format(cl.to("meta"), like_input=True) == (True, CL)  # aten::group_norm's route
    sliced = torch.empty(2, 6, 3, 8)[..., ::2]
    assert front.dx_format(sliced) == (False, torch.contiguous_format)
    dx, dw, db = front.allocate_backward(sliced, None, 6, (True, False, False), *front.dx_format(sliced))
    assert dx.is_contiguous() and dw is None and db is None
    dx, dw, db = front.allocate_backward(cl, torch.empty(6, dtype=F64), 6, (True, True, True), True, CL)
    assert dx.stride() == cl.stride() and dw.dtype == db.dtype == F64 and dw.shape == (6,)


# --------------------------------------------------------------------------- torch's errors and declines
@pytest.mark.parametrize("weight,bias,group,message", [
    (None, None, 0, "Expected num groups to be greater than 0, got 0"),
    (None, None, 4, r"divisible by num_groups, but got input of shape \[2, 6, 4, 4\] and num_groups=4"),
    (torch.randn(5), None, 3, r"weight to be a vector .* but got weight of shape \[5\]"),
    (None, torch.randn(2, 3), 3, r"bias to be a vector .* but got bias of shape \[0\]"),  # torch prints weight's
])
def test_shape_errors_are_torchs(weight, bias, group, message):
    x = torch.randn(2, 6, 4, 4)
    with pytest.raises(RuntimeError, match=message):
        native(A.native_group_norm, x, weight, bias, 2, 6, 16, group, 1e-5)
    with pytest.raises(RuntimeError, match=message):
        native_group_norm(x, weight, bias, 2, 6, 16, group, 1e-5)


def test_a_grad_of_another_dtype_raises_torchs_error():
    x = torch.randn(2, 6, 4)
    with pytest.raises(RuntimeError, match="Expected scalar types of X and dY are same."):
        native_group_norm_backward(x.double(), x, torch.zeros(2, 3), torch.ones(2, 3), None, 2, 6, 4, 3,
                                   [False] * 3)


X = torch.randn(2, 6, 4, 4)


@pytest.mark.parametrize("args", [
    pytest.param((X, None, None, 2, 6, 15, 3), id="numel"),
    pytest.param((torch.randn(2, 6, 4, 8)[..., ::2], None, None, 2, 6, 16, 3), id="not-dense"),
    pytest.param((X, torch.randn(6, dtype=F64), None, 2, 6, 16, 3), id="mixed-dtypes"),
])
def test_forward_calls_torch_rejects_decline_and_torch_raises(args):
    with pytest.raises(Decline):
        native_group_norm(*args, 1e-5)
    with pytest.raises(RuntimeError):
        native(A.native_group_norm, *args, 1e-5)


@pytest.mark.parametrize("args", [
    pytest.param((X.int(), None, None, 2, 6, 16, 3), id="dtype"),
    pytest.param((torch.randn(0, 6, 4, 4), None, None, 0, 6, 16, 3), id="empty"),
    pytest.param((torch._neg_view(X), None, None, 2, 6, 16, 3), id="negative-view"),
    pytest.param((X, torch.empty(6, device="meta"), None, 2, 6, 16, 3), id="weight-device"),
])
def test_forward_calls_no_kernel_serves_decline(args):
    with pytest.raises(Decline):
        native_group_norm(*args, 1e-5)


_, MEAN, RSTD = native(A.native_group_norm, X, None, None, 2, 6, 16, 3, 1e-5)


@pytest.mark.parametrize("args,torch_raises", [
    pytest.param((X[:1], X, MEAN, RSTD, None, 2, 6, 16, 3, [True, False, False]), True, id="dy-numel"),
    pytest.param((X, X, MEAN, RSTD, None, 2, 6, 16, 3, [True, True, False]), True, id="dweight-without-weight"),
    pytest.param((X, X, MEAN.double(), RSTD.double(), None, 2, 6, 16, 3, [True] * 3), True, id="stat-dtype"),
    pytest.param((X, X, MEAN, RSTD, torch.randn(6, dtype=F64), 2, 6, 16, 3, [True] * 3), True, id="weight-dtype"),
    pytest.param((X, X, MEAN, RSTD, torch.randn(5), 2, 6, 16, 3, [True] * 3), True, id="weight-size"),
    pytest.param((X, X, MEAN.reshape(3, 2).t(), RSTD, None, 2, 6, 16, 3, [True, False, False]), False,
                 id="mean-not-contiguous"),
    pytest.param((torch._neg_view(X), X, MEAN, RSTD, None, 2, 6, 16, 3, [True, False, False]), False,
                 id="dy-negative-view"),
])
def test_backward_calls_the_kernel_cannot_take_decline(args, torch_raises):
    with pytest.raises(Decline):
        native_group_norm_backward(*args)
    if torch_raises:
        with pytest.raises(RuntimeError):
            native(A.native_group_norm_backward, *args)


def test_a_vendor_dtype_set_narrows_what_the_front_accepts():
    forward, backward = front.entries(forward_kernel, backward_kernel, dtypes=frozenset({F16}))
    with pytest.raises(Decline, match="dtype"):
        forward(X, None, None, 2, 6, 16, 3, 1e-5)
    with pytest.raises(Decline, match="dtype"):
        backward(X, X, MEAN, RSTD, None, 2, 6, 16, 3, [True, False, False])
    half = X.half()
    assert_same(forward(half, None, None, 2, 6, 16, 3, 1e-5),
                native(A.native_group_norm, half, None, None, 2, 6, 16, 3, 1e-5))


def test_checks_read_metadata_only():
    """Meta tensors hold no data: every check and layout decision still answers (a plan is built from them)."""
    x, w = torch.empty(2, 6, 4, 4, device="meta").contiguous(memory_format=CL), torch.empty(6, device="meta")
    assert front.check_forward(x, w, None, 2, 6, 16, 3) == F32
    mean = torch.empty(2, 3, device="meta")
    front.check_backward(x, x, mean, mean, w, 2, 6, 16, 3, (True, True, True))
    with pytest.raises(Decline, match="not dense"):
        front.check_forward(x[..., ::2], w, None, 2, 6, 8, 3)
    assert front.check_forward(x[..., ::2], w, None, 2, 6, 8, 3, dense_only=False) == F32


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_allocation_is_plain_empty_calls_the_compiled_entry_replays():
    x, w = torch.randn(2, 6, 3, 4).contiguous(memory_format=CL), torch.randn(6)
    with _Ops() as seen:
        front.allocate_forward(x, 2, 3, CL, F32)
        front.allocate_backward(x, w, 6, (True, True, True), *front.dx_format(x))
        front.allocate_backward(x, None, 6, (True, False, False), False, torch.contiguous_format)
    assert seen.ops and all(op in ALLOCATING for op in seen.ops)


# --------------------------------------------------------------------------- aten::group_norm
def test_group_norm_reads_channels_last_and_keeps_it():
    x, w, b = torch.randn(2, 6, 3, 4).contiguous(memory_format=CL), torch.randn(6), torch.randn(6)
    y = group_norm(x, 3, w, b)
    expected = native(torch.nn.functional.group_norm, x, 3, w, b)
    assert y.is_contiguous(memory_format=CL) and y.stride() == expected.stride()
    torch.testing.assert_close(y, expected, rtol=0, atol=0)


def test_group_norm_takes_any_layout():
    """aten::group_norm's route: a sliced input is not declined (the kernel sees it as passed)."""
    seen = []
    entry = front.group_norm_entry(lambda call: seen.append(call) or forward_kernel(call))
    x = torch.randn(2, 6, 4, 8)[..., ::2]
    y = entry(x, 2)
    assert seen[0].input is x and y.is_contiguous()
    torch.testing.assert_close(y, native(torch.nn.functional.group_norm, x, 2), rtol=0, atol=0)


@pytest.mark.parametrize("args", [
    pytest.param((torch.randn(6), 3), id="rank-1"),
    pytest.param((X, 4), id="groups-do-not-divide"),
    pytest.param((X, 0), id="no-groups"),
    pytest.param((X, 3, torch.randn(6, 1)), id="weight-not-a-vector"),
    pytest.param((X, 3, None, torch.randn(5)), id="bias-size"),
])
def test_group_norm_arguments_the_composite_rejects_decline_and_torch_raises(args):
    assert front.composite_reason(*args, *(None,) * (4 - len(args))) is not None
    with pytest.raises(Decline, match="torch raises"):
        group_norm(*args)
    with pytest.raises((RuntimeError, IndexError)):  # rank 1: IndexError (dim out of range)
        native(A.group_norm, *args)


def test_group_norm_that_needs_a_gradient_declines_to_the_composite():
    x, w, b = torch.randn(2, 6, 3), torch.randn(6, requires_grad=True), torch.randn(6)
    with pytest.raises(Decline, match="gradient needed"):
        group_norm(x, 3, w, b)
    with torch.no_grad():
        assert not group_norm(x, 3, w, b).requires_grad
    assert front.needs_grad(x, w, None) and not front.needs_grad(x, None, b)
    with pytest.raises(Decline, match="bias needs grad without a weight"):
        front.needs_grad(x, None, w)
    with torch.no_grad():
        assert not front.needs_grad(x, None, w)


def test_forward_ad_and_functorch_transforms_decline():
    x = torch.randn(2, 6, 3)
    assert not front.transformed()
    with forward_ad.dual_level():
        assert front.transformed()
        with pytest.raises(Decline, match="forward-mode AD"):
            group_norm(x, 3)
    inside = torch.func.vmap(lambda t: t * float(front.transformed()))(torch.ones(2))
    assert torch.equal(inside, torch.ones(2))


def test_composite_copies_what_is_not_dense_in_torchs_format():
    x = torch.randn(2, 6, 3, 4)
    cl = x.contiguous(memory_format=CL)
    assert not front.composite_copies(x)
    assert front.composite_copies(x[..., :3])
    assert not front.composite_copies(cl)  # the CPU composite keeps channels_last
    assert front.composite_copies(cl.to("meta"))  # elsewhere it copies to contiguous
    assert front.native_format(cl) == CL and front.native_format(cl.to("meta")) == torch.contiguous_format


def test_suggest_memory_format_is_torchs_rule_without_its_import():
    """The front's own channels-last stride rule against ``torch._prims_common``'s on random layouts (size-0 and
    size-1 dimensions, stride 0, gaps, every storage order of rank 4 and 5)."""
    import random

    from torch._prims_common import suggest_memory_format as reference

    rng = random.Random(0)
    for _ in range(3000):
        rank = rng.choice((4, 5))
        sizes = [rng.choice((0, 1, 1, 2, 3, 4)) for _ in range(rank)]
        order = rng.sample(range(rank), rank)
        strides, run = [0] * rank, 1
        for d in reversed(order):
            strides[d] = run * rng.choice((0, 1, 1, 2)) if rng.random() < 0.9 else rng.choice((1, 3, 48))
            run = max(strides[d], 1) * max(sizes[d], 1) + rng.choice((0, 0, 1))
        storage = 0 if 0 in sizes else sum((s - 1) * st for s, st in zip(sizes, strides)) + 1
        t = torch.empty(storage).as_strided(sizes, strides)
        assert front.suggest_memory_format(t) == reference(t), (sizes, strides)
