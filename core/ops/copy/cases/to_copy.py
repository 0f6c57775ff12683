"""Contract cases of ``aten::_to_copy`` (args: input; kwargs: dtype, memory_format, ...)."""

from __future__ import annotations

import torch

from flaggems.testing import Case
from flaggems.testing._inputs import short_name, values

CL = torch.channels_last


def _to(name, make_input, raises=None, match=None, **kwargs):
    return Case(name, lambda dev: ((make_input(dev),), dict(kwargs)), raises=raises, match=match)


def _cases():
    f32 = torch.float32
    for src, dst in [(f32, torch.float16), (f32, torch.bfloat16), (torch.bfloat16, f32), (torch.int64, f32),
                     (f32, torch.float64), (torch.float16, torch.int32), (torch.bool, torch.float16)]:
        yield _to(f"{short_name(src)}-to-{short_name(dst)}", lambda d, t=src: values((19, 23), t, d), dtype=dst)
        yield _to(f"{short_name(src)}-to-{short_name(dst)}-transposed",
                  lambda d, t=src: values((23, 19), t, d).t(), dtype=dst)
    yield _to("same-dtype-copy", lambda d: values((6, 7), f32, d))
    yield _to("sliced-input-not-dense", lambda d: values((12, 9), f32, d)[::2, 1:], dtype=torch.float16)
    yield _to("expanded-input", lambda d: values((9,), f32, d).expand(4, 9), dtype=torch.bfloat16)
    yield _to("channels-last-preserved", lambda d: values((2, 6, 5, 3), f32, d).to(memory_format=CL),
              dtype=torch.float16)
    yield _to("channels-last-sliced", lambda d: values((2, 6, 5, 4), f32, d).to(memory_format=CL)[:, :, ::2],
              dtype=torch.float16)
    yield _to("to-contiguous-format", lambda d: values((2, 6, 5, 3), f32, d).to(memory_format=CL),
              memory_format=torch.contiguous_format)
    yield _to("to-channels-last", lambda d: values((2, 6, 5, 3), f32, d), dtype=torch.bfloat16, memory_format=CL)
    yield _to("permuted-rank5", lambda d: values((2, 3, 4, 5, 6), f32, d).permute(4, 2, 0, 3, 1),
              dtype=torch.float16)
    yield _to("zero-dim", lambda d: values((), f32, d), dtype=torch.float64)
    yield _to("empty", lambda d: values((0, 4), f32, d), dtype=torch.float16)
    yield _to("error-channels-last-rank2", lambda d: values((3, 4), f32, d), memory_format=CL,
              raises=RuntimeError, match="channels_last")


CASES = {"_to_copy": list(_cases())}
