"""The repeat_interleave family's random case generators (the randomized kit): ``repeat_interleave.Tensor``,
``.self_Tensor`` and ``.self_int``.

Same contract as every generator (:mod:`flaggems.testing._generators`): ``output_size`` stays the sum of
the repeats when a case is rebuilt with other values.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import torch

from ...testing import DEVICE_ASSERT
from ...testing._generators import I32, I64, Gen, data, pick_dim, shape
from ...testing._inputs import ALL_COPY_DTYPES


def repeat_list(rng: random.Random, n: int) -> tuple[list[int], str]:
    """``n`` repeats in ``[0, 6]``, drawn by torch's generator (the values seed: the replaying call of a case
    gets other repeats and another total, which a plan must not have kept; a swept case has a million);
    now and then one negative (torch's error)."""
    reps = torch.randint(0, 7, (n,)).tolist()
    if n and rng.random() < 0.05:
        reps[rng.randrange(n)] = -1
        return reps, "negative"
    return reps, "valid"


def output_size(rng: random.Random, total: int, kwargs: dict[str, Any]) -> str:
    """Add ``output_size`` to ``kwargs``: none, the right one, or (rarely) a wrong one."""
    choice = rng.choices(("none", "right", "wrong"), (5, 5, 1))[0]
    if choice != "none":
        kwargs["output_size"] = total + (rng.choice((1, 2)) if choice == "wrong" else 0)
    return choice


def asserts_on_device(state: str, given: str) -> tuple[str, ...]:
    """A negative repeat or a wrong ``output_size``: torch's CPU kernel raises, its CUDA one asserts."""
    return (DEVICE_ASSERT,) if state == "negative" or given == "wrong" else ()


def gen_repeat_tensor(rng: random.Random, dev: torch.device) -> Gen:
    """``repeat_interleave.Tensor(repeats, output_size=)``."""
    reps, state = repeat_list(rng, rng.randint(0, 40))
    repeats = torch.tensor(reps, dtype=rng.choice((I32, I64)), device=dev)
    if len(reps) == 1 and rng.random() < 0.3:
        repeats = repeats.reshape(())
    kwargs: dict[str, Any] = {}
    given = output_size(rng, sum(reps), kwargs)
    return Gen((repeats,), kwargs, tags=asserts_on_device(state, given), kind=f"{state}/{given}")


def gen_repeat_self_tensor(rng: random.Random, dev: torch.device) -> Gen:
    """``repeat_interleave.self_Tensor(self, repeats, dim=, output_size=)``: per-row or one repeat."""
    x_shape = shape(rng, 0, 3)
    dim = None if rng.random() < 0.3 or not x_shape else pick_dim(rng, len(x_shape))
    rows = math.prod(x_shape) if dim is None else x_shape[dim]
    n = 1 if rng.random() < 0.25 else rows
    reps, state = repeat_list(rng, n)
    repeats = torch.tensor(reps, dtype=rng.choice((I32, I64)), device=dev)
    if n == 1 and rng.random() < 0.5:
        repeats = repeats.reshape(())
    kwargs: dict[str, Any] = {} if dim is None else {"dim": dim}
    given = output_size(rng, sum(reps) * (rows if n == 1 else 1), kwargs)
    tags = asserts_on_device(state, given)
    return Gen((data(x_shape, rng.choice(ALL_COPY_DTYPES), dev), repeats), kwargs, tags=tags,
               kind=f"{state}/{given}")


def gen_repeat_self_int(rng: random.Random, dev: torch.device) -> Gen:
    """``repeat_interleave.self_int(self, repeats, dim=, output_size=)``."""
    x_shape = shape(rng, 0, 3)
    dim = None if rng.random() < 0.3 or not x_shape else pick_dim(rng, len(x_shape))
    repeats = rng.choice((0, 1, 2, 3, 4)) if rng.random() > 0.05 else -1
    rows = math.prod(x_shape) if dim is None else x_shape[dim]
    kwargs: dict[str, Any] = {} if dim is None else {"dim": dim}
    given = output_size(rng, rows * repeats, kwargs)
    return Gen((data(x_shape, rng.choice(ALL_COPY_DTYPES), dev), repeats), kwargs,
               tags=asserts_on_device("negative" if repeats < 0 else "valid", given), kind=given)


GENERATORS: dict[str, Callable[[random.Random, torch.device], Gen]] = {
    "repeat_interleave.Tensor": gen_repeat_tensor,
    "repeat_interleave.self_Tensor": gen_repeat_self_tensor,
    "repeat_interleave.self_int": gen_repeat_self_int,
}
