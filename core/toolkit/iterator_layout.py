"""The output layout torch's TensorIterator gives an elementwise op, from metadata alone.

Fronts whose reference is a composition of elementwise torch ops (``flaggems::rotary_embedding``,
``flaggems::silu_mul``) allocate their outputs with the strides the reference's result would have, since
the conformance kit compares strides. ``meta`` tensors cannot stand in: their Python meta kernels lay some
outputs out differently (a ``[1, 1, S, D]`` tensor whose size-1 dimension has its own stride:
``(S*D, S*D, D, 1)`` from the CPU kernel, ``(S*D, D, D, 1)`` from the meta one).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def contiguous_strides(sizes: Sequence[int]) -> list[int]:
    """torch's contiguous strides of ``sizes``."""
    strides, acc = [0] * len(sizes), 1
    for d in reversed(range(len(sizes))):
        strides[d] = acc
        acc *= max(sizes[d], 1)
    return strides


def _packed(sizes: Sequence[int], strides: Sequence[int], order: Iterable[int]) -> bool:
    """Whether the dimensions, innermost first in ``order``, are packed one after another (size-1 ones ignored)."""
    expected = 1
    for d in order:
        if sizes[d] != 1:
            if strides[d] != expected:
                return False
            expected *= sizes[d]
    return True


def _is_contiguous(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """``is_contiguous()`` from metadata (size-1 dimensions ignored)."""
    return _packed(sizes, strides, reversed(range(len(sizes))))


def _is_channels_last(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """``is_contiguous(memory_format=torch.channels_last)`` (rank 4 only, as torch's flag)."""
    return len(sizes) == 4 and _packed(sizes, strides, (1, 3, 2, 0))


def is_dense(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """``is_non_overlapping_and_dense()``."""
    dims = sorted((d for d in range(len(sizes)) if sizes[d] >= 2), key=lambda d: strides[d])
    expected = 1
    for d in dims:
        if strides[d] != expected:
            return False
        expected *= sizes[d]
    return True


def _should_swap(shape: Sequence[int], operands: Sequence[list[int]], d0: int, d1: int) -> int:
    """TensorIterator's ``reorder_dimensions`` comparison of dimensions ``d0`` and ``d1``."""
    for strides in operands:
        s0, s1 = strides[d0], strides[d1]
        if s0 == 0 or s1 == 0:
            continue
        if s0 != s1:
            return -1 if s0 < s1 else 1
        if shape[d0] > shape[d1]:
            return 1
    return 0


def iterator_strides(shape: Sequence[int], operands: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[int]:
    """The strides TensorIterator gives the output of an elementwise op on ``operands`` (``(sizes, strides)``).

    ``shape`` is their broadcast shape. Its fast set-up first (every operand of
    ``shape`` and contiguous, channels_last or dense with one layout), else the
    dimensions ordered by the operands' strides, ties to the smaller size.
    """
    ndim = len(shape)
    if all(tuple(s) == tuple(shape) for s, _ in operands):
        if all(_is_contiguous(*op) for op in operands):
            return contiguous_strides(shape)
        if all(_is_channels_last(*op) for op in operands):
            order = (1, 3, 2, 0)
            strides, acc = [0] * 4, 1
            for d in order:
                strides[d] = acc
                acc *= max(shape[d], 1)
            return strides
        if all(is_dense(*op) for op in operands) and all(tuple(st) == tuple(operands[0][1]) for _, st in operands):
            return list(operands[0][1])
    padded = []
    for sizes, strides in operands:
        lead = ndim - len(sizes)
        padded.append([0] * lead + [0 if n == 1 and shape[lead + i] != 1 else st
                                    for i, (n, st) in enumerate(zip(sizes, strides, strict=True))])
    perm = list(range(ndim - 1, -1, -1))  # innermost first
    for i in range(1, ndim):
        d1 = i
        for d0 in range(i - 1, -1, -1):
            comparison = _should_swap(shape, padded, perm[d0], perm[d1])
            if comparison > 0:
                perm[d0], perm[d1] = perm[d1], perm[d0]
                d1 = d0
            elif comparison < 0:
                break
    return dense_strides(shape, perm)


#: :func:`layout_code`'s tags: strides dense in a dimension order, or the strides themselves.
DENSE_ORDER, RAW_STRIDES = -1, -2


def dense_strides(sizes: Sequence[int], order: Sequence[int]) -> list[int]:
    """The strides of a dense tensor of ``sizes`` whose dimensions lie in ``order`` (innermost first), as
    TensorIterator lays its outputs out (a size-1 dimension gets the stride of the next one outwards)."""
    strides, acc = [0] * len(sizes), 1
    for d in order:
        strides[d] = acc
        acc *= sizes[d]
    return strides


def layout_code(sizes: Sequence[int], strides: Sequence[int]) -> list[int]:
    """``strides`` described without sizes where possible: ``[DENSE_ORDER, *order]`` when they are
    :func:`dense_strides` of ``sizes`` in ``order``, else ``[RAW_STRIDES, *strides]``. A backward that lays its
    gradients out like the forward's outputs takes the code: one argument for every sequence length."""
    order = sorted(range(len(sizes)), key=lambda d: (strides[d], sizes[d] != 1, d))
    if dense_strides(sizes, order) == list(strides):
        return [DENSE_ORDER, *order]
    return [RAW_STRIDES, *strides]


def strides_of_code(sizes: Sequence[int], code: Sequence[int]) -> tuple[int, ...]:
    """The strides :func:`layout_code` described, for ``sizes``."""
    if code[0] == DENSE_ORDER:
        return tuple(dense_strides(sizes, code[1:]))
    return tuple(code[1:])
