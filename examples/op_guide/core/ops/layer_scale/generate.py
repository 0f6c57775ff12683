"""The layer_scale family's random case generator (the randomized kit)."""

from __future__ import annotations

import random

import torch

from flaggems.testing._generators import SIZES, Gen, shape

#: Mostly non-empty shapes (an empty one now and then: the kernel returns it without a launch).
NONEMPTY = tuple(size for size in SIZES if size)


def gen_layer_scale(rng: random.Random, dev: torch.device) -> Gen:
    """``flaggems::layer_scale(x, gamma)`` of a random shape and dtype; gamma a vector of the last dimension."""
    dtype = rng.choice((torch.float32, torch.float16, torch.bfloat16))
    dims = shape(rng, 1, 4, SIZES if rng.random() < 0.1 else NONEMPTY)
    x = torch.randn(dims, dtype=dtype, device=dev)
    gamma = torch.rand(dims[-1:], dtype=dtype, device=dev) + 0.5
    return Gen((x, gamma), ulps=1.0 if dtype == torch.bfloat16 else 0.0, kind=str(dtype))


GENERATORS = {"flaggems::layer_scale": gen_layer_scale}
