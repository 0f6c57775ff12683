"""Size sweeps: one random case built again at other sizes of its layout class.

The compiled entry serves a call whose exact sizes it has not planned from the
generic plan of its *layout class* (sizes bucketed by powers of two; see
:mod:`flaggems.generalize`). A kit case built once plans; to check the generic
plans themselves, a *sweep* builds the same case (the same structural draws) at
several sizes: while :func:`active` is on, each shape the generators draw has
one dimension of size >= 2 grown into a power-of-two bucket and drawn at random
inside it, from a generator of its own (the case's other draws are unchanged).
The first points of a class plan; the rest are served by the generic plan made
from them, and compared with torch like any call.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Iterator

_STATE: list[tuple[random.Random, int]] = []


@contextlib.contextmanager
def active(seed: int, variant: int, max_numel: int) -> Iterator[None]:
    """Grow the shapes drawn inside (variant ``variant`` of the sweep seeded ``seed``), each to at most
    ``max_numel`` elements."""
    _STATE.append((random.Random(seed * 1_000_003 + variant), max_numel))
    try:
        yield
    finally:
        _STATE.pop()


def grow(dims: tuple[int, ...], candidates: range | None = None) -> tuple[int, ...]:
    """``dims`` with its last dimension of size >= 2 (among ``candidates``, all by default) drawn anew:
    scaled by the largest power of two that keeps the shape within the sweep's element limit, then a random
    size inside that power-of-two bucket. Unchanged outside a sweep."""
    if not _STATE:
        return dims
    rng, max_numel = _STATE[-1]
    where = [d for d in (candidates if candidates is not None else range(len(dims))) if dims[d] >= 2]
    if not where:
        return dims
    d = where[-1]
    rest = max(math.prod(dims[:d] + dims[d + 1:]), 1)  # an empty tensor's other dimensions still bound it
    scale = 1
    while rest * _bucket_top(dims[d] * scale * 2) <= max_numel:
        scale *= 2
    top = _bucket_top(dims[d] * scale)
    grown = rng.randint(top // 2 + 1, top)
    return (*dims[:d], grown, *dims[d + 1:])


def _bucket_top(n: int) -> int:
    """The upper end of ``n``'s power-of-two bucket (the compiled entry's class key): 2**ceil(log2 n)."""
    return 1 << max(n - 1, 0).bit_length()
