"""The index_select family's random case generator (the randomized kit): ``index_select``.

Same contract as every generator (:mod:`flaggems.testing._generators`).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from ...testing import DEVICE_ASSERT
from ...testing._generators import I32, I64, Gen, data, index_kind, index_values, pick_dim, shape
from ...testing._inputs import ALL_COPY_DTYPES


def gen_index_select(rng: random.Random, dev: torch.device) -> Gen:
    """``index_select(self, dim, index)``: int32/int64, 0-dim or 1-d, repeated and bad indices."""
    dtype = rng.choice(ALL_COPY_DTYPES)
    self_shape = shape(rng, 0, 4)
    dim = pick_dim(rng, len(self_shape))
    size = self_shape[dim] if self_shape else 1
    kind, k = index_kind(rng, size)
    kind = "repeated" if kind == "distinct" else kind
    index = index_values(rng, size, k, kind, dev, rng.choice((I32, I64)))
    if k == 1 and rng.random() < 0.3:
        index = index.reshape(())
    tags = (DEVICE_ASSERT,) if kind == "out-of-range" else ()
    return Gen((data(self_shape, dtype, dev), dim, index), tags=tags, kind=kind)


GENERATORS: dict[str, Callable[[random.Random, torch.device], Gen]] = {
    "index_select": gen_index_select,
}
