"""Host-side layout algebra for elementwise kernels (pure Python, no torch).

Kernels see shapes *after* :func:`collapse_dims`: size-1 dimensions dropped,
dimensions ordered by the first operand's strides (outermost first) and
neighbours merged wherever they are contiguous in every operand. A dense copy
of any layout becomes rank 1; a broadcast or a transpose becomes rank 2.
"""

from __future__ import annotations

from collections.abc import Hashable, MutableMapping, Sequence
from typing import TypeVar

Strides = tuple[int, ...]
PlanT = TypeVar("PlanT")

#: Entries a per-layout plan cache holds before it starts over: a bound, so a stream of new
#: shapes cannot grow it without end.
PLAN_CACHE_SIZE = 4096
#: Bytes of a GPU memory sector: the unit of a global memory transaction, and of the L2 cache's
#: partial writes (a store narrower than a sector leaves it partial).
SECTOR_BYTES = 32


def remember(cache: MutableMapping[Hashable, PlanT], key: Hashable, plan: PlanT) -> PlanT:
    """Store ``plan`` under ``key`` in a per-layout plan cache (emptied when full) and return it.

    Only a cache miss calls this; the hit stays an inline ``dict.get`` on the hot path.
    """
    if len(cache) >= PLAN_CACHE_SIZE:
        cache.clear()
    cache[key] = plan
    return plan


def collapse_dims(shape: Sequence[int], *stride_lists: Sequence[int]) -> tuple[tuple[int, ...], tuple[Strides, ...]]:
    """Collapse a shape shared by several operands into the fewest dimensions.

    Args:
        shape: the common (already broadcast) shape.
        stride_lists: one stride list per operand, in elements; the first
            operand decides the order (its largest stride goes first).

    Returns:
        ``(sizes, strides_per_operand)`` outermost first. A shape with no
        element other than size-1 dimensions collapses to rank 0.

    Example: ``collapse_dims((4, 1, 3), (3, 3, 1), (0, 0, 1))`` gives
    ``((4, 3), ((3, 1), (0, 1)))``.
    """
    if any(len(s) != len(shape) for s in stride_lists):
        raise ValueError("every stride list must have one entry per dimension")
    dims = [d for d in range(len(shape)) if shape[d] != 1]
    # Outermost first by the first operand; ties broken by the other operands.
    dims.sort(key=lambda d: tuple(-abs(s[d]) for s in stride_lists))
    sizes: list[int] = []
    strides: list[list[int]] = [[] for _ in stride_lists]
    for d in dims:
        if sizes and all(st[-1] == s[d] * shape[d] for st, s in zip(strides, stride_lists, strict=True)):
            sizes[-1] *= shape[d]
            for st, s in zip(strides, stride_lists, strict=True):
                st[-1] = s[d]
            continue
        sizes.append(shape[d])
        for st, s in zip(strides, stride_lists, strict=True):
            st.append(s[d])
    return tuple(sizes), tuple(tuple(st) for st in strides)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host integers.

    ``triton.cdiv`` is a JIT function: called from Python it costs ~6 µs
    (CI host), more than this module's whole plan look-up.
    """
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``); ``triton.next_power_of_2`` costs ~6 µs."""
    return 1 << max(n - 1, 0).bit_length()


def span(sizes: Sequence[int], strides: Sequence[int]) -> int:
    """Distance in elements between the first and the last element addressed."""
    return sum((n - 1) * abs(s) for n, s in zip(sizes, strides, strict=True))


def move_dim(sizes: Sequence[int], strides: Sequence[Sequence[int]], source: int,
             target: int) -> tuple[tuple[int, ...], tuple[Strides, ...]]:
    """Move dimension ``source`` to position ``target`` in every operand (a valid reordering)."""
    order = list(range(len(sizes)))
    order.insert(target, order.pop(source))
    return tuple(sizes[d] for d in order), tuple(tuple(st[d] for d in order) for st in strides)


def byte_range(tensor) -> tuple[int, int]:  # noqa: ANN001 - any tensor-like: shape, stride, data_ptr
    """``[first, last)`` device addresses a strided tensor's elements occupy (empty: ``(0, 0)``)."""
    if any(size == 0 for size in tensor.shape):
        return 0, 0
    start = tensor.data_ptr()
    reach = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return start, start + (reach + 1) * tensor.element_size()


def overlaps(a, b) -> bool:  # noqa: ANN001 - any tensor-likes with untyped_storage(), as for byte_range
    """Whether two tensors' address ranges intersect (they may share an element).

    Tensors on different storages never do (as in torch's own check); that
    test comes first because it is cheap (0.7 µs for both on the CI host,
    against ~4 µs per :func:`byte_range`).
    """
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, a1 = byte_range(a)
    b0, b1 = byte_range(b)
    return a0 < b1 and b0 < a1
