"""``aten::unfold`` (a view) and ``aten::unfold_backward`` (a deterministic gather).

``unfold`` is the public front's view (:func:`flaggems.fronts.unfold.unfold`):
torch's sizes and strides, ``self.as_strided(...)`` on the input's storage
(same storage offset): no kernel, no copy, 0-dim inputs, ``size == dim size``
and ``step > size`` included, torch's error types and messages.

Routing: the ``OpImpl`` declares ``dispatch_keys=("PrivateUse1",)``, so the
policy offers ``unfold`` only on such backends. Vendor devices there often
lack a native ``unfold`` view, and a view cannot fall back to the CPU
(``Tensor.repeat`` then reads garbage). On CUDA and CPU torch's own kernel is
the same ``as_strided`` arithmetic in C++ and is never overridden.

``unfold_backward`` writes ``grad_input`` (contiguous, ``grad``'s dtype, as
torch) with one gather kernel: each element of ``grad_input`` sums, in window
order, the ``ceil(size / step)`` or fewer windows that contain it. No atomics,
no zero fill, any ``grad`` strides (dimensions before and after ``dim`` are
collapsed jointly; more than one left on either side copies ``grad`` first),
fp32 accumulation for half types (fp64 for fp64), 64-bit offsets when an
offset can reach 2**31. The checks (a ``grad`` whose shape is not the one
``unfold`` gives declines, so torch's own lenient kernel answers; dtype and
layout declines) and the allocation of ``grad_input`` are the front's
(:mod:`flaggems.fronts.unfold`); the kernel and its plan cache are here.
"""

# ruff: noqa: N803 - constexpr parameters are UPPER_CASE, as in every Triton kernel
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from flaggems.fronts import unfold as unfold_front
from flaggems.toolkit import FastLauncher, cdiv, collapse_dims, next_pow2
from flaggems.toolkit.jit_helpers import index_type as _index

FLOAT_DTYPES = unfold_front.BACKWARD_DTYPES
#: Elements of ``grad_input`` per program.
TILE = 2048
NUM_WARPS = 4
INT32_LIMIT = 2**31


#: The view and torch's ``maybe_wrap_dim`` are the front's (names kept for existing importers).
wrap_dim = unfold_front.wrap_dim
unfold = unfold_front.unfold


# --------------------------------------------------------------------------- unfold_backward
@triton.jit(do_not_specialize=("L", "B", "windows", "size", "step", "max_windows", "g_sa", "g_sw", "g_sb", "g_sk",
                               "jblocks", "bblocks"))
def _unfold_backward_kernel(grad, out, L: tl.int64, B: tl.int64, windows: tl.int64, size: tl.int64,
                            step: tl.int64, max_windows: tl.int64, g_sa: tl.int64, g_sw: tl.int64,
                            g_sb: tl.int64, g_sk: tl.int64, jblocks: tl.int64, bblocks: tl.int64,
                            BLOCK_J: tl.constexpr, BLOCK_B: tl.constexpr, INNER_ONE: tl.constexpr,
                            INT64: tl.constexpr, F64: tl.constexpr):
    """``out[a, j, b] = sum over windows w containing j of grad[a, w, b, j - w*step]``.

    ``out`` is contiguous ``[A, L, B]``; ``grad`` is ``[A, windows, B, size]``
    with strides ``g_sa, g_sw, g_sb, g_sk``. ``INNER_ONE``: ``B == 1`` (``dim``
    is the last dimension), the store is then contiguous along ``j``.
    """
    pid = _index(tl.program_id(0), INT64)
    jblocks, bblocks = _index(jblocks, INT64), _index(bblocks, INT64)
    bb = pid % bblocks
    jb = pid // bblocks % jblocks
    a = pid // bblocks // jblocks
    L, B, step, size = _index(L, INT64), _index(B, INT64), _index(step, INT64), _index(size, INT64)
    windows = _index(windows, INT64)
    j = jb * BLOCK_J + tl.arange(0, BLOCK_J)
    b = bb * BLOCK_B + tl.arange(0, BLOCK_B)
    jmask = j < L
    bmask = b < B
    if F64:
        acc = tl.zeros([BLOCK_J, BLOCK_B], tl.float64)
    else:
        acc = tl.zeros([BLOCK_J, BLOCK_B], tl.float32)
    base = grad + a * _index(g_sa, INT64)
    b_off = (b * _index(g_sb, INT64))[None, :]
    last = tl.minimum(j // step, windows - 1)  # the last window that exists and starts at or before j
    for i in range(0, _index(max_windows, INT64)):
        w = last - i
        k = j - w * step
        valid = jmask & (w >= 0) & (w < windows) & (k < size)
        row = w * _index(g_sw, INT64) + k * _index(g_sk, INT64)
        v = tl.load(base + row[:, None] + b_off, mask=valid[:, None] & bmask[None, :], other=0.0)
        acc += v.to(acc.dtype)
    if INNER_ONE:
        out_off = a * L + j[:, None] + b[None, :]
    else:
        out_off = (a * L + j)[:, None] * B + b[None, :]
    tl.store(out + out_off, acc.to(out.dtype.element_ty), mask=jmask[:, None] & bmask[None, :])



@functools.cache
def _launcher(**constexprs: Any) -> FastLauncher:
    return FastLauncher(_unfold_backward_kernel, constexprs, num_warps=NUM_WARPS)


def _collapse_side(sizes: list[int], out_strides: list[int], grad_strides: list[int]) -> tuple[int, int] | None:
    """The dims on one side of ``dim`` as one ``(count, grad stride)``; ``None`` if they do not merge."""
    merged, (_, grad) = collapse_dims(sizes, out_strides, grad_strides)
    if len(merged) > 1:
        return None
    return (merged[0], grad[0]) if merged else (1, 0)


def _plan(grad: torch.Tensor, input_sizes: list[int], dim: int, size: int, step: int) -> tuple | None:
    ndim = len(input_sizes)
    out_strides = [math.prod(input_sizes[d + 1:]) for d in range(ndim)]
    g = grad.stride()
    before = _collapse_side(input_sizes[:dim], out_strides[:dim], list(g[:dim]))
    after = _collapse_side(input_sizes[dim + 1:], out_strides[dim + 1:], list(g[dim + 1:ndim]))
    if before is None or after is None:
        return None
    (A, g_sa), (B, g_sb) = before, after
    L, windows = input_sizes[dim], grad.shape[dim]
    block_b = min(next_pow2(B), 64)
    block_j = max(TILE // block_b, 1) if B > 1 else min(next_pow2(L), TILE)
    jblocks, bblocks = cdiv(L, block_j), cdiv(B, block_b)
    reach = sum((n - 1) * abs(s) for n, s in zip(grad.shape, g)) + TILE * max(abs(s) for s in g)
    int64 = max(A * L * B + TILE, reach) >= INT32_LIMIT
    launcher = _launcher(BLOCK_J=block_j, BLOCK_B=block_b, INNER_ONE=B == 1, INT64=int64,
                         F64=grad.dtype == torch.float64)
    # windows over one element: at most cdiv(size, step), and never more than there are (one window of 14851
    # at step 2 walked 7,426 candidates per element before this bound)
    max_windows = min(cdiv(size, step), windows)
    return launcher, (A * jblocks * bblocks,), (L, B, windows, size, step, max_windows, g_sa, g[dim], g_sb,
                                                g[ndim], jblocks, bblocks)


@dataclass(frozen=True)
class BackwardPlan:
    """One ``unfold_backward`` geometry: the front's validated geometry, the launch, whether ``grad`` is copied."""

    geometry: unfold_front.BackwardGeometry
    launch: tuple | None  # None: an empty output or grad, no kernel
    contiguous_first: bool


_PLANS: dict[tuple, BackwardPlan] = {}
_PLAN_LIMIT = 1024


def _backward_plan(grad: torch.Tensor, input_sizes: list[int], dim: int, size: int, step: int) -> BackwardPlan:
    """Validate one call's geometry (the front declines what torch's kernel must decide) and plan it."""
    geometry = unfold_front.backward_geometry(grad, input_sizes, dim, size, step)
    if geometry.empty:
        return BackwardPlan(geometry, None, False)
    sizes, dim = geometry.sizes, geometry.dim
    launch = _plan(grad, sizes, dim, size, step)
    if launch is not None:
        return BackwardPlan(geometry, launch, False)
    dense = torch.empty(grad.shape, dtype=grad.dtype, device="meta")
    return BackwardPlan(geometry, _plan(dense, sizes, dim, size, step), True)


def unfold_backward(grad_in: torch.Tensor, input_sizes: list[int], dim: int, size: int,
                    step: int) -> torch.Tensor:
    """``aten::unfold_backward``: the gradient of ``unfold(dim, size, step)`` for an input of ``input_sizes``.

    Plans are cached by geometry: a repeated call checks dtype and layout, then launches.
    """
    unfold_front.check_backward(grad_in, step, FLOAT_DTYPES)
    key = (grad_in.shape, grad_in.stride(), grad_in.dtype, tuple(input_sizes), dim, size, step)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _PLAN_LIMIT:
            _PLANS.clear()
        plan = _PLANS[key] = _backward_plan(grad_in, input_sizes, dim, size, step)
    out = unfold_front.allocate_grad_input(grad_in, plan.geometry)
    if plan.launch is None:
        return out
    if plan.contiguous_first:
        grad_in = grad_in.contiguous()
    launcher, grid, scalars = plan.launch
    launcher(grid, grad_in, out, *scalars)
    return out
