"""Public fronts of copy_ / _to_copy, index_select and unfold / unfold_backward (``flaggems.fronts``).

Each front is driven with a stand-in vendor kernel that computes with torch's
own ops under ``native_scope()``: whatever the front hands a kernel, the
result must equal torch's, and every call torch rejects must decline (or raise
torch's own error) before the kernel runs.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from flaggems import Decline
from flaggems.binding import native_scope
from flaggems.fronts import copy as copy_front
from flaggems.fronts import index_select as select_front
from flaggems.fronts import unfold as unfold_front
from flaggems.toolkit import checks

A = torch.ops.aten


def native(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with every op on torch's own kernel."""
    with native_scope():
        return fn(*args, **kwargs)


def native_error(fn, *args, **kwargs) -> BaseException:
    """The exception torch's own kernels raise for the call."""
    with native_scope(), pytest.raises(Exception) as caught:
        fn(*args, **kwargs)
    return caught.value


def assert_same_error(ours: pytest.ExceptionInfo, theirs: BaseException) -> None:
    assert type(ours.value) is type(theirs) and str(ours.value) == str(theirs)


# --------------------------------------------------------------------------- copy_ / _to_copy
class CopyKernels:
    """Stand-in dense and strided copy kernels recording what the front hands them."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def dense(self, dst: torch.Tensor, src: torch.Tensor, numel: int) -> None:
        assert dst.is_contiguous() and src.is_contiguous() and dst.shape == src.shape and numel == dst.numel() > 0
        self.calls.append(("dense", dst, src))
        with native_scope():
            dst.copy_(src)

    def strided(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        assert dst.shape == src.shape and dst.numel() > 0
        assert torch._debug_has_internal_overlap(dst) != 1
        self.calls.append(("strided", dst, src))
        with native_scope():
            dst.copy_(src)

    @property
    def kinds(self) -> list[str]:
        return [kind for kind, *_ in self.calls]


@pytest.fixture
def kernels() -> CopyKernels:
    return CopyKernels()


@pytest.fixture
def copy_entries(kernels):
    return copy_front.entries(copy_dense=kernels.dense, copy_strided=kernels.strided)


def _copy_layouts():
    return {
        "dense cast": (lambda: torch.empty(4096, dtype=torch.bfloat16), lambda: torch.randn(4096)),
        "0-dim": (lambda: torch.tensor(1.0), lambda: torch.tensor(7, dtype=torch.int32)),
        "0-dim source broadcast": (lambda: torch.empty(3, 4), lambda: torch.tensor(2.5)),
        "expanded source": (lambda: torch.empty(2, 3, 8, dtype=torch.float16), lambda: torch.randn(3, 1)),
        "lower-rank source": (lambda: torch.empty(5, 6), lambda: torch.arange(6)),
        "transposed source": (lambda: torch.empty(6, 5), lambda: torch.randn(5, 6).t()),
        "strided destination": (lambda: torch.zeros(6, 10)[:, ::2], lambda: torch.randn(6, 5, dtype=torch.float64)),
        "permuted both": (lambda: torch.empty(4, 3, 2).permute(2, 0, 1), lambda: torch.randn(2, 3, 4).transpose(1, 2)),
        "bool from float": (lambda: torch.empty(7, dtype=torch.bool), lambda: torch.tensor([0.0, 1, -2, 0, 3, 0, 1])),
    }


@pytest.mark.parametrize("name", list(_copy_layouts()))
def test_copy_behind_the_front_matches_torch(kernels, copy_entries, name):
    copy_, _ = copy_entries
    make_dst, make_src = _copy_layouts()[name]
    torch.manual_seed(0)
    dst, src = make_dst(), make_src()
    expected = native(lambda: dst.clone().copy_(src))
    assert copy_(dst, src) is dst
    assert torch.equal(dst, expected)
    dense = dst.shape == src.shape and dst.is_contiguous() and src.is_contiguous()
    assert kernels.kinds == ["dense" if dense else "strided"]


def test_the_strided_kernel_gets_the_source_expanded(kernels, copy_entries):
    copy_, _ = copy_entries
    dst, src = torch.empty(4, 3), torch.randn(3)
    copy_(dst, src)
    (_, got_dst, got_src), = kernels.calls
    assert got_dst is dst and got_src.shape == (4, 3) and got_src.stride() == (0, 1)


def test_a_strided_kernel_alone_serves_dense_calls_too(kernels):
    copy_, to_copy = copy_front.entries(copy_strided=kernels.strided)
    dst, src = torch.empty(10), torch.randn(10)
    copy_(dst, src)
    out = to_copy(src, dtype=torch.float16)
    assert kernels.kinds == ["strided", "strided"]
    assert torch.equal(dst, src) and torch.equal(out, native(src.to, torch.float16))


def test_a_dense_kernel_alone_declines_what_needs_strides(kernels):
    copy_, to_copy = copy_front.entries(copy_dense=kernels.dense)
    with pytest.raises(Decline, match="dense operands only"):
        copy_(torch.empty(3, 4), torch.randn(4))
    with pytest.raises(Decline, match="dense operands only"):
        to_copy(torch.randn(4, 3).t(), dtype=torch.float16)
    dst = torch.empty(4)
    copy_(dst, torch.ones(4))
    assert kernels.kinds == ["dense"] and torch.equal(dst, torch.ones(4))


def test_entries_needs_a_kernel_and_real_dtypes(kernels):
    with pytest.raises(TypeError):
        copy_front.entries()
    with pytest.raises(ValueError, match="complex"):
        copy_front.entries(kernels.dense, dtypes=frozenset({torch.complex64}))


@pytest.mark.parametrize("dst, src, reason", [
    (torch.empty(2, dtype=torch.complex64), torch.randn(2, dtype=torch.complex64), "dtype pair"),
    (torch.empty(2), torch.randn(2, dtype=torch.complex64), "dtype pair"),
    (torch.empty(2, dtype=torch.float8_e4m3fn), torch.randn(2), "dtype pair"),
    (torch.empty(3), torch._neg_view(torch.randn(3)), "negative view bit"),
    (torch._neg_view(torch.empty(3)), torch.randn(3), "negative view bit"),
])
def test_copy_declines_what_the_kernels_do_not_move(kernels, copy_entries, dst, src, reason):
    copy_, _ = copy_entries
    with pytest.raises(Decline, match=reason):
        copy_(dst, src)
    assert kernels.calls == []


def test_copy_decline_reasons():
    assert copy_front.decline_reason(torch.empty(2), torch.empty(2, device="meta")).startswith("cross-device copy")
    assert copy_front.decline_reason(torch.empty(2), torch.empty(2)) is None
    narrow = frozenset({torch.float16})
    assert copy_front.decline_reason(torch.empty(2), torch.empty(2, dtype=torch.float16), narrow) == (
        "dtype pair torch.float16 -> torch.float32")


def test_a_vendor_dtype_set_narrows_both_entries(kernels):
    copy_, to_copy = copy_front.entries(kernels.dense, kernels.strided, dtypes=frozenset({torch.float16}))
    with pytest.raises(Decline, match="dtype pair"):
        copy_(torch.empty(3, dtype=torch.float16), torch.randn(3))
    with pytest.raises(Decline, match="dtype pair"):
        to_copy(torch.randn(3, dtype=torch.float16), dtype=torch.float32)
    assert kernels.calls == []
    out = to_copy(torch.randn(3, dtype=torch.float16))
    assert out.dtype == torch.float16 and kernels.kinds == ["dense"]


def test_internal_overlap_raises_torchs_error_and_writes_nothing(kernels, copy_entries):
    copy_, _ = copy_entries
    base = torch.zeros(3)
    theirs = native_error(lambda: base.expand(4, 3).copy_(torch.ones(4, 3)))
    with pytest.raises(RuntimeError) as ours:
        copy_(base.expand(4, 3), torch.ones(4, 3))
    assert_same_error(ours, theirs)
    assert str(ours.value) == copy_front.INTERNAL_OVERLAP
    assert torch.equal(base, torch.zeros(3)) and kernels.calls == []


@pytest.mark.parametrize("dst_shape, src_shape", [((4,), (3, 4)), ((3, 4), (5,)), ((0, 3), (4,)), ((2, 3), (2, 1, 3))])
def test_a_source_that_does_not_broadcast_raises_torchs_error(kernels, copy_entries, dst_shape, src_shape):
    copy_, _ = copy_entries
    theirs = native_error(lambda: torch.zeros(dst_shape).copy_(torch.ones(src_shape)))
    with pytest.raises(RuntimeError) as ours:
        copy_(torch.zeros(dst_shape), torch.ones(src_shape))
    assert_same_error(ours, theirs)
    with pytest.raises(RuntimeError) as direct:
        copy_front.broadcast(torch.ones(src_shape), torch.zeros(dst_shape))
    assert_same_error(direct, theirs)
    assert kernels.calls == []


def test_same_view_is_a_no_op(kernels, copy_entries):
    copy_, _ = copy_entries
    x = torch.randn(4, 5)
    before = x.clone()
    assert copy_(x, x) is x
    assert copy_(x.t(), x.t()) is not None
    assert copy_(x[:, ::2], x[:, ::2]) is not None
    assert kernels.calls == [] and torch.equal(x, before)
    assert copy_front.overlap(x.t(), x.t()) == "same"


@pytest.mark.parametrize("make", [
    lambda x: (x[1:], x[:-1]),  # dense, shifted by one element
    lambda x: (x.view(torch.int32), x),  # same memory, other dtype: not a no-op
    lambda x: (x.view(4, 4).t(), x.view(4, 4)),  # strided, transposed onto itself
    lambda x: (x[::2], x[1::2]),  # interleaved views: their address ranges intersect
])
def test_partial_overlap_declines(kernels, copy_entries, make):
    copy_, _ = copy_entries
    x = torch.randn(16)
    dst, src = make(x)
    with pytest.raises(Decline, match="partially overlap"):
        copy_(dst, src)
    assert kernels.calls == []


def test_empty_copies_call_no_kernel(kernels, copy_entries):
    copy_, to_copy = copy_entries
    dst = torch.empty(0, 5)
    assert copy_(dst, torch.randn(5)) is dst
    assert copy_(torch.empty(0), torch.empty(0)) is not None
    assert copy_(torch.empty(3, 0).t(), torch.empty(0, 3)) is not None
    out = to_copy(torch.empty(2, 0, 3), dtype=torch.int8)
    assert out.shape == (2, 0, 3) and out.dtype == torch.int8 and kernels.calls == []


_TO_COPY_INPUTS = {
    "contiguous": lambda: torch.randn(3, 4, 5),
    "transposed": lambda: torch.randn(4, 6).t(),
    "channels_last": lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
    "sliced (not dense)": lambda: torch.randn(6, 8)[:, 1::3],
    "expanded (overlapping)": lambda: torch.randn(5, 1).expand(5, 4),
    "0-dim": lambda: torch.tensor(3.5),
    "permuted": lambda: torch.randn(2, 3, 4).permute(1, 2, 0),
}


_MEMORY_FORMATS = [(name, memory_format) for name in _TO_COPY_INPUTS
                   for memory_format in (None, torch.preserve_format, torch.contiguous_format, torch.channels_last)
                   if memory_format is not torch.channels_last or name == "channels_last"]


@pytest.mark.parametrize("name, memory_format", _MEMORY_FORMATS)
@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.int32])
def test_to_copy_allocates_as_torch_and_matches(kernels, copy_entries, name, memory_format, dtype):
    _, to_copy = copy_entries
    x = _TO_COPY_INPUTS[name]()
    expected = native(A._to_copy, x, dtype=dtype, memory_format=memory_format)
    actual = to_copy(x, dtype=dtype, memory_format=memory_format)
    assert actual.shape == expected.shape and actual.stride() == expected.stride()
    assert actual.dtype == expected.dtype and torch.equal(actual, expected)
    assert copy_front.allocate(x, dtype, memory_format).stride() == expected.stride()
    dense = x.is_contiguous() and actual.is_contiguous()
    assert kernels.kinds == ["dense" if dense else "strided"]


@pytest.mark.parametrize("kwargs, reason", [
    (dict(device="meta"), "device change"),
    (dict(pin_memory=True), "pin_memory"),
    (dict(layout=torch.sparse_coo), "non-strided layout"),
    (dict(dtype=torch.complex64), "dtype pair"),
    (dict(dtype=torch.float8_e5m2), "dtype pair"),
])
def test_to_copy_declines(kernels, copy_entries, kwargs, reason):
    _, to_copy = copy_entries
    with pytest.raises(Decline, match=reason):
        to_copy(torch.randn(3), **kwargs)
    assert kernels.calls == []


def test_to_copy_declines_view_bits_and_unsupported_inputs(kernels, copy_entries):
    _, to_copy = copy_entries
    with pytest.raises(Decline, match="conj/neg view bit"):
        to_copy(torch._neg_view(torch.randn(3)))
    with pytest.raises(Decline, match="dtype pair"):
        to_copy(torch.randn(3, dtype=torch.complex64).conj())
    assert kernels.calls == []


def test_to_copy_on_the_same_device_named_explicitly_is_served(kernels, copy_entries):
    _, to_copy = copy_entries
    x = torch.randn(6)
    out = to_copy(x, dtype=torch.float16, device=torch.device("cpu"), layout=torch.strided, pin_memory=False)
    assert torch.equal(out, native(x.to, torch.float16)) and kernels.kinds == ["dense"]
    assert copy_front.to_copy_decline_reason(x, device="cpu") is None


def test_the_generic_plugin_uses_the_copy_front():
    from flaggems.plugins.generic import copy_, to_copy

    assert copy_.INTERNAL_OVERLAP is copy_front.INTERNAL_OVERLAP
    assert copy_.copy_.__qualname__.startswith("entries.") and to_copy.to_copy is copy_.to_copy


# --------------------------------------------------------------------------- index_select
def reference_gather(call: select_front.Call) -> None:
    """A vendor kernel stand-in: torch's own index_select into the front's output."""
    assert call.out.is_contiguous() and call.out.numel() and call.index.dim() == 1 and call.source.dim() >= 1
    with native_scope():
        torch.index_select(call.source, call.dim, call.index, out=call.out)


index_select = select_front.entries(reference_gather)


def _select_inputs():
    return {
        "rows": (lambda: torch.randn(5, 4), 0, torch.tensor([4, 0, 0, 2])),
        "last dim, negative": (lambda: torch.randn(3, 5, 6), -1, torch.tensor([5, 1])),
        "middle, int32 index": (lambda: torch.randn(3, 5, 6), 1, torch.tensor([4, 3, 0], dtype=torch.int32)),
        "transposed source": (lambda: torch.randn(6, 5).t(), 1, torch.tensor([0, 5, 2])),
        "sliced source": (lambda: torch.randn(8, 9)[1::2, ::3], 0, torch.tensor([3, 3, 1])),
        "0-dim index": (lambda: torch.randn(4, 3), 1, torch.tensor(2)),
        "0-dim self, 1-element index": (lambda: torch.tensor(3.0), 0, torch.tensor([0])),
        "0-dim self, 0-dim index": (lambda: torch.tensor(3, dtype=torch.int16), -1, torch.tensor(0)),
        "empty index": (lambda: torch.randn(3, 4), 1, torch.tensor([], dtype=torch.int64)),
        "bool": (lambda: torch.randn(4, 4) > 0, 0, torch.tensor([1, 3])),
    }


@pytest.mark.parametrize("name", list(_select_inputs()))
def test_index_select_behind_the_front_matches_torch(name):
    make, dim, index = _select_inputs()[name]
    torch.manual_seed(0)
    x = make()
    expected = native(torch.index_select, x, dim, index)
    actual = index_select(x, dim, index)
    assert actual.shape == expected.shape and actual.stride() == expected.stride() and actual.is_contiguous()
    assert actual.dtype == expected.dtype and torch.equal(actual, expected)


def test_prepare_normalises_the_call():
    call = select_front.prepare(torch.tensor(2.0), -1, torch.tensor(0))
    assert (call.source.shape, call.dim, call.index.shape, call.out.shape) == ((1,), 0, (1,), (1,))
    x = torch.randn(3, 5, 7)
    call = select_front.prepare(x, -2, torch.tensor([1, 1]))
    assert call.source is x and call.dim == 1 and call.out.shape == (3, 2, 7) and call.out.is_contiguous()


def test_the_kernel_is_not_called_when_nothing_is_written():
    seen = []
    entry = select_front.entries(seen.append)
    assert entry(torch.randn(3, 4), 1, torch.tensor([], dtype=torch.int64)).shape == (3, 0)
    assert seen == []


@pytest.mark.parametrize("args", [
    (torch.randn(3, 4), 1, torch.tensor([[0, 1]])),  # index of rank 2
    (torch.randn(3, 4), 1, torch.tensor([0.0])),  # float index
    (torch.randn(3, 4), 1, torch.tensor([0], dtype=torch.int16)),  # int16 index
    (torch.randn(3, 4), 2, torch.tensor([0])),  # dim out of range
    (torch.randn(3, 4), -3, torch.tensor([0])),  # dim out of range
    (torch.tensor(1.0), 1, torch.tensor([0])),  # 0-dim self, dim out of range
    (torch.tensor(1.0), 0, torch.tensor([0, 0])),  # 0-dim self, two indices
    (torch.randn(3, 0), 1, torch.tensor([0])),  # indices into an empty dimension
    (torch.randn(0, 4), 1, torch.tensor([2])),  # an empty source: nothing to gather
    (torch.randn(3, 0), 1, torch.tensor([], dtype=torch.int64)),  # empty source and index
    (torch.zeros(2, 0, dtype=torch.bool), 0, torch.tensor([0, 4, 1])),  # empty source, torch's CPU RuntimeError
    (torch.randn(3, 4), 1, torch.tensor([0], device="meta")),  # devices differ
    (torch.randn(3, 4, dtype=torch.complex64), 1, torch.tensor([0])),  # dtype
    (torch.randn(3, 4).to_sparse(), 1, torch.tensor([0])),  # layout
])
def test_what_torch_rejects_declines_to_the_native_kernel(args):
    with pytest.raises(Decline):
        index_select(*args)


def test_a_vendor_dtype_set_narrows_index_select():
    entry = select_front.entries(reference_gather, dtypes=frozenset({torch.float16}))
    with pytest.raises(Decline):
        entry(torch.randn(3, 2), 0, torch.tensor([1]))
    assert torch.equal(entry(torch.ones(3, 2, dtype=torch.float16), 0, torch.tensor([1])),
                       torch.ones(1, 2, dtype=torch.float16))


@pytest.mark.parametrize("shape, dim, bad", [((3, 4), 1, [0, 7]), ((3, 4), 0, [7]), ((5,), 0, [-1]),
                                             ((3, 4, 5), 1, [9]), ((3, 4, 5), -1, [5]), ((), 0, [1])])
def test_out_of_range_indices_raise_torchs_cpu_error_when_checking(monkeypatch, shape, dim, bad):
    monkeypatch.setattr(checks, "enabled", lambda: True)
    x, index = torch.randn(shape), torch.tensor(bad)
    theirs = native_error(torch.index_select, x, dim, index)
    with pytest.raises(Exception) as ours:
        index_select(x, dim, index)
    assert_same_error(ours, theirs)


def test_without_checks_the_index_reaches_the_kernel_unchecked(monkeypatch):
    monkeypatch.setattr(checks, "enabled", lambda: False)
    seen = []
    select_front.entries(seen.append)(torch.randn(3, 4), 0, torch.tensor([9]))
    assert len(seen) == 1 and seen[0].index.tolist() == [9]


def test_a_kernel_may_decline_a_layout():
    def picky(call):
        raise Decline("layout")

    with pytest.raises(Decline, match="layout"):
        select_front.entries(picky)(torch.randn(3, 4), 0, torch.tensor([1]))


# --------------------------------------------------------------------------- unfold / unfold_backward
@pytest.mark.parametrize("shape, dim, size, step", [
    ((10,), 0, 3, 2), ((4, 9), 1, 9, 1), ((4, 9), -1, 2, 5), ((3, 4, 5), 0, 2, 1), ((), 0, 1, 1), ((), -1, 0, 3),
    ((6, 0), 1, 0, 1), ((7, 3), 0, 7, 100),
])
def test_unfold_view_matches_torch(shape, dim, size, step):
    base = torch.randn(100)
    x = base[3:3 + (torch.Size(shape).numel())].view(shape) if shape else base[3]
    expected = native(x.unfold, dim, size, step)
    actual = unfold_front.unfold(x, dim, size, step)
    assert (actual.shape, actual.stride(), actual.storage_offset()) == (
        expected.shape, expected.stride(), expected.storage_offset())
    assert actual.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


@pytest.mark.parametrize("shape, dim, size, step", [
    ((4, 9), 2, 2, 1), ((4, 9), -3, 2, 1), ((), 1, 1, 1), ((4, 9), 1, 10, 1), ((), 0, 2, 1), ((4, 9), 1, -1, 1),
    ((4, 9), 1, 2, 0), ((4, 9), 0, 2, -1),
])
def test_unfold_raises_torchs_errors(shape, dim, size, step):
    x = torch.randn(shape)
    theirs = native_error(x.unfold, dim, size, step)
    with pytest.raises(Exception) as ours:
        unfold_front.unfold(x, dim, size, step)
    assert_same_error(ours, theirs)


def test_wrap_dim_is_torchs():
    assert unfold_front.wrap_dim(-1, 3) == 2 and unfold_front.wrap_dim(0, 0) == 0
    with pytest.raises(IndexError, match=r"range of \[-2, 1\], but got 2"):
        unfold_front.wrap_dim(2, 2)
    with pytest.raises(IndexError, match="dimension specified as 0 but tensor has no dimensions"):
        unfold_front.wrap_dim(0, 0, wrap_scalar=False)


def reference_backward(call: unfold_front.BackwardCall) -> None:
    """A vendor kernel stand-in: torch's own unfold_backward into the front's output."""
    assert call.out.is_contiguous() and call.out.numel() and call.grad.numel()
    with native_scope():
        call.out.copy_(A.unfold_backward(call.grad, list(call.out.shape), call.dim, call.size, call.step))


unfold_backward = unfold_front.entries(reference_backward)


def _grad(input_sizes, dim, size, step, transposed=False):
    x = torch.zeros(input_sizes)
    shape = native(x.unfold, dim, size, step).shape
    grad = torch.randn(shape)
    return grad.transpose(0, -1).contiguous().transpose(0, -1) if transposed else grad


@pytest.mark.parametrize("input_sizes, dim, size, step, transposed", [
    ([20], 0, 4, 2, False), ([3, 20], 1, 4, 3, False), ([3, 20], -1, 5, 7, True), ([6, 4, 5], 0, 2, 1, True),
    ([6, 4, 5], 1, 4, 4, False), ([5], 0, 5, 1, False),
])
def test_unfold_backward_behind_the_front_matches_torch(input_sizes, dim, size, step, transposed):
    torch.manual_seed(0)
    grad = _grad(input_sizes, dim, size, step, transposed)
    expected = native(A.unfold_backward, grad, input_sizes, dim, size, step)
    actual = unfold_backward(grad, input_sizes, dim, size, step)
    assert actual.stride() == expected.stride() and actual.dtype == expected.dtype
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("input_sizes, dim, size, step", [([5, 0], 0, 2, 1), ([5], 0, 0, 2), ([0], 0, 0, 1)])
def test_empty_unfold_backward_is_zeros_without_the_kernel(input_sizes, dim, size, step):
    seen = []
    grad = _grad(input_sizes, dim, size, step)
    expected = native(A.unfold_backward, grad, input_sizes, dim, size, step)
    actual = unfold_front.entries(seen.append)(grad, input_sizes, dim, size, step)
    assert seen == [] and actual.stride() == expected.stride() and torch.equal(actual, expected)


@pytest.mark.parametrize("grad, input_sizes, dim, size, step, reason", [
    (torch.randn(5, 4, 3), [5, 7], 1, 3, 2, "grad shape"),  # 4 windows where unfold gives 3
    (torch.randn(1, 1), [], 0, 1, 1, "0-dim input"),
    (torch.randn(1, 6), [5], 0, 6, 1, "size outside"),
    (torch.randn(2, 2), [4], 0, 2, 1, "grad shape"),
    (torch.randn(3, 2).to(torch.int32), [4], 0, 2, 1, "dtype"),
    (torch._neg_view(torch.randn(3, 2)), [4], 0, 2, 1, "dtype"),
    (torch.randn(3, 2).to_sparse(), [4], 0, 2, 1, "dtype"),
])
def test_unfold_backward_declines_what_torchs_kernel_decides(grad, input_sizes, dim, size, step, reason):
    with pytest.raises(Decline, match=reason):
        unfold_backward(grad, input_sizes, dim, size, step)


def test_unfold_backward_errors():
    with pytest.raises(ValueError, match="step is 0 but must be > 0"):
        unfold_backward(torch.randn(3, 2), [4], 0, 2, 0)
    with pytest.raises(IndexError, match="Dimension out of range"):
        unfold_backward(torch.randn(3, 2), [4], 1, 2, 1)


def test_a_vendor_dtype_set_narrows_unfold_backward():
    entry = unfold_front.entries(reference_backward, dtypes=frozenset({torch.float16}))
    with pytest.raises(Decline, match="dtype"):
        entry(torch.randn(3, 2), [4], 0, 2, 1)
    out = entry(torch.ones(3, 2, dtype=torch.float16), [4], 0, 2, 1)
    assert out.dtype == torch.float16 and out.tolist() == [1.0, 2.0, 2.0, 1.0]


def test_geometries_are_validated_once(monkeypatch):
    counted = []
    original = unfold_front.backward_geometry
    monkeypatch.setattr(unfold_front, "backward_geometry", lambda *a: counted.append(a) or original(*a))
    entry = unfold_front.entries(reference_backward)
    grad = _grad([3, 20], 1, 4, 3)
    first = entry(grad, [3, 20], 1, 4, 3)
    assert torch.equal(entry(grad.clone(), [3, 20], 1, 4, 3), first) and len(counted) == 1


def test_allocate_grad_input():
    geometry = unfold_front.backward_geometry(torch.randn(3, 2, 4), [3, 5], 1, 4, 1)
    assert (geometry.sizes, geometry.dim, geometry.empty) == ((3, 5), 1, False)
    out = unfold_front.allocate_grad_input(torch.randn(3, 2, 4, dtype=torch.bfloat16), geometry)
    assert out.shape == (3, 5) and out.dtype == torch.bfloat16 and out.is_contiguous()
    empty = unfold_front.backward_geometry(torch.randn(0, 2, 4), [0, 5], -1, 4, 1)
    assert empty.empty and empty.dim == 1


def test_the_generic_plugin_uses_the_unfold_front():
    from flaggems.plugins.generic import unfold as uf

    assert uf.unfold is unfold_front.unfold and uf.wrap_dim is unfold_front.wrap_dim
    assert uf.FLOAT_DTYPES is unfold_front.BACKWARD_DTYPES


def test_the_fronts_import_no_triton():
    code = ("import sys; import flaggems.fronts.copy, flaggems.fronts.index_select, flaggems.fronts.unfold; "
            "print(sorted(m for m in sys.modules if m.startswith('triton') or 'plugins.generic.' in m))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
