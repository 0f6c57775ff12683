"""The index_copy family's random case generators (the randomized kit): ``index_copy_`` and ``index_copy``.

Same contract as every generator (:mod:`flaggems.testing._generators`). An ``index_copy`` with a
duplicated index writes rows torch leaves unspecified (the winner): duplicates are generated only with
equal source rows.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from ...testing import DEVICE_ASSERT
from ...testing._generators import I32, I64, Gen, data, index_kind, index_values, pick_dim, shape
from ...testing._inputs import ALL_COPY_DTYPES


def gen_index_copy(rng: random.Random, dev: torch.device) -> Gen:
    """``index_copy(_)(self, dim, index, source)``: distinct or repeated rows, bad indices, aliasing."""
    kind = rng.choices(("rows", "alias-source", "alias-index", "int32-index"), (20, 1, 1, 1))[0]
    dtype = rng.choice(ALL_COPY_DTYPES)
    self_shape = shape(rng, 0, 4)
    dim = pick_dim(rng, len(self_shape))
    size = self_shape[dim] if self_shape else 1
    if kind == "alias-source":
        x = data(self_shape, dtype, dev)
        return Gen((x, dim, torch.randperm(size, device=dev), x), kind=kind)
    if kind == "alias-index":  # the index is a view of self
        n = rng.randint(1, 8)
        m = rng.randint(0, n)
        x = torch.randperm(n, device=dev)  # distinct: a repeated index with unequal rows has no one answer
        return Gen((x, 0, x[:m], data((m,), I64, dev)), fixed=frozenset((0, 2)), kind=kind)
    index_kind_, k = index_kind(rng, size)
    index = index_values(rng, size, k, index_kind_, dev, I32 if kind == "int32-index" else I64)
    if k == 1 and rng.random() < 0.3:
        index = index.reshape(())
    src_shape = list(self_shape)
    if self_shape:
        src_shape[dim] = k
    table = data(self_shape, dtype, dev)  # source rows read through the index: repeated entries, equal rows
    source = table.index_select(dim, index.reshape(-1).clamp(0, max(size - 1, 0)).long()) if (
        self_shape and size) else data(tuple(src_shape), dtype, dev)
    tags = (DEVICE_ASSERT,) if index_kind_ == "out-of-range" else ()
    return Gen((data(self_shape, dtype, dev), dim, index, source.reshape(src_shape)), tags=tags,
               kind=f"{kind}/{index_kind_}")


GENERATORS: dict[str, Callable[[random.Random, torch.device], Gen]] = {
    "index_copy_": gen_index_copy,
    "index_copy": gen_index_copy,
}
