"""Contract cases of the three ``aten::repeat_interleave`` overloads."""

from __future__ import annotations

import torch

from flaggems.testing import DEVICE_ASSERT, Case
from flaggems.testing._inputs import values


def _repeats(counts, dev, dtype=torch.int64):
    return torch.tensor(counts, device=dev, dtype=dtype)


def _seed_repeats(rows: int, items: int, dev: torch.device) -> torch.Tensor:
    """The seed's pattern: items // rows each, the first items % rows get one more."""
    r = torch.full((rows,), items // rows, dtype=torch.int64, device=dev)
    r[: items % rows] += 1
    return r


def _tensor_cases():
    yield Case("seed-pattern-dynamic", lambda d: ((_seed_repeats(171, 8545, d),), {}))
    yield Case("seed-pattern-known", lambda d: ((_seed_repeats(171, 8545, d),), {"output_size": 8545}))
    yield Case("zeros-inside", lambda d: ((_repeats([1, 0, 3, 0, 0, 2], d),), {}))
    yield Case("int32-repeats", lambda d: ((_repeats([2, 1, 3], d, torch.int32),), {"output_size": 6}))
    yield Case("all-zero", lambda d: ((_repeats([0, 0], d),), {}))
    yield Case("empty-repeats", lambda d: ((_repeats([], d),), {}))
    yield Case("error-negative", lambda d: ((_repeats([1, -2], d),), {}), raises=RuntimeError,
               match="repeats can not be negative")
    yield Case("error-wrong-output-size", lambda d: ((_repeats([1, 2], d),), {"output_size": 4}),
               raises=RuntimeError, match="allocated size does not match required size", tags=(DEVICE_ASSERT,))
    yield Case("error-2d-repeats", lambda d: ((_repeats([[1, 2]], d),), {}), raises=RuntimeError,
               match="1D vector")
    # torch's CPU kernel raises NotImplementedError for float repeats, its CUDA kernel RuntimeError.
    yield Case("error-float-repeats", lambda d: ((torch.ones(2, device=d),), {}),
               raises=(RuntimeError, NotImplementedError))


def _self_tensor_cases():
    f32 = torch.float32
    yield Case("values-seed-pattern", lambda d: ((torch.arange(171, device=d), _seed_repeats(171, 8545, d)), {}))
    yield Case("values-known", lambda d: ((torch.arange(171, device=d), _seed_repeats(171, 8545, d)),
                                          {"output_size": 8545}))
    yield Case("dim0-matrix", lambda d: ((values((3, 5), f32, d), _repeats([2, 0, 1], d)), {"dim": 0}))
    yield Case("dim1-transposed", lambda d: ((values((5, 3), f32, d).t(), _repeats([1, 2, 3, 0, 1], d)), {"dim": 1}))
    yield Case("dim-none-flattens", lambda d: ((values((2, 2), f32, d), _repeats([1, 2, 0, 3], d)), {}))
    yield Case("scalar-tensor-repeats", lambda d: ((values((3, 4), f32, d), _repeats(2, d)), {"dim": 1}))
    yield Case("scalar-tensor-known", lambda d: ((values((3, 4), f32, d), _repeats([3], d)),
                                                 {"dim": 0, "output_size": 9}))
    yield Case("bf16-values", lambda d: ((values((6,), torch.bfloat16, d), _repeats([1, 2, 3, 0, 1, 1], d)), {}))
    yield Case("error-size-mismatch", lambda d: ((values((2, 3), f32, d), _repeats([1, 2, 3], d)), {"dim": 0}),
               raises=RuntimeError, match="repeats must have the same size as input along dim")
    yield Case("error-negative", lambda d: ((torch.arange(2, device=d), _repeats([1, -1], d)), {}),
               raises=RuntimeError, match="negative")
    yield Case("error-wrong-output-size", lambda d: ((torch.arange(2, device=d), _repeats([1, 2], d)),
                                                     {"output_size": 5}),
               raises=RuntimeError, match="allocated size does not match required size", tags=(DEVICE_ASSERT,))
    yield Case("error-dim-of-0-dim-input", lambda d: ((values((), f32, d), _repeats([2], d)), {"dim": 0}),
               raises=IndexError, match="Dimension specified as 0 but tensor has no dimensions")
    yield Case("zero-dim-input-flattens", lambda d: ((values((), f32, d), _repeats([3], d)), {}))


def _self_int_cases():
    f32 = torch.float32
    yield Case("bf16-4x64-by-4", lambda d: ((values((40, 6), torch.bfloat16, d), 4), {"dim": 0}))
    yield Case("dim1", lambda d: ((values((3, 5), f32, d), 3), {"dim": 1}))
    yield Case("dim-neg-3d", lambda d: ((values((2, 3, 4), f32, d), 2), {"dim": -1}))
    yield Case("dim-none", lambda d: ((values((3, 4), f32, d), 2), {}))
    yield Case("transposed", lambda d: ((values((4, 3), f32, d).t(), 2), {"dim": 0}))
    yield Case("zero-repeats", lambda d: ((values((3, 4), f32, d), 0), {"dim": 0}))
    yield Case("output-size-given", lambda d: ((values((3, 4), f32, d), 2), {"dim": 1, "output_size": 8}))
    yield Case("int64-input", lambda d: ((values((7,), torch.int64, d), 3), {}))
    yield Case("error-negative", lambda d: ((values((3,), f32, d), -1), {}), raises=RuntimeError,
               match="non-negative")
    yield Case("error-wrong-output-size", lambda d: ((values((2, 4), f32, d), 2), {"dim": 1, "output_size": 9}),
               raises=RuntimeError, match="Invalid output_size")
    yield Case("error-dim-of-0-dim-input", lambda d: ((values((), f32, d), 2), {"dim": 0}), raises=IndexError,
               match="Dimension out of range")
    yield Case("zero-dim-input-flattens", lambda d: ((values((), f32, d), 2), {}))


CASES = {
    "repeat_interleave.Tensor": list(_tensor_cases()),
    "repeat_interleave.self_Tensor": list(_self_tensor_cases()),
    "repeat_interleave.self_int": list(_self_int_cases()),
}
