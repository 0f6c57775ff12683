"""Contract cases of ``aten::unfold`` and ``aten::unfold_backward``.

Arguments exactly as the aten schemas take them: ``unfold(self, dimension,
size, step)`` and ``unfold_backward(grad_in, input_sizes, dim, size, step)``.
``unfold`` is a view: sizes, strides and values are compared (bit-exact).

``unfold_backward`` tolerances: windows that do not overlap are copies
(bit-exact). Overlapping windows are sums; torch's CPU kernel adds in the
gradient's dtype, the gather kernel in fp32 and rounds once, so half types
may differ by one ulp per overlapping window (``ulps=4`` covers the four
windows of these cases); fp32 differs only when torch's summation order does
(a few ulps).
"""

from __future__ import annotations

import itertools

import torch

from flaggems.testing import Case
from flaggems.testing._inputs import short_name, values

F32 = torch.float32


def unfold_case(name: str, make_input, dimension: int, size: int, step: int, **kw) -> Case:
    """``unfold(make_input(dev), dimension, size, step)``."""
    return Case(name, lambda dev: ((make_input(dev), dimension, size, step), {}), **kw)


def _unfold_cases():
    matrix = lambda d: values((5, 7), F32, d)  # noqa: E731 - a small table of inputs
    yield unfold_case("basic", matrix, 1, 3, 2)
    yield unfold_case("dim0", matrix, 0, 2, 1)
    yield unfold_case("negative-dim", matrix, -1, 4, 1)
    yield unfold_case("size-equals-dim-size", matrix, 1, 7, 1)
    yield unfold_case("step-greater-than-size", lambda d: values((5, 12), F32, d), 1, 3, 5)
    yield unfold_case("step-beyond-dim", matrix, 1, 3, 10)
    yield unfold_case("size-zero", matrix, 1, 0, 1)
    yield unfold_case("zero-dim-input", lambda d: values((), F32, d), 0, 1, 1)
    yield unfold_case("zero-dim-input-dim-minus-1", lambda d: values((), F32, d), -1, 1, 3)
    yield unfold_case("zero-dim-input-size-zero", lambda d: values((), F32, d), 0, 0, 1)
    yield unfold_case("empty-input", lambda d: values((0, 3), F32, d), 0, 0, 1)
    yield unfold_case("transposed-input", lambda d: values((7, 5), F32, d).t(), 1, 3, 2)
    yield unfold_case("storage-offset", lambda d: values((20,), F32, d)[3:], 0, 4, 3)
    yield unfold_case("rank4-int64", lambda d: values((2, 3, 8, 4), torch.int64, d), 2, 3, 2)
    yield unfold_case("unfold-of-unfold", lambda d: values((6, 9), F32, d).unfold(1, 4, 2), 0, 2, 2)


def _unfold_error_cases():
    matrix = lambda d: values((5, 7), F32, d)  # noqa: E731
    yield unfold_case("error-size-greater-than-dim", matrix, 1, 8, 1, raises=RuntimeError,
                      match="maximum size for tensor at dimension 1 is 7 but size is 8")
    yield unfold_case("error-zero-dim-size-2", lambda d: values((), F32, d), 0, 2, 1, raises=RuntimeError,
                      match="maximum size for tensor at dimension 0 is 1 but size is 2")
    yield unfold_case("error-negative-size", matrix, 1, -1, 1, raises=RuntimeError,
                      match="size is -1 but must be >= 0")
    yield unfold_case("error-step-zero", matrix, 1, 3, 0, raises=RuntimeError, match="step is 0 but must be > 0")
    yield unfold_case("error-step-negative", matrix, 1, 3, -2, raises=RuntimeError, match="step is -2 but must be > 0")
    yield unfold_case("error-dim-out-of-range", matrix, 2, 3, 1, raises=IndexError,
                      match="Dimension out of range (expected to be in range of [-2, 1], but got 2)")


def backward_case(name: str, input_sizes: list[int], dim: int, size: int, step: int, dtype: torch.dtype = F32,
                  layout=None, **kw) -> Case:
    """``unfold_backward`` of a gradient shaped like ``unfold``'s output; ``layout`` re-strides it."""
    shape = list(torch.empty(input_sizes, device="meta").unfold(dim, size, step).shape)

    def make(dev):
        grad = values(tuple(shape), dtype, dev) if layout is None else layout(shape, dtype, dev)
        return (grad, list(input_sizes), dim, size, step), {}

    return Case(name, make, **kw)


def _permuted(shape, dtype, dev):
    order = list(reversed(range(len(shape))))
    return values(tuple(shape[i] for i in order), dtype, dev).permute(*order)


def _expanded(shape, dtype, dev):
    return values((1, *shape[1:]), dtype, dev).expand(*shape)


def _sliced(shape, dtype, dev):
    return values((shape[0], *shape[1:-1], shape[-1] * 2), dtype, dev)[..., ::2]


def _backward_cases():
    yield backward_case("overlapping-1d", [64], 0, 8, 4, ulps=4)
    yield backward_case("disjoint-step-equals-size", [12], 0, 3, 3)
    yield backward_case("gaps-step-greater-than-size", [10], 0, 3, 5)
    yield backward_case("one-window", [5, 7], 1, 7, 1)
    yield backward_case("size-zero", [5, 7], 1, 0, 1)
    yield backward_case("dim-last-2d", [5, 7], 1, 3, 2, ulps=4)
    yield backward_case("dim0-2d", [7, 5], 0, 3, 1, ulps=4)
    yield backward_case("middle-dim-3d", [3, 9, 4], 1, 4, 2, ulps=4)
    yield backward_case("negative-dim", [3, 9, 4], -2, 4, 3)
    yield backward_case("rank4-middle", [2, 3, 9, 4], 2, 4, 2, ulps=4)
    yield backward_case("permuted-grad", [3, 9, 4], 1, 4, 2, layout=_permuted, ulps=4)
    yield backward_case("expanded-grad", [3, 9, 4], 1, 4, 2, layout=_expanded, ulps=4)
    yield backward_case("sliced-grad", [6, 10], 1, 3, 1, layout=_sliced, ulps=4)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        yield backward_case(f"overlapping-{short_name(dtype)}", [3, 16], 1, 4, 1, dtype, ulps=4)


def _backward_error_cases():
    grad = lambda dev: values((5, 3, 3), F32, dev)  # noqa: E731
    for name, dim, step, exc, match in (
        ("error-step-zero", 1, 0, ValueError, "step is 0 but must be > 0"),
        ("error-step-negative", 1, -1, ValueError, "step is -1 but must be > 0"),
        ("error-dim-out-of-range", 3, 2, IndexError,
         "Dimension out of range (expected to be in range of [-2, 1], but got 3)"),
    ):
        yield Case(name, lambda dev, d=dim, s=step: ((grad(dev), [5, 7], d, 3, s), {}), raises=exc, match=match)


CASES = {
    "unfold": list(itertools.chain(_unfold_cases(), _unfold_error_cases())),
    "unfold_backward": list(itertools.chain(_backward_cases(), _backward_error_cases())),
}
