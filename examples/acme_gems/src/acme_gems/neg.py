"""``aten::neg`` on Acme devices: the torch semantics here, the kernel below, the launcher from the toolkit."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flaggems import Decline, config
from flaggems.toolkit import FastLauncher, cdiv

DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.int32, torch.int64})


@triton.jit
def _neg_kernel(src, dst, n, BLOCK: tl.constexpr, WIDEN: tl.constexpr):  # noqa: N803 - constexprs are upper case
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    value = tl.load(src + offsets, mask=mask)
    if WIDEN:  # Triton 3.9's interpreter negates bfloat16 wrongly; through float32 it is exact everywhere
        value = value.to(tl.float32)
    tl.store(dst + offsets, (-value).to(dst.dtype.element_ty), mask=mask)


_LAUNCHERS: dict[tuple[int, bool], FastLauncher] = {}


def supports(x: torch.Tensor) -> bool | str:
    """Dense inputs of the dtypes the kernel handles; everything else goes to the next implementation."""
    if x.dtype not in DTYPES:
        return f"dtype {x.dtype}"
    if not x.is_contiguous():
        return "non-contiguous input"
    return True


def neg(x: torch.Tensor) -> torch.Tensor:
    """``-x`` into a fresh tensor of ``x``'s shape and dtype."""
    if supports(x) is not True:
        raise Decline(str(supports(x)))
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        block, widen = config.get("FLAGGEMS_ACME_NEG_BLOCK"), x.dtype in (torch.float16, torch.bfloat16)
        launcher = _LAUNCHERS.get((block, widen))
        if launcher is None:
            launcher = _LAUNCHERS[block, widen] = FastLauncher(_neg_kernel, {"BLOCK": block, "WIDEN": widen})
        launcher((cdiv(n, block),), x, out, n)
    return out
