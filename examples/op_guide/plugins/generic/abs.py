"""The generic kernel of ``aten::abs``: dense inputs, one block of elements a program."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flaggems import Decline
from flaggems.toolkit import FastLauncher, cdiv

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64)
BLOCK = 1024


@triton.jit
def _abs_kernel(src, dst, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(dst + offsets, tl.abs(tl.load(src + offsets, mask=mask)), mask=mask)


_LAUNCHER = FastLauncher(_abs_kernel, {"BLOCK": BLOCK})


def abs_(x: torch.Tensor) -> torch.Tensor:
    """``torch.abs(x)`` for a dense, non-empty ``x`` of a served dtype; other calls decline (torch's kernel)."""
    if x.dtype not in DTYPES:
        raise Decline(f"dtype {x.dtype}")
    if not x.is_contiguous() or x.numel() == 0:
        raise Decline("an empty or non-contiguous input (torch keeps its layout)")
    out = torch.empty_like(x)
    _LAUNCHER((cdiv(x.numel(), BLOCK),), x, out, x.numel())
    return out
