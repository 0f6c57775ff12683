"""Contract cases of ``aten::index_copy_`` and ``aten::index_copy`` (self, dim, index, source)."""

from __future__ import annotations

import torch

from flaggems.testing import DEVICE_ASSERT, Case
from flaggems.testing._inputs import ALL_COPY_DTYPES, short_name, values


def _perm_index(n: int, k: int, dev: torch.device) -> torch.Tensor:
    """``k`` distinct positions in ``[0, n)``: duplicates would make the winner unspecified."""
    return torch.randperm(n, device=dev)[:k]


def _case(name, shape, dim, k, dtype=torch.float32):
    def make(dev):
        src_shape = list(shape)
        src_shape[dim] = k
        self = values(shape, dtype, dev)
        return (self, dim, _perm_index(self.shape[dim], k, dev), values(tuple(src_shape), dtype, dev)), {}
    return Case(name, make)


def _strided(name, make_self, dim, make_source, index):
    return Case(name, lambda dev: ((make_self(dev), dim, torch.tensor(index, device=dev, dtype=torch.int64),
                                    make_source(dev)), {}))


def _cases():
    for dtype in ALL_COPY_DTYPES:
        yield _case(f"dim1-{short_name(dtype)}", (6, 33), 1, 5, dtype)
    yield _case("dim0-1d-seed-shape", (100,), 0, 50)
    yield _case("dim-neg-3d", (4, 6, 5), -1, 3)
    yield _case("dim1-3d-wide-rows", (3, 9, 130), 1, 4)
    yield _case("dim0-rows", (17, 7), 0, 9)
    yield _case("non-power-of-two", (5, 37, 3), 1, 23)
    # Out of place, the generic plugin picks its form by the rows x index entries a search would compare
    # (2**20 at most: one launch, a gather that searches the index) and by size (2**20 elements and a
    # short dim: the inverse form, a gather over the destination; else a copy, then a scatter).
    yield _case("inverse-form-columns", (1024, 1024), 1, 300, torch.float16)  # in place too
    yield _case("inverse-form-dim0", (2048, 512), 0, 600)
    yield _case("search-form-dim0-of-3d", (64, 128, 128), 0, 20)
    yield _case("copy-then-scatter-1d", (65536,), 0, 40, torch.float16)
    f32 = torch.float32
    yield _strided("self-transposed", lambda d: values((9, 6), f32, d).t(), 1, lambda d: values((6, 3), f32, d),
                   [8, 0, 4])
    yield _strided("source-transposed", lambda d: values((6, 9), f32, d), 1,
                   lambda d: values((3, 6), f32, d).t(), [8, 0, 4])
    yield _strided("both-sliced", lambda d: values((6, 20), f32, d)[:, ::2], 1,
                   lambda d: values((12, 3), f32, d)[::2], [1, 9, 5])
    yield _strided("channels-last-self", lambda d: values((2, 5, 3, 4), f32, d).to(memory_format=torch.channels_last),
                   1, lambda d: values((2, 2, 3, 4), f32, d), [4, 1])
    yield _strided("permuted-4d-source", lambda d: values((3, 4, 5, 6), f32, d), 2,
                   lambda d: values((6, 3, 4, 2), f32, d).permute(1, 2, 3, 0), [4, 0])
    yield _strided("duplicate-index-equal-rows", lambda d: values((4, 6), f32, d), 1,
                   lambda d: values((4, 1), f32, d).expand(4, 3).contiguous(), [2, 2, 2])
    yield _strided("zero-dim-index", lambda d: values((4, 6), f32, d), 1, lambda d: values((4, 1), f32, d), 3)
    yield _strided("scalars", lambda d: values((), f32, d), 0, lambda d: values((), f32, d), [0])
    yield _strided("empty-index", lambda d: values((4, 6), f32, d), 1, lambda d: values((4, 0), f32, d), [])
    yield from _errors()


def _errors():
    f32 = torch.float32
    yield Case("error-index-out-of-range",
               lambda d: ((values((2, 3), f32, d), 1, torch.tensor([0, 3], device=d), values((2, 2), f32, d)), {}),
               raises=IndexError, match="index 3 is out of bounds for dimension 1 with size 3", tags=(DEVICE_ASSERT,))
    yield Case("error-negative-index",
               lambda d: ((values((2, 3), f32, d), 1, torch.tensor([-1, 0], device=d), values((2, 2), f32, d)), {}),
               raises=IndexError, match="out of bounds", tags=(DEVICE_ASSERT,))
    yield Case("error-int32-index",
               lambda d: ((values((2, 3), f32, d), 1, torch.tensor([0, 1], device=d, dtype=torch.int32),
                           values((2, 2), f32, d)), {}),
               raises=RuntimeError, match="Expected a long tensor for index")
    yield Case("error-dtype-mismatch",
               lambda d: ((values((2, 3), f32, d), 1, torch.tensor([0, 1], device=d),
                           values((2, 2), torch.float16, d)), {}),
               raises=RuntimeError, match="same dtype")
    yield Case("error-index-count",
               lambda d: ((values((2, 3), f32, d), 1, torch.tensor([0, 1], device=d), values((2, 3), f32, d)), {}),
               raises=IndexError, match="Number of indices")
    yield Case("error-slice-shape",
               lambda d: ((values((2, 3), f32, d), 1, torch.tensor([0, 1], device=d), values((3, 2), f32, d)), {}),
               raises=RuntimeError, match="same slice shapes")


_ALL = list(_cases())
CASES = {"index_copy_": _ALL, "index_copy": _ALL}
