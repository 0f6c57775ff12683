"""Shared helpers of the randomized kit's random case generators: the :class:`Gen` record, shapes, dims, values.

Each op family's generators live in its folder (``flaggems/ops/<family>/generate.py``, ``GENERATORS``:
op -> generator; :meth:`flaggems.families.OpSpec.generators`); the fused ops' shared helpers (layouts, argument
spellings, gradients) are :mod:`flaggems.testing._generators_fused`.

A generator is ``gen(rng, dev) -> Gen``: every decision (shapes, dtypes, dims,
kinds of index, repeats, scalar arguments) comes from ``rng`` (a
:class:`random.Random`), tensor values from torch's generator. Built twice from
the same ``rng`` seed with different torch seeds, a case keeps its layout and
validity (an out-of-range index stays out of range, ``output_size`` stays the
sum of the repeats) and changes only values: the dispatcher check plans with
the first and replays with the second.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _sweep
from ._inputs import nonneg_values, values

#: Sizes a random dimension takes (0 and 1 included on purpose).
SIZES = (0, 1, 1, 2, 3, 4, 5, 7)
#: The largest tensor a generator builds (Triton's interpreter is slow).
MAX_NUMEL = 2048
I64, I32 = torch.int64, torch.int32


@dataclass
class Gen:
    """A generated case: arguments, tolerances and the arguments whose layout is part of the case."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    ulps: float = 0.0
    check_strides: bool = True
    tags: tuple[str, ...] = ()
    fixed: frozenset = frozenset()  # argument positions/names the relayout must leave as they are
    kind: str = ""


def shape(rng: random.Random, low: int, high: int, sizes: tuple[int, ...] = SIZES) -> tuple[int, ...]:
    """A random shape of rank ``low..high`` with at most :data:`MAX_NUMEL` elements."""
    while True:
        dims = tuple(rng.choice(sizes) for _ in range(rng.randint(low, high)))
        if math.prod(dims) <= MAX_NUMEL:
            return _sweep.grow(dims)


def pick_dim(rng: random.Random, rank: int) -> int:
    """A valid dim of a rank-``rank`` tensor, negative half of the time (0 or -1 for a 0-dim one)."""
    rank = max(rank, 1)
    dim = rng.randrange(rank)
    return dim - rank if rng.random() < 0.5 else dim


def data(shape_: tuple[int, ...], dtype: torch.dtype, dev: torch.device, nonneg: bool = False) -> torch.Tensor:
    """Values valid in every copy dtype (see :func:`flaggems.testing._inputs.values`)."""
    return (nonneg_values if nonneg else values)(shape_, dtype, dev)


def randn(shape_: tuple[int, ...], dtype: torch.dtype, dev: torch.device, scale: float = 1.0,
          shift: float = 0.0) -> torch.Tensor:
    """Normal values drawn in float64 (the same values whatever the dtype), then ``dtype``."""
    return (torch.randn(shape_, device=dev, dtype=torch.float64) * scale + shift).to(dtype)


# -- indices (index_copy, index_select) ------------------------------------------------------------------------

def bad_index(rng: random.Random, size: int) -> int:
    """An index outside ``[0, size)``."""
    return size + rng.randrange(3) if rng.random() < 0.6 else -1 - rng.randrange(3)


def index_values(rng: random.Random, size: int, k: int, kind: str, dev: torch.device,
                 dtype: torch.dtype = I64) -> torch.Tensor:
    """``k`` indices into ``[0, size)``: ``distinct``, ``repeated`` or with one ``out-of-range``."""
    if kind == "distinct":
        idx = torch.randperm(size, device=dev)[:k]
    else:
        idx = torch.randint(0, max(size, 1), (k,), device=dev)
    if kind == "out-of-range":
        idx[rng.randrange(k)] = bad_index(rng, size)
    return idx.to(dtype)


def index_kind(rng: random.Random, size: int) -> tuple[str, int]:
    """A kind of index and its length (out-of-range where an index exists)."""
    kind = rng.choices(("distinct", "repeated", "out-of-range"), (6, 3, 1))[0]
    if size == 0 and kind != "out-of-range":
        return kind, 0
    if kind == "out-of-range":
        return kind, rng.randint(1, 5)
    if kind == "distinct":
        return kind, rng.randint(0, size)
    return kind, rng.randint(0, size + 3)
