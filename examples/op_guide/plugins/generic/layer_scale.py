"""The generic kernel of ``flaggems::layer_scale(x, gamma)``: one program scales a block of rows."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flaggems import Decline
from flaggems.toolkit import FastLauncher, cdiv, next_pow2

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ROWS = 4


@triton.jit
def _layer_scale_kernel(x, gamma, out, rows, H, gamma_stride, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    col = tl.arange(0, BLOCK_H)[None, :]
    mask = (row < rows) & (col < H)
    scale = tl.load(gamma + col * gamma_stride, mask=col < H).to(tl.float32)
    value = tl.load(x + row * H + col, mask=mask).to(tl.float32)
    tl.store(out + row * H + col, (value * scale).to(out.dtype.element_ty), mask=mask)


_LAUNCHERS: dict[int, FastLauncher] = {}


def layer_scale(x: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """``x * gamma`` for a contiguous ``x`` and a vector ``gamma`` (any stride) of its dtype; others decline."""
    if x.dtype not in DTYPES or gamma.dtype != x.dtype:
        raise Decline(f"dtypes {x.dtype} and {gamma.dtype} (one of fp32/fp16/bf16 served)")
    if x.dim() == 0 or gamma.shape != x.shape[-1:] or gamma.device != x.device:
        raise Decline("gamma not a vector of the hidden size on the input's device (the reference broadcasts)")
    if not x.is_contiguous():
        raise Decline("a non-contiguous input (the reference keeps its layout)")
    out = torch.empty_like(x)
    H = x.shape[-1]
    if out.numel() == 0:
        return out
    block = next_pow2(H)
    launcher = _LAUNCHERS.get(block)
    if launcher is None:
        launcher = _LAUNCHERS[block] = FastLauncher(_layer_scale_kernel, {"ROWS": ROWS, "BLOCK_H": block})
    rows = x.numel() // H
    launcher((cdiv(rows, ROWS),), x, gamma, out, rows, H, gamma.stride(0))
    return out
