"""The unfold family's random case generators (the randomized kit): ``unfold`` and ``unfold_backward``.

Same contract as every generator (:mod:`flaggems.testing._generators`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch

from ...testing._generators import Gen, data, pick_dim, shape
from ...testing._inputs import ALL_COPY_DTYPES, FLOATS


def unfold_args(rng: random.Random, x_shape: tuple[int, ...]) -> tuple[int, int, int, str]:
    """``(dim, size, step)`` for ``x_shape``, now and then invalid (torch's errors)."""
    dim = pick_dim(rng, len(x_shape))
    extent = x_shape[dim] if x_shape else 1
    # a size of at most 8: a swept extent keeps windows x size small
    size, step = rng.randint(0, min(extent, 8)), rng.randint(1, 4)
    kind = rng.choices(("valid", "size", "step"), (18, 1, 1))[0]
    if kind == "size":
        size = extent + 1
    if kind == "step":
        step = rng.choice((0, -1))
    return dim, size, step, kind


def gen_unfold(rng: random.Random, dev: torch.device) -> Gen:
    """``unfold(self, dimension, size, step)`` (a view: strides compared)."""
    x_shape = shape(rng, 0, 4)
    dim, size, step, kind = unfold_args(rng, x_shape)
    return Gen((data(x_shape, rng.choice(ALL_COPY_DTYPES), dev), dim, size, step), kind=kind)


def gen_unfold_backward(rng: random.Random, dev: torch.device) -> Gen:
    """``unfold_backward(grad_in, input_sizes, dim, size, step)``.

    Overlapping windows are sums: one ulp per overlapping window (the cases' tolerance, see
    :mod:`flaggems.ops.unfold.cases`), an ulp of the largest partial sum: a result near zero from
    terms near 8 (a swept case on the H200) differs by ulps of 8 between two summation orders.
    """
    sizes = shape(rng, 1, 4)
    dim, size, step, kind = unfold_args(rng, sizes)
    if kind == "size":
        size = sizes[dim]  # an invalid size gives no gradient shape; the step errors stay
    grad_shape = tuple(torch.empty(sizes, device="meta").unfold(dim, size, max(step, 1)).shape)
    dtype = rng.choice(FLOATS)
    overlap = math.ceil(size / step) if 0 < step < size else 0
    grad = data(grad_shape, dtype, dev)
    reach = overlap * float(grad.abs().max()) if overlap and grad.numel() else 0.0
    scale = 2.0 ** math.ceil(math.log2(reach)) if reach > 1 else 1.0
    return Gen((grad, list(sizes), dim, size, step), ulps=overlap * scale, kind=kind)


GENERATORS: dict[str, Callable[[random.Random, torch.device], Gen]] = {
    "unfold": gen_unfold,
    "unfold_backward": gen_unfold_backward,
}
