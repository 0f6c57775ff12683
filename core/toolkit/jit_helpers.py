"""Small ``@triton.jit`` helpers shared by the kernels of every plugin."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def index_type(x, INT64: tl.constexpr):
    """``x`` in the kernel's index type: 32-bit unless the host asked for 64-bit offsets."""
    if INT64:
        y = x.to(tl.int64)
    else:
        y = x.to(tl.int32)
    return y


@triton.jit
def hint16(x, ALIGNED: tl.constexpr):
    """Tell the compiler ``x % 16 == 0`` (the host checked it), enabling vector access."""
    if ALIGNED:
        x = (x // 16) * 16
    return x
