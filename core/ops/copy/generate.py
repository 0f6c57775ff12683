"""The copy family's random case generators (the randomized kit): ``copy_`` and ``_to_copy``.

Same contract as every generator (:mod:`flaggems.testing._generators`). Float -> unsigned casts use
non-negative values (negative ones are undefined in C++ and differ between devices); values stay
representable in every dtype.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from ...testing._generators import Gen, data, shape
from ...testing._inputs import ALL_COPY_DTYPES


def broadcast_source(rng: random.Random, dst: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts to ``dst``: leading dims dropped, some dims set to 1."""
    keep = dst[rng.randint(0, len(dst)):] if rng.random() < 0.3 else dst
    return tuple(1 if rng.random() < 0.2 else s for s in keep)


def gen_copy_(rng: random.Random, dev: torch.device) -> Gen:
    """``copy_(self, src)``: casts, broadcasts, self-copy, overlap and expanded-destination errors."""
    kind = rng.choices(("copy", "self", "overlap", "expanded-dst", "bad-shape"), (20, 1, 1, 1, 1))[0]
    dst_t, src_t = rng.choice(ALL_COPY_DTYPES), rng.choice(ALL_COPY_DTYPES)
    kwargs = {"non_blocking": True} if rng.random() < 0.1 else {}
    if kind == "self":
        x = data(shape(rng, 0, 4), dst_t, dev)
        return Gen((x, x), kwargs, kind=kind)
    if kind == "overlap":
        base = data((rng.randint(2, 40),), dst_t, dev)
        return Gen((base[1:], base[:-1]), kwargs, fixed=frozenset((0, 1)), kind=kind)
    dst_shape = shape(rng, 0, 4)
    src_shape = broadcast_source(rng, dst_shape)
    if kind == "bad-shape":
        src_shape = (*src_shape, 2) if src_shape else (3,)
    src = data(src_shape, src_t, dev, nonneg=dst_t == torch.uint8)
    if kind == "expanded-dst" and dst_shape:
        dst = data((1, *dst_shape[1:]), dst_t, dev).expand(max(dst_shape[0], 2), *dst_shape[1:])
        src = data(tuple(dst.shape), src_t, dev, nonneg=dst_t == torch.uint8)
        return Gen((dst, src), kwargs, fixed=frozenset((0,)), kind=kind)
    return Gen((data(dst_shape, dst_t, dev), src), kwargs, kind=kind)


def gen_to_copy(rng: random.Random, dev: torch.device) -> Gen:
    """``_to_copy(self, dtype=, memory_format=, ...)``: every dtype pair and format, ranks 0-5."""
    x_shape = shape(rng, 0, 5)
    src_t = rng.choice(ALL_COPY_DTYPES)
    dtype = rng.choice((None, *ALL_COPY_DTYPES))
    formats = [None, torch.preserve_format, torch.contiguous_format]
    formats += [torch.channels_last] * (3 if len(x_shape) == 4 else 0) + [torch.channels_last_3d] * (
        3 if len(x_shape) == 5 else 0)
    if rng.random() < 0.05:
        formats = [torch.channels_last]  # any rank but 4: torch's error
    kwargs: dict[str, Any] = {"dtype": dtype}
    fmt = rng.choice(formats)
    if fmt is not None:
        kwargs["memory_format"] = fmt
    if rng.random() < 0.2:
        kwargs.update(layout=torch.strided, device=dev, non_blocking=rng.random() < 0.5)
    x = data(x_shape, src_t, dev, nonneg=dtype == torch.uint8)
    return Gen((x,), kwargs, kind=f"format={fmt}")


GENERATORS: dict[str, Callable[[random.Random, torch.device], Gen]] = {
    "copy_": gen_copy_,
    "_to_copy": gen_to_copy,
}
