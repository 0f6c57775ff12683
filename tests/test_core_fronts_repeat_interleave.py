"""The public ``repeat_interleave`` front (``flaggems.fronts.repeat_interleave``): torch's semantics, any kernel."""

from __future__ import annotations

import pytest
import torch
from conftest import set_kernel_context
from torch.utils._python_dispatch import TorchDispatchMode

from flaggems import Decline
from flaggems.binding import native_scope
from flaggems.fronts import repeat_interleave as front
from flaggems.planner import ALLOCATING, METADATA_ONLY


def reference_expand(repeats: torch.Tensor, output_size: int | None, values: torch.Tensor | None) -> torch.Tensor:
    """A vendor expand stand-in: torch's own row ids, counted (one sync) when the size is unknown."""
    source = repeats if values is None else values
    with native_scope():
        if output_size is None:
            total, smallest = int(repeats.sum()), int(repeats.min())
            out = front.expanded(source, total, smallest)
        else:
            out = front.expanded(source, output_size)
        rows = torch.repeat_interleave(repeats, output_size=out.numel())
        out.copy_(rows if values is None else values[rows])
    return out


def reference_gather(out: torch.Tensor, source: torch.Tensor, dim: int, rows: torch.Tensor | None,
                     repeat: int | torch.Tensor | None) -> None:
    """A vendor gather stand-in: ``index_select`` by the row ids, or by ``p // repeat``."""
    with native_scope():
        if rows is None:
            count = repeat if isinstance(repeat, int) else int(repeat[0])
            rows = torch.arange(out.shape[dim], device=out.device) // count
        out.copy_(source.index_select(dim, rows))


tensor_entry, self_tensor_entry, self_int_entry = front.entries(reference_expand, reference_gather)


class Spy:
    """Kernels that record their calls and write nothing (or run the stand-ins with ``run``)."""

    def __init__(self, run: bool = False) -> None:
        self.calls: list[tuple] = []
        self.run = run
        self.tensor, self.self_tensor, self.self_int = front.entries(self.expand, self.gather)

    def expand(self, repeats, output_size, values):
        self.calls.append(("expand", repeats, output_size, values))
        if self.run:
            return reference_expand(repeats, output_size, values)
        return front.expanded(repeats if values is None else values, output_size)

    def gather(self, out, source, dim, rows, repeat):
        self.calls.append(("gather", out, source, dim, rows, repeat))
        if self.run:
            reference_gather(out, source, dim, rows, repeat)


def native(fn, *args, **kwargs):
    with native_scope():
        return fn(*args, **kwargs)


def r(*counts, dtype=torch.int64):
    return torch.tensor(counts, dtype=dtype)


SELF_TENSOR_CASES = {
    "vector": (torch.arange(5), r(2, 0, 1, 3, 1), None, None),
    "vector known": (torch.arange(5.0), r(2, 0, 1, 3, 1), 0, 7),
    "int32 repeats, strided values": (torch.arange(10.0)[::2], r(1, 2, 0, 1, 4, dtype=torch.int32), -1, None),
    "matrix dim 0": (torch.randn(3, 4), r(2, 0, 1), 0, None),
    "transposed dim 1": (torch.randn(5, 3).t(), r(1, 2, 3, 0, 1), 1, 7),
    "3-d dim -2": (torch.randn(2, 3, 4), r(1, 0, 2), -2, None),
    "dim None flattens": (torch.randn(2, 2), r(1, 2, 0, 3), None, None),
    "0-dim input flattens": (torch.tensor(2.5), r(3), None, None),
    "scalar tensor repeats": (torch.randn(3, 4), torch.tensor(2), 1, None),
    "one-element repeats, known": (torch.randn(3, 4), r(3), 0, 9),
    "one row, one repeat": (torch.randn(1, 4), r(3), 0, None),
    "bf16": (torch.randn(6).to(torch.bfloat16), r(1, 2, 3, 0, 1, 1), None, None),
    "empty dim": (torch.randn(0, 3), r(), 0, None),
    "all zero": (torch.randn(2, 3), r(0, 0), 0, None),
    "all zero known": (torch.arange(2), r(0, 0), 0, 0),
    "zero scalar repeat": (torch.randn(3, 4), torch.tensor(0), 1, 0),
    # one repeat over no rows: torch expands it to nothing and checks neither its sign nor output_size
    "negative repeat, no rows": (torch.randn(0, 3), torch.tensor([-2]), 0, None),
    "0-dim negative repeat, no elements": (torch.randn(0, 3), torch.tensor(-2), None, None),
    "wrong output_size, no rows": (torch.randn(0, 3), torch.tensor([2]), 0, 1),
}


def _matches_torch(entry, x, repeats, dim, output_size) -> None:
    expected = native(torch.repeat_interleave, x, repeats, dim, output_size=output_size)
    out = entry(x, repeats, dim, output_size)
    assert out.dtype == expected.dtype and out.shape == expected.shape and torch.equal(out, expected)
    assert out.is_contiguous()


@pytest.mark.parametrize("case", SELF_TENSOR_CASES, ids=list(SELF_TENSOR_CASES))
def test_self_tensor_behind_the_front_matches_torch(case):
    _matches_torch(self_tensor_entry, *SELF_TENSOR_CASES[case])


SELF_INT_CASES = {
    "dim 0": (torch.randn(4, 3).to(torch.bfloat16), 4, 0, None),
    "dim 1 known": (torch.randn(3, 5), 3, 1, 15),
    "dim -1, 3-d": (torch.randn(2, 3, 4), 2, -1, None),
    "dim None flattens": (torch.randn(3, 4), 2, None, None),
    "transposed": (torch.randn(4, 3).t(), 2, 0, None),
    "zero repeats": (torch.randn(3, 4), 0, 0, None),
    "int64 input": (torch.arange(7), 3, None, None),
    "0-dim input flattens": (torch.tensor(1.5), 2, None, None),
    "empty input": (torch.randn(0, 4), 3, 0, 0),
}


@pytest.mark.parametrize("case", SELF_INT_CASES, ids=list(SELF_INT_CASES))
def test_self_int_behind_the_front_matches_torch(case):
    _matches_torch(self_int_entry, *SELF_INT_CASES[case])


@pytest.mark.parametrize("repeats", [r(3, 0, 2, 1), r(2, 1, 3, dtype=torch.int32), r(0, 0), r(4)[:0],
                                     torch.arange(12)[::3]], ids=["int64", "int32", "all-zero", "empty", "strided"])
@pytest.mark.parametrize("known", [False, True], ids=["dynamic", "output_size"])
def test_tensor_behind_the_front_matches_torch(repeats, known):
    output_size = int(repeats.sum()) if known else None
    expected = native(torch.repeat_interleave, repeats, output_size=output_size)
    out = tensor_entry(repeats, output_size)
    assert out.dtype == expected.dtype == repeats.dtype and torch.equal(out, expected)


def test_the_kernels_get_the_normalised_calls():
    spy = Spy(run=True)
    repeats, x = r(2, 0, 3), torch.arange(3.0)
    spy.tensor(repeats, 5)
    assert spy.calls == [("expand", repeats, 5, None)]
    spy.calls.clear()
    spy.self_tensor(x, repeats, None, 5)  # a vector: the expand gathers the values itself
    assert spy.calls == [("expand", repeats, 5, x)]
    spy.calls.clear()
    matrix = torch.randn(3, 2)
    out = spy.self_tensor(matrix, repeats, 0)  # the row ids, then a gather by them
    (_, rows_in, size, values), (kind, out_seen, source, dim, rows, repeat) = spy.calls
    assert (rows_in, size, values, kind, source, dim, repeat) == (repeats, None, None, "gather", matrix, 0, None)
    assert out_seen is out and rows.tolist() == [0, 0, 2, 2, 2]
    spy.calls.clear()
    three = torch.tensor(3)
    spy.self_tensor(matrix, three, -1, 6)  # a scalar-tensor repeat: a gather dividing by it, read on the device
    ((kind, out, source, dim, rows, repeat),) = spy.calls
    assert (kind, out.shape, dim, rows) == ("gather", (3, 6), 1, None)
    assert repeat.shape == (1,) and repeat.data_ptr() == three.data_ptr()
    spy.calls.clear()
    spy.self_int(matrix.t(), 2, 1)  # a Python repeat: a gather dividing by it; source keeps its strides
    ((kind, out, source, dim, rows, repeat),) = spy.calls
    assert (kind, out.shape, dim, rows, repeat) == ("gather", (2, 6), 1, None, 2)
    assert source.stride() == matrix.t().stride() and out.is_contiguous()


def test_nothing_to_write_calls_no_kernel():
    spy = Spy()
    assert spy.tensor(r(), 5).shape == (0,)  # empty repeats: empty result, whatever output_size says
    out = spy.tensor(r(0, 0, dtype=torch.int32), 0)
    assert out.shape == (0,) and out.dtype == torch.int32
    out = spy.self_tensor(torch.arange(3.0), r(0, 0, 0), None, 0)
    assert out.shape == (0,) and out.dtype == torch.float32
    assert spy.self_tensor(torch.randn(0, 4), r(), 0, 3).shape == (0, 4)
    assert spy.self_tensor(torch.randn(2, 4), torch.tensor(0), 1, None).shape == (2, 0)  # a zero scalar repeat
    assert spy.self_int(torch.randn(2, 4), 0, 0).shape == (0, 4)
    assert spy.calls == []


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


KNOWN_SIZE_CALLS = {  # entry, then its arguments
    "tensor": lambda: ("tensor", r(2, 0, 3), 5),
    "values": lambda: ("self_tensor", torch.arange(3.0), r(2, 0, 3), 0, 5),
    "matrix": lambda: ("self_tensor", torch.randn(3, 2), r(2, 0, 3), 0, 5),
    "scalar-tensor": lambda: ("self_tensor", torch.randn(3, 2), torch.tensor(2), 0, 6),
    "one-element, flattened": lambda: ("self_tensor", torch.randn(3, 2), r(2), None, 12),
    "self_int known": lambda: ("self_int", torch.randn(3, 2), 2, None, 12),
    "self_int": lambda: ("self_int", torch.randn(3, 2), 2, 1),
}


@pytest.mark.parametrize("case", KNOWN_SIZE_CALLS, ids=list(KNOWN_SIZE_CALLS))
def test_known_size_paths_only_allocate_and_view_with_checks_off(case, monkeypatch):
    """No sync, no fill, no copy: what the compiled entry replays (and a CUDA graph captures)."""
    set_kernel_context(monkeypatch, checks=False)
    spy = Spy()
    entry, *args = KNOWN_SIZE_CALLS[case]()
    with _Ops() as ops:
        getattr(spy, entry)(*args)
    extra = [f for f in ops.seen if not (f in ALLOCATING or f in METADATA_ONLY or getattr(f, "is_view", False))]
    assert extra == [] and any(f in ALLOCATING for f in ops.seen)
    assert spy.calls


@pytest.mark.parametrize("args", [
    (r(3, -2, 4), 5),
    (r(3, 2, 4), 8),
])
def test_checks_raise_torchs_errors_before_the_known_size_expand(args, monkeypatch):
    set_kernel_context(monkeypatch, checks=True)  # the checking contract (default on CPU, opt-in on a GPU)
    spy = Spy()
    repeats, output_size = args
    with native_scope(), pytest.raises(RuntimeError) as native_error:
        torch.repeat_interleave(repeats, output_size=output_size)
    with pytest.raises(RuntimeError) as ours:
        spy.tensor(repeats, output_size)
    message = "repeats can not be negative" if int(repeats.min()) < 0 else "allocated size does not match"
    assert message in str(ours.value) and message in str(native_error.value)
    with pytest.raises(RuntimeError, match=message):
        spy.self_tensor(torch.arange(3.0), repeats, 0, output_size)
    with pytest.raises(RuntimeError, match=message):
        spy.self_tensor(torch.randn(3, 2), repeats, 0, output_size)
    assert spy.calls == []


def test_checks_off_the_known_size_expand_gets_output_size_as_given(monkeypatch):
    set_kernel_context(monkeypatch, checks=False)
    spy = Spy()
    assert spy.tensor(r(3, -2, 4), 5).shape == (5,)
    assert spy.self_tensor(torch.arange(3.0), r(1, 1, 1), 0, 8).shape == (8,)
    assert [call[2] for call in spy.calls] == [5, 8]


def test_the_dynamic_size_reports_a_negative_repeat_through_expanded():
    with pytest.raises(RuntimeError, match="repeats can not be negative"):
        tensor_entry(r(1, -2))
    with pytest.raises(RuntimeError, match="repeats can not be negative"):
        self_tensor_entry(torch.arange(2), r(1, -1))
    out = front.expanded(torch.empty(0, dtype=torch.int32), 4)
    assert out.shape == (4,) and out.dtype == torch.int32


@pytest.mark.parametrize("checking", [True, False])
def test_scalar_tensor_repeats(checking, monkeypatch):
    """One sync reads the count without output_size or with checks on; torch's errors then."""
    set_kernel_context(monkeypatch, checks=checking)
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="repeats can not be negative"):
        self_tensor_entry(x, torch.tensor(-1), 0)
    wrong = Spy()
    if checking:
        with pytest.raises(RuntimeError, match="allocated size does not match required size"):
            wrong.self_tensor(x, torch.tensor(2), 0, 7)
        assert wrong.calls == []
    else:
        assert wrong.self_tensor(x, torch.tensor(2), 0, 7).shape == (7, 4)  # as given: the gather stays in bounds


DECLINED_WHERE_TORCH_RAISES = {
    "tensor: 2-d repeats": (lambda e: e.tensor(torch.tensor([[1, 2]])), lambda: torch.repeat_interleave(
        torch.tensor([[1, 2]]))),
    "tensor: float repeats": (lambda e: e.tensor(torch.ones(2)), lambda: torch.repeat_interleave(torch.ones(2))),
    "self_Tensor: size mismatch": (lambda e: e.self_tensor(torch.randn(2, 3), r(1, 2, 3), 0),
                                   lambda: torch.repeat_interleave(torch.randn(2, 3), r(1, 2, 3), 0)),
    "self_Tensor: dim of a 0-dim input": (lambda e: e.self_tensor(torch.tensor(1.0), r(2), 0),
                                          lambda: torch.repeat_interleave(torch.tensor(1.0), r(2), 0)),
    "self_Tensor: dim out of range": (lambda e: e.self_tensor(torch.randn(2, 3), r(1, 2), 2),
                                      lambda: torch.repeat_interleave(torch.randn(2, 3), r(1, 2), 2)),
    "self_Tensor: float repeats": (lambda e: e.self_tensor(torch.randn(2), torch.ones(2), 0),
                                   lambda: torch.repeat_interleave(torch.randn(2), torch.ones(2), 0)),
    "self_Tensor: 2-d repeats": (lambda e: e.self_tensor(torch.randn(2, 2), r(1, 1, 1, 1).view(2, 2), 0),
                                 lambda: torch.repeat_interleave(torch.randn(2, 2), r(1, 1, 1, 1).view(2, 2), 0)),
    "self_int: negative": (lambda e: e.self_int(torch.randn(3), -1), lambda: torch.repeat_interleave(
        torch.randn(3), -1)),
    "self_int: wrong output_size": (lambda e: e.self_int(torch.randn(2, 4), 2, 1, 9),
                                    lambda: torch.repeat_interleave(torch.randn(2, 4), 2, 1, output_size=9)),
    "self_int: dim of a 0-dim input": (lambda e: e.self_int(torch.tensor(1.0), 2, 0),
                                       lambda: torch.repeat_interleave(torch.tensor(1.0), 2, 0)),
    "self_int: dim out of range": (lambda e: e.self_int(torch.randn(2, 3), 2, -3),
                                   lambda: torch.repeat_interleave(torch.randn(2, 3), 2, -3)),
}


@pytest.mark.parametrize("case", DECLINED_WHERE_TORCH_RAISES, ids=list(DECLINED_WHERE_TORCH_RAISES))
def test_what_torch_rejects_declines_to_the_native_kernel(case):
    ours, torchs = DECLINED_WHERE_TORCH_RAISES[case]
    spy = Spy()
    with pytest.raises(Decline):
        ours(spy)
    with native_scope(), pytest.raises((RuntimeError, IndexError, NotImplementedError)):
        torchs()
    assert spy.calls == []


def test_what_torch_serves_otherwise_declines_to_the_native_composite():
    spy = Spy()
    x = torch.randn(3, 2, requires_grad=True)
    declined = [
        lambda: spy.self_int(x, 2, 0),  # autograd: torch's composite records the graph
        lambda: spy.self_tensor(x, r(1, 2, 0), 0),
        lambda: spy.self_tensor(torch.randn(1, 2), torch.tensor(3), 0),  # 0-dim repeats on a length-1 dim
        lambda: spy.self_tensor(torch.randn(3), torch.empty(3, dtype=torch.int64, device="meta"), 0),  # devices
        lambda: spy.self_int(torch.randn(3).to(torch.complex64), 2),  # a dtype outside the set
    ]
    for call in declined:
        with pytest.raises(Decline):
            call()
    with torch.no_grad():
        assert spy.self_int(x, 2, 0).shape == (6, 2)  # no graph needed: served
    assert len(spy.calls) == 1


def test_a_vendor_dtype_set_narrows_self_and_max_rows_bounds_the_expand():
    tensor, self_tensor, self_int = front.entries(reference_expand, reference_gather,
                                                  dtypes=frozenset({torch.float16}), max_rows=3)
    with pytest.raises(Decline):
        self_int(torch.randn(3), 2)
    with pytest.raises(Decline):
        self_tensor(torch.randn(2), r(1, 2))
    assert self_int(torch.randn(3).half(), 2).shape == (6,)
    assert torch.equal(tensor(r(1, 2), 3), r(0, 1, 1))  # repeats' dtypes are torch's, whatever the set
    with pytest.raises(Decline):
        tensor(r(1, 2, 3))  # three rows: max_rows
    with pytest.raises(Decline):
        self_tensor(torch.randn(3, 2).half(), r(1, 2, 3), 0)
    assert self_tensor(torch.randn(3, 2).half(), torch.tensor(2), 0).shape == (6, 2)  # no expand: no bound


def test_the_generic_plugin_serves_through_the_front():
    from flaggems.plugins.generic import repeat_interleave as generic

    for entry in (generic.repeat_interleave_tensor, generic.repeat_interleave_self_tensor,
                  generic.repeat_interleave_self_int):
        assert entry.__module__ == front.__name__
    assert generic._checked_output_size is front.check_output_size
