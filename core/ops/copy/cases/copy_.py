"""Contract cases of ``aten::copy_`` (args: destination, source)."""

from __future__ import annotations

import itertools

import torch

from flaggems.testing import Case
from flaggems.testing._inputs import ALL_COPY_DTYPES, nonneg_values, short_name, values
from flaggems.testing._layouts import poison

CAST_PAIRS = [(torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.bfloat16, torch.float32),
              (torch.float16, torch.float64), (torch.float64, torch.float32), (torch.int64, torch.float32),
              (torch.float32, torch.int32), (torch.int32, torch.int8), (torch.uint8, torch.float16),
              (torch.bool, torch.float32), (torch.float32, torch.bool), (torch.int64, torch.bool),
              (torch.bool, torch.int64), (torch.float32, torch.uint8), (torch.bfloat16, torch.int64),
              (torch.int16, torch.float64), (torch.float64, torch.bfloat16)]


def _blank(*size, device, dtype=None) -> torch.Tensor:
    """A destination filled with the poison value: ``torch.empty``'s leftover memory made the layouts the
    randomized kit drew for it depend on the allocator (whether an int8 one held -128, say)."""
    shape = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
    dtype = dtype or torch.get_default_dtype()
    return torch.full(shape, poison(dtype), dtype=dtype, device=device)


def _copy(name, dst_fn, src_fn, **kw):
    return Case(name, lambda dev: ((dst_fn(dev), src_fn(dev)), {}), **kw)


def _same_dtype_cases():
    for dtype in ALL_COPY_DTYPES:
        yield _copy(f"contiguous-{short_name(dtype)}", lambda d, t=dtype: _blank(37, 5, device=d, dtype=t),
                    lambda d, t=dtype: values((37, 5), t, d))


def _cast_cases():
    for src_t, dst_t in CAST_PAIRS:
        make = nonneg_values if dst_t == torch.uint8 else values
        yield _copy(f"cast-{short_name(src_t)}-to-{short_name(dst_t)}",
                    lambda d, t=dst_t: _blank(3, 77, device=d, dtype=t),
                    lambda d, t=src_t, m=make: m((3, 77), t, d))


def _layout_cases():
    f32 = torch.float32
    yield _copy("expand-row-to-matrix", lambda d: _blank(4, 128, device=d),
                lambda d: values((128,), f32, d).expand(4, 128))
    yield _copy("expand-f32-to-bf16-seed001", lambda d: _blank(4, 128, device=d, dtype=torch.bfloat16),
                lambda d: values((128,), f32, d).expand(4, 128))
    yield _copy("broadcast-without-expand", lambda d: _blank(3, 4, 6, device=d),
                lambda d: values((4, 1), f32, d))
    yield _copy("zero-dim-source", lambda d: _blank(2, 3, device=d), lambda d: values((), f32, d))
    yield _copy("zero-dim-both", lambda d: _blank((), device=d), lambda d: values((), f32, d))
    yield _copy("transposed-source", lambda d: _blank(13, 7, device=d), lambda d: values((7, 13), f32, d).t())
    yield _copy("transposed-destination", lambda d: _blank(13, 7, device=d).t(),
                lambda d: values((7, 13), f32, d))
    yield _copy("slice-with-step", lambda d: _blank(5, 4, device=d),
                lambda d: values((10, 12), f32, d)[::2, ::3])
    yield _copy("noncontiguous-destination", lambda d: _blank(6, 20, device=d)[:, ::2],
                lambda d: values((6, 10), torch.float16, d))
    yield _copy("permute-rank4-f16", lambda d: _blank(5, 3, 4, 6, device=d, dtype=torch.float16),
                lambda d: values((3, 4, 5, 6), torch.float16, d).permute(2, 0, 1, 3))
    yield _copy("channels-last-both",
                lambda d: _blank(2, 5, 3, 7, device=d).to(memory_format=torch.channels_last),
                lambda d: values((2, 5, 3, 7), f32, d).to(memory_format=torch.channels_last))
    yield _copy("channels-last-to-contiguous", lambda d: _blank(2, 5, 3, 7, device=d),
                lambda d: values((2, 5, 3, 7), f32, d).to(memory_format=torch.channels_last))
    yield _copy("non-power-of-two-2d", lambda d: _blank(127, 33, device=d).t(),
                lambda d: values((33, 127), f32, d))
    for rank in (1, 2, 3, 5, 6, 8):
        shape = tuple(2 + (i % 3) for i in range(rank))
        perm = tuple(reversed(range(rank)))
        yield _copy(f"rank{rank}-permuted", lambda d, s=shape: _blank(s, device=d),
                    lambda d, s=shape, p=perm: values(tuple(s[i] for i in p), f32, d).permute(*p))
    yield _copy("empty", lambda d: _blank(0, 3, device=d), lambda d: values((3,), f32, d))
    yield _self_copy()


def _self_copy():
    def make(dev):
        x = values((4, 5), torch.float32, dev)
        return (x, x), {}
    return Case("self-copy", make)


def _error_cases():
    yield _copy("error-expanded-destination", lambda d: _blank(3, device=d).expand(4, 3),
                lambda d: values((4, 3), torch.float32, d), raises=RuntimeError,
                match="more than one element of the written-to tensor")
    yield _copy("error-shape-mismatch", lambda d: _blank(3, 4, device=d),
                lambda d: values((5,), torch.float32, d), raises=RuntimeError, match="must match the size")
    yield _copy("error-source-rank-too-high", lambda d: _blank(3, 4, device=d),
                lambda d: values((2, 3, 4), torch.float32, d), raises=RuntimeError,
                match="doesn't match the broadcast shape")

    def partial(dev):
        base = values((10,), torch.float32, dev)
        return (base[1:], base[:-1]), {}
    yield Case("error-partial-overlap", partial, raises=RuntimeError, match="refer to a single memory location")


CASES = {"copy_": list(itertools.chain(_same_dtype_cases(), _cast_cases(), _layout_cases(), _error_cases()))}
