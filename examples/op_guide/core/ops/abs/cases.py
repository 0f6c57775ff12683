"""Contract cases of ``aten::abs(self)``.

Dense inputs of every dtype the kernel serves, with the values where ``abs``
is subtle (``-0.0``, infinities, NaN, the smallest integers but the minimum),
0-dim and size-1 inputs, and the calls it declines (a transposed or sliced
input, which torch answers in its own layout; an empty one; a dtype it does not
serve). Bit-exact: ``abs`` rounds nothing.
"""

from __future__ import annotations

import torch

from flaggems.types import Case

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64)
SPECIAL = (-0.0, float("inf"), float("-inf"), float("nan"), -1.5, 2.0)


def _values(shape: tuple[int, ...], dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    if dtype.is_floating_point:
        x = torch.randn(shape, device=dev).to(dtype)
        flat = x.view(-1)
        flat[: len(SPECIAL)] = torch.tensor(SPECIAL[: flat.numel()], dtype=dtype)
        return x
    return torch.randint(-1000, 1000, shape, dtype=dtype, device=dev)


def _case(name: str, make_input) -> Case:
    return Case(name, lambda dev: ((make_input(dev),), {}))


def _cases():
    for dtype in DTYPES:
        yield _case(f"dense-{str(dtype).removeprefix('torch.')}", lambda dev, t=dtype: _values((33, 65), t, dev))
    yield _case("zero-dim", lambda dev: torch.tensor(-3.5, device=dev))
    yield _case("size-1", lambda dev: _values((1, 1, 7), torch.float32, dev))
    yield _case("declined-transposed", lambda dev: _values((8, 6), torch.float32, dev).t())
    yield _case("declined-sliced", lambda dev: _values((8, 12), torch.float32, dev)[:, ::3])
    yield _case("declined-empty", lambda dev: torch.empty(0, 4, device=dev))
    yield _case("declined-float64", lambda dev: _values((4, 5), torch.float64, dev))


CASES = {"abs": list(_cases())}
