"""The abs family's random case generator (the randomized kit)."""

from __future__ import annotations

import random

import torch

from flaggems.testing._generators import Gen, data, shape

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.float64)


def gen_abs(rng: random.Random, dev: torch.device) -> Gen:
    """``abs(self)`` of a random shape and dtype (the kit relays it out: the declined layouts too)."""
    dtype = rng.choice(DTYPES)
    return Gen((data(shape(rng, 0, 4), dtype, dev),), kind=str(dtype))


GENERATORS = {"abs": gen_abs}
