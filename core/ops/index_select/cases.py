"""Contract cases of ``aten::index_select`` (self, dim, index)."""

from __future__ import annotations

import torch

from flaggems.testing import DEVICE_ASSERT, Case
from flaggems.testing._inputs import ALL_COPY_DTYPES, short_name, values


def _select(name, make_self, dim, index, index_dtype=torch.int64, **kw):  # kw: Case fields
    return Case(name, lambda d: ((make_self(d), dim, torch.tensor(index, device=d, dtype=index_dtype)), {}), **kw)


def _cases():
    for dtype in ALL_COPY_DTYPES:
        yield _select(f"dim1-{short_name(dtype)}", lambda d, t=dtype: values((6, 33), t, d), 1, [0, 32, 5, 5, 17])
    f32 = torch.float32
    yield _select("dim0", lambda d: values((40, 9), f32, d), 0, [39, 0, 7, 7])
    yield _select("dim-last-int32-index", lambda d: values((3, 4, 50), f32, d), -1, [49, 1, 2], torch.int32)
    yield _select("middle-dim-seed-shape", lambda d: values((20, 409, 3), f32, d), 1, [408, 0, 100, 3])
    yield _select("transposed-input", lambda d: values((9, 6), f32, d).t(), 0, [5, 0, 2])
    yield _select("sliced-input", lambda d: values((8, 30), f32, d)[::2, 1::3], 1, [0, 9, 4])
    yield _select("permuted-4d", lambda d: values((3, 4, 5, 6), f32, d).permute(3, 1, 0, 2), 2, [2, 0, 1, 1])
    yield _select("channels-last", lambda d: values((2, 5, 3, 4), f32, d).to(memory_format=torch.channels_last), 1,
                  [4, 0])
    # Expanded (stride-0) views of more than 2**31 elements over one row of storage: every index is compared
    # with a size past int32 (narrowed, it declared each index out of range: zeros, or IndexError when checking).
    yield _select("expanded-past-2**31-int32-index", lambda d: values((1,), f32, d).expand(2**31 + 8), 0,
                  [2**31 - 1, 5, 0], torch.int32)
    yield _select("expanded-past-2**31-int64-index", lambda d: values((1,), f32, d).expand(2**31 + 8), 0,
                  [2**31 + 7, 2**31, 3])
    yield _select("expanded-rows-past-2**31-elements", lambda d: values((1, 8), f32, d).expand(2**28 + 1, 8), 0,
                  [2**28, 0, 7], torch.int32)
    yield _select("zero-dim-index", lambda d: values((4, 6), f32, d), 1, 3)
    yield _select("zero-dim-input", lambda d: values((), f32, d), 0, [0])
    yield _select("empty-index", lambda d: values((4, 6), f32, d), 1, [])
    yield _select("empty-input", lambda d: values((0, 6), f32, d), 1, [1, 2])
    yield _select("error-out-of-range", lambda d: values((2, 3), f32, d), 1, [0, 3], raises=RuntimeError,
                  match="out of", tags=(DEVICE_ASSERT,))
    # torch's CPU kernel: IndexError everywhere except dim 1 of a tensor of rank 2 or more (its dim-1 path).
    yield _select("error-out-of-range-dim0", lambda d: values((4, 3), f32, d), 0, [1, 4], raises=IndexError,
                  match="index out of range in self", tags=(DEVICE_ASSERT,))
    yield _select("error-out-of-range-1d", lambda d: values((5,), f32, d), 0, [-6], raises=IndexError,
                  match="index out of range in self", tags=(DEVICE_ASSERT,))
    yield _select("error-out-of-range-last-of-3d", lambda d: values((2, 3, 4), f32, d), 2, [4], raises=IndexError,
                  match="index out of range in self", tags=(DEVICE_ASSERT,))
    yield _select("error-out-of-range-dim1-of-3d", lambda d: values((2, 3, 4), f32, d), 1, [3],
                  raises=RuntimeError, match="INDICES element is out of DATA bounds", tags=(DEVICE_ASSERT,))
    yield _select("error-empty-axis", lambda d: values((5, 0), f32, d), 1, [0], raises=RuntimeError,
                  match="axis dim should be positive", tags=(DEVICE_ASSERT,))
    # CPU: IndexError "... a vector"; CUDA: RuntimeError "... an empty tensor or a vector".
    yield _select("error-index-2d", lambda d: values((2, 3), f32, d), 1, [[0, 1]], raises=(IndexError, RuntimeError),
                  match="Index is supposed to be")
    yield _select("error-float-index", lambda d: values((2, 3), f32, d), 1, [0.0], index_dtype=torch.float32,
                  raises=RuntimeError, match="index_select")


CASES = {"index_select": list(_cases())}
