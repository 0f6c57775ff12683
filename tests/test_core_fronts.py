"""Public op fronts (``flaggems.fronts``): torch's semantics handed to any kernel."""

from __future__ import annotations

import pytest
import torch

from flaggems import Decline
from flaggems.binding import native_scope
from flaggems.fronts import index_copy as front


def reference_kernel(call: front.Call) -> None:
    """A vendor kernel stand-in: torch's own index_copy_ on the normalised call."""
    with native_scope():
        if call.out is not None:
            call.out.copy_(call.self)
        call.target.index_copy_(call.dim, call.index, call.source)


index_copy_, index_copy = front.entries(reference_kernel)


def test_a_kernel_behind_the_front_matches_torch():
    x, src = torch.randn(4, 5), torch.randn(4, 2)
    index = torch.tensor([3, 0])
    with native_scope():
        expected = x.index_copy(-1, index, src)
    out = index_copy(x.t().contiguous().t(), -1, index, src)  # a transposed self: result contiguous as torch's
    assert torch.equal(out, expected) and out.is_contiguous()
    y = x.clone()
    assert index_copy_(y, 1, index, src) is y and torch.equal(y, expected)


def test_zero_dim_operands_are_one_element_vectors():
    seen = []
    entry_inplace, entry = front.entries(lambda call: seen.append(call) or reference_kernel(call))
    x = torch.tensor(1.0)
    out = entry(x, 0, torch.tensor([0]), torch.tensor(5.0))
    assert out.shape == () and out.item() == 5.0 and seen[0].self.shape == (1,) and seen[0].dim == 0


@pytest.mark.parametrize("args", [
    (torch.randn(3, 4), 2, torch.tensor([0]), torch.randn(3, 1)),  # dim out of range
    (torch.randn(3, 4), 1, torch.tensor([0], dtype=torch.int32), torch.randn(3, 1)),  # index dtype
    (torch.randn(3, 4), 1, torch.tensor([0, 1]), torch.randn(3, 1)),  # index length
    (torch.randn(3, 4), 1, torch.tensor([0]), torch.randn(3, 1, dtype=torch.float64)),  # dtypes differ
    (torch.randn(1, 4).expand(3, 4), 1, torch.tensor([0]), torch.randn(3, 1)),  # self overlaps itself
    (torch.randn(0, 5), 1, torch.tensor([0, 4, 1]), torch.randn(0, 3)),  # empty self: CUDA raises its own errors
    (torch.randn(0), 0, torch.tensor([], dtype=torch.int64), torch.randn(0)),  # empty, source aliasing on CUDA
])
def test_what_torch_rejects_declines_to_the_native_kernel(args):
    with pytest.raises(Decline):
        index_copy_(*args)


def test_out_of_range_index_raises_torchs_index_error_when_checking():
    with pytest.raises(IndexError, match="index 7 is out of bounds for dimension 0 with size 3"):
        index_copy_(torch.randn(3, 2), 0, torch.tensor([7]), torch.randn(1, 2))


def test_a_vendor_dtype_set_narrows_what_the_front_accepts():
    inplace, _ = front.entries(reference_kernel, dtypes=frozenset({torch.float16}))
    with pytest.raises(Decline):
        inplace(torch.randn(3, 2), 0, torch.tensor([1]), torch.randn(1, 2))
