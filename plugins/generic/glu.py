"""``flaggems::silu_mul``, ``gelu_tanh_mul`` and ``gelu_mul``: ``act(gate) * up`` in one launch, and its backward.

The semantics (checks, the output's layout, autograd) are :mod:`flaggems.fronts.glu`'s;
this module is the kernels: :func:`prepare` (a launch described from metadata)
and :func:`launch`.

Every operand is addressed through its own strides over one shape. The
dimensions are collapsed jointly for all operands, ordered by the output's
strides (:func:`~flaggems.toolkit.collapse_dims`): contiguous tensors become
one flat dimension, cut back into rows of their innermost dimension where
that takes a maskless column tile (so the launch does not depend on how many
rows there are), the two halves of a merged ``[T, 2 * I]`` projection
become ``T`` rows of ``I`` columns with row stride ``2 * I``. The innermost
collapsed dimension is the columns; at most two outer dimensions, the rows,
remain (more decline, forward only). A program covers a ``[BLOCK_R, BLOCK_C]``
tile: a program's row offsets are computed once per row, so the column loads
are plain vector loads (``UNIT``: every column stride is 1; ``ALIGNED``: row
strides and the column count are multiples of 16, which the host checked).

* ``_glu_kernel`` (forward): reads ``gate`` and ``up``, writes ``act(gate) *
  up`` in fp32, rounded once: 3 elements moved per output element (bf16:
  6 bytes), where the reference's two kernels (``act``, then ``*``) move 5.
* ``_glu_backward_kernel``: reads ``dy``, ``gate`` and ``up`` (``up`` only
  when ``dgate`` is wanted), writes ``dgate = dy * up * act'(gate)`` and
  ``dup = dy * act(gate)``, each only when wanted: 5 per element for both
  (bf16: 10 bytes), where the reference's autograd moves 9 in three kernels
  (``mul``'s backward: two products, 3 each; ``silu_backward``: 3 more).

Activations in fp32, through ``exp`` only (Triton has no portable ``tanh``):
``silu(x) = x / (1 + exp(-x))`` and, since ``1 + tanh(z) = 2 * sigmoid(2z)``,
``gelu_tanh(x) = x / (1 + exp(-2z))`` with ``z = sqrt(2/pi) * (x + 0.044715 x^3)``:
no cancellation where ``tanh(z)`` is near ``-1`` (the reference's fp32
``0.5 * x * (1 + tanh(z))`` loses digits there). The derivatives use
``s * (1 - s) = e * s * s`` (``e = exp(-u)``, ``s = 1 / (1 + e)``) where
``e`` cannot overflow, ``s * (1 - s)`` elsewhere. The exact GELU is torch's
formula, ``0.5 * x * (1 + erf(x / sqrt(2)))``, its derivative ``Phi(x) + x *
phi(x)`` (the normal distribution's CDF and density).

The sizes and strides are runtime arguments (64-bit, never specialised: one
compiled kernel per dtype, activation, tile and flags); 64-bit offsets only
where an operand's reach or an index passes 2**31.
"""

# ruff: noqa: N803 - constexpr parameters are UPPER_CASE, as in every Triton kernel
from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from flaggems import Decline
from flaggems.fronts import glu as front
from flaggems.ops.glu.policy import GluPolicy
from flaggems.toolkit import FastLauncher, cdiv, collapse_dims, context, next_pow2, tuning
from flaggems.toolkit.jit_helpers import hint16 as _hint16
from flaggems.toolkit.jit_helpers import index_type as _index
from flaggems.toolkit.layout import span

#: Elements a program covers (``BLOCK_R x BLOCK_C``) on large inputs; halved down to :data:`MIN_TILE` while
#: the grid would not give every multiprocessor a program. Tuning key "glu" (``tile``, ``num_warps``:
#: :class:`flaggems.ops.glu.policy.GluPolicy`) overrides.
TILE = GluPolicy.tile
MIN_TILE = 512
#: A column tile that divides the columns needs no column mask; the smallest accepted before masking instead.
MIN_EVEN_BLOCK = 256
#: Elements per thread the warp count aims at (16 bf16 elements: two 16-byte vectors per operand).
PER_THREAD = 16
MAX_WARPS = 8
INT32_LIMIT = 2**31
#: The most programs a launch grid's second axis takes (CUDA's limit).
MAX_GRID_Y = 65535
#: Dimensions the kernels address: two row dimensions and the columns.
MAX_DIMS = 3
ACTIVATIONS = {front.SILU: 0, front.GELU_TANH: 1, front.GELU: 2}

_SIZE_ARGS = ("rows", "n1", "cols", "cblocks")
_FORWARD_ARGS = _SIZE_ARGS + tuple(f"{t}{s}" for t in ("g", "u", "o") for s in ("0", "1", "c"))
_BACKWARD_ARGS = _SIZE_ARGS + tuple(f"{t}{s}" for t in ("d", "g", "u", "o") for s in ("0", "1", "c"))

# -2 * sqrt(2 / pi) and its product with 0.044715: gelu_tanh(x) = x / (1 + exp(x * (C1 + C3 * x * x))).
_GELU_C1 = tl.constexpr(-1.5957691216057308)
_GELU_C3 = tl.constexpr(-0.07135481627159394)
# d(-2z)/dx = C1 + 3 * C3 * x * x
_GELU_D3 = tl.constexpr(-0.21406444881478182)
# 1 / sqrt(2) and 1 / sqrt(2 * pi): the exact GELU's CDF argument and the normal density's factor.
_SQRT_HALF = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


# --------------------------------------------------------------------------- kernels
@triton.jit
def _tile(rows, n1, cols, cblocks, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, TWO_ROWS: tl.constexpr,
          EVEN_C: tl.constexpr, ALIGNED: tl.constexpr, INT64: tl.constexpr, TWO_AXES: tl.constexpr):
    """Rows ``(i0, i1)``, columns ``c`` and the ``[BLOCK_R, BLOCK_C]`` mask of this program: row block
    ``program_id(0)`` and column block ``program_id(1)`` (``TWO_AXES``), else both from ``program_id(0)``.

    Masked rows address row 0, so no offset of theirs overflows.
    """
    if TWO_AXES:
        rb = _index(tl.program_id(0), INT64)
        cb = _index(tl.program_id(1), INT64)
    else:
        pid = _index(tl.program_id(0), INT64)
        per_row = _index(cblocks, INT64)
        rb = pid // per_row
        cb = pid - rb * per_row
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < _index(rows, INT64)
    r = tl.where(rmask, r, 0)
    if TWO_ROWS:
        n1 = _index(n1, INT64)
        i0 = r // n1
        i1 = r - i0 * n1
    else:
        i0 = r * 0
        i1 = r
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    if EVEN_C:
        mask = tl.broadcast_to(rmask[:, None], (BLOCK_R, BLOCK_C))  # constant along a row: loads vectorise
    else:
        mask = rmask[:, None] & (c < _hint16(_index(cols, INT64), ALIGNED))[None, :]
    return i0, i1, c, mask


@triton.jit
def _offsets(i0, i1, c, s0, s1, sc, TWO_ROWS: tl.constexpr, UNIT: tl.constexpr, ALIGNED: tl.constexpr,
             INT64: tl.constexpr):
    """``[BLOCK_R, BLOCK_C]`` offsets of rows ``(i0, i1)`` and columns ``c`` in an operand of strides ``s0, s1, sc``."""
    row = i1 * _hint16(_index(s1, INT64), ALIGNED)
    if TWO_ROWS:
        row += i0 * _hint16(_index(s0, INT64), ALIGNED)
    if UNIT:
        col = c
    else:
        col = c * _index(sc, INT64)
    return row[:, None] + col[None, :]


@triton.jit
def _exponent(x, ACT: tl.constexpr):
    """``u`` with ``act(x) = x / (1 + exp(u))``: ``-x`` for silu (``ACT == 0``), ``-2z`` for gelu_tanh."""
    if ACT == 0:
        u = -x
    else:
        u = x * (_GELU_C1 + _GELU_C3 * x * x)
    return u


@triton.jit
def _normal_cdf(x):
    """``Phi(x) = 0.5 * (1 + erf(x / sqrt(2)))`` in fp32, as torch's exact GELU computes it."""
    return 0.5 * (1.0 + tl.math.erf(x * _SQRT_HALF))


@triton.jit
def _activation(x, ACT: tl.constexpr):
    """``silu(x)`` (``ACT == 0``), ``gelu_tanh(x)`` (1) or the exact ``gelu(x)`` (2) in fp32 (see the module
    docstring)."""
    if ACT == 2:
        y = x * _normal_cdf(x)
    else:
        y = x / (1.0 + tl.exp(_exponent(x, ACT)))
    return y


@triton.jit
def _activation_grad(x, ACT: tl.constexpr):
    """``(act(x), act'(x))`` in fp32."""
    if ACT == 2:
        cdf = _normal_cdf(x)
        return x * cdf, cdf + x * tl.exp(-0.5 * x * x) * _INV_SQRT_2PI
    u = _exponent(x, ACT)
    e = tl.exp(u)
    s = 1.0 / (1.0 + e)
    s_rest = tl.where(u <= 0.0, e * s * s, s * (1.0 - s))  # s * (1 - s), exact where e cannot overflow
    if ACT == 0:
        grad = s + x * s_rest
    else:
        grad = s - x * s_rest * (_GELU_C1 + _GELU_D3 * x * x)
    return x * s, grad


@triton.jit(do_not_specialize=_FORWARD_ARGS)
def _glu_kernel(gate, up, out, rows: tl.int64, n1: tl.int64, cols: tl.int64, cblocks: tl.int64,
                g0: tl.int64, g1: tl.int64, gc: tl.int64, u0: tl.int64, u1: tl.int64, uc: tl.int64,
                o0: tl.int64, o1: tl.int64, oc: tl.int64,
                ACT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, TWO_ROWS: tl.constexpr,
                EVEN_C: tl.constexpr, UNIT: tl.constexpr, ALIGNED: tl.constexpr, INT64: tl.constexpr,
                TWO_AXES: tl.constexpr):
    """``out = act(gate) * up`` over one ``[BLOCK_R, BLOCK_C]`` tile, fp32 math, one rounding."""
    i0, i1, c, mask = _tile(rows, n1, cols, cblocks, BLOCK_R, BLOCK_C, TWO_ROWS, EVEN_C, ALIGNED, INT64, TWO_AXES)
    x = tl.load(gate + _offsets(i0, i1, c, g0, g1, gc, TWO_ROWS, UNIT, ALIGNED, INT64), mask=mask, other=0.0)
    u = tl.load(up + _offsets(i0, i1, c, u0, u1, uc, TWO_ROWS, UNIT, ALIGNED, INT64), mask=mask, other=0.0)
    y = _activation(x.to(tl.float32), ACT) * u.to(tl.float32)
    tl.store(out + _offsets(i0, i1, c, o0, o1, oc, TWO_ROWS, UNIT, ALIGNED, INT64), y.to(out.dtype.element_ty),
             mask=mask)


@triton.jit(do_not_specialize=_BACKWARD_ARGS)
def _glu_backward_kernel(dy, gate, up, dgate, dup, rows: tl.int64, n1: tl.int64, cols: tl.int64, cblocks: tl.int64,
                         d0: tl.int64, d1: tl.int64, dc: tl.int64, g0: tl.int64, g1: tl.int64, gc: tl.int64,
                         u0: tl.int64, u1: tl.int64, uc: tl.int64, o0: tl.int64, o1: tl.int64, oc: tl.int64,
                         ACT: tl.constexpr, NEED_GATE: tl.constexpr, NEED_UP: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_C: tl.constexpr, TWO_ROWS: tl.constexpr, EVEN_C: tl.constexpr, UNIT: tl.constexpr,
                         ALIGNED: tl.constexpr, INT64: tl.constexpr, TWO_AXES: tl.constexpr):
    """``dgate = dy * up * act'(gate)`` and ``dup = dy * act(gate)`` (those wanted) over one tile."""
    i0, i1, c, mask = _tile(rows, n1, cols, cblocks, BLOCK_R, BLOCK_C, TWO_ROWS, EVEN_C, ALIGNED, INT64, TWO_AXES)
    g = tl.load(dy + _offsets(i0, i1, c, d0, d1, dc, TWO_ROWS, UNIT, ALIGNED, INT64), mask=mask, other=0.0)
    x = tl.load(gate + _offsets(i0, i1, c, g0, g1, gc, TWO_ROWS, UNIT, ALIGNED, INT64), mask=mask, other=0.0)
    g = g.to(tl.float32)
    x = x.to(tl.float32)
    out = _offsets(i0, i1, c, o0, o1, oc, TWO_ROWS, UNIT, ALIGNED, INT64)
    if NEED_GATE:
        u = tl.load(up + _offsets(i0, i1, c, u0, u1, uc, TWO_ROWS, UNIT, ALIGNED, INT64), mask=mask, other=0.0)
        act, grad = _activation_grad(x, ACT)
        tl.store(dgate + out, (g * u.to(tl.float32) * grad).to(dgate.dtype.element_ty), mask=mask)
        if NEED_UP:
            tl.store(dup + out, (g * act).to(dup.dtype.element_ty), mask=mask)
    else:
        tl.store(dup + out, (g * _activation(x, ACT)).to(dup.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- host side
@functools.cache
def _launcher(kernel: Any, num_warps: int, **constexprs: Any) -> FastLauncher:
    return FastLauncher(kernel, constexprs, num_warps=num_warps)


@context.cached
def _multiprocessors(device: torch.device) -> int | None:
    """The device's multiprocessor count, or ``None`` where the kernel context knows none (interpreter)."""
    return context.current().facts(device.index if device.index is not None else 0).multiprocessors




def _even_block(cols: int, tile: int) -> int:
    """The largest power of two up to ``tile`` dividing ``cols``; 0 where it is below :data:`MIN_EVEN_BLOCK` (or,
    for fewer columns, below their next power of two): a masked tile then wastes less than more programs cost."""
    block = min(cols & -cols, tile)
    return block if block >= min(MIN_EVEN_BLOCK, next_pow2(cols)) else 0


def plan_tile(rows: int, cols: int, multiprocessors: int | None, tile: int = TILE) -> tuple[int, int]:
    """``(BLOCK_R, BLOCK_C)`` for ``rows x cols``: a column tile dividing the columns where one is large enough,
    then halved (rows first) down to :data:`MIN_TILE` elements while the grid leaves multiprocessors idle."""
    block_c = _even_block(cols, tile) or min(next_pow2(cols), tile)
    block_r = max(1, min(tile // block_c, next_pow2(rows)))
    while multiprocessors and block_r * block_c > MIN_TILE and cdiv(rows, block_r) * cdiv(cols, block_c) < \
            multiprocessors:
        if block_r > 1:
            block_r //= 2
        else:
            block_c //= 2
    return block_r, block_c


def _rows_of_innermost(shape: tuple[int, ...], out_strides: tuple[int, ...], sizes: tuple[int, ...],
                       collapsed: tuple[tuple[int, ...], ...], tile: int) -> tuple[tuple[int, ...], tuple]:
    """Operands collapsed to one dimension, seen as rows of the output's innermost dimension where that dimension
    takes a maskless column tile (:func:`_even_block`: every hidden size of the transformers configs we bench).
    The tile then depends on that size alone, not on the number of rows: flat, a ``[2, n, 4864]`` call took one of
    five tiles as the prompt length ``n`` changed, each a new kernel, so no plan served a length not seen before."""
    dims = [d for d in range(len(shape)) if shape[d] > 1]
    if len(sizes) != 1 or len(dims) < 2:
        return sizes, collapsed
    cols = shape[min(dims, key=lambda d: abs(out_strides[d]))]
    if not _even_block(cols, tile):
        return sizes, collapsed
    return (sizes[0] // cols, cols), tuple((s[0] * cols, s[0]) for s in collapsed)


def _layout(shape: tuple[int, ...], strides: tuple[tuple[int, ...], ...], tile: int,
            ) -> tuple[tuple[int, ...], tuple] | None:
    """``((n0, n1, cols), per-operand (s0, s1, sc))`` of the operands collapsed jointly, the last one (the output
    or the gradients) deciding the order; ``None`` where more than :data:`MAX_DIMS` dimensions remain."""
    sizes, collapsed = collapse_dims(shape, strides[-1], *strides[:-1])
    if len(sizes) > MAX_DIMS:
        return None
    sizes, collapsed = _rows_of_innermost(shape, strides[-1], sizes, collapsed, tile)
    pad = MAX_DIMS - len(sizes)
    collapsed = collapsed[1:] + collapsed[:1]  # back to the callers' order
    return (1,) * pad + sizes, tuple((0,) * pad + s for s in collapsed)


def prepare(shape: tuple[int, ...], strides: tuple[tuple[int, ...], ...], dtype: torch.dtype, activation: str,
            needs: tuple[bool, bool] | None, device: torch.device) -> tuple:
    """``(launcher, grid, scalars, copy_dy)`` of the forward (``needs is None``: strides of ``gate, up, out``) or the
    backward (strides of ``dy, gate, up, grads``); from metadata only (see :func:`flaggems.fronts.glu.entry`).

    ``copy_dy``: the backward's ``dy`` does not collapse with the other operands; :func:`launch` copies it into
    the gradients' layout first (never for a ``dy`` laid out like the forward's output).
    """
    policy = tuning.policy("glu")  # typed, checked at enable(), cached until the context resets
    tile = policy.tile
    layout = _layout(shape, strides, tile)
    copy_dy = None
    if layout is None:
        if needs is None:
            raise Decline(f"strides {strides} of shape {shape} do not collapse to {MAX_DIMS} dimensions")
        copy_dy = strides[-1]
        layout = _layout(shape, (strides[-1], *strides[1:]), tile)
    sizes, collapsed = layout
    n0, n1, cols = sizes
    rows = n0 * n1
    block_r, block_c = plan_tile(rows, cols, _multiprocessors(device), tile)
    num_warps = policy.num_warps or max(1, min(MAX_WARPS, block_r * block_c // (32 * PER_THREAD)))
    cblocks = cdiv(cols, block_c)
    int64 = rows + block_r >= INT32_LIMIT or cols + block_c >= INT32_LIMIT or any(
        span(sizes, s) + block_c * abs(s[-1]) + 1 >= INT32_LIMIT for s in collapsed)
    flags = {
        "ACT": ACTIVATIONS[activation], "BLOCK_R": block_r, "BLOCK_C": block_c, "TWO_ROWS": n0 > 1,
        "EVEN_C": cols % block_c == 0, "UNIT": all(s[-1] == 1 for s in collapsed),
        "ALIGNED": cols % 16 == 0 and all(x % 16 == 0 for s in collapsed for x in s[:-1]), "INT64": int64,
        "TWO_AXES": 1 < cblocks <= MAX_GRID_Y,
    }
    if needs is None:
        launcher = _launcher(_glu_kernel, num_warps, **flags)
    else:
        launcher = _launcher(_glu_backward_kernel, num_warps, NEED_GATE=needs[0], NEED_UP=needs[1], **flags)
    grid = (cdiv(rows, block_r), cblocks) if flags["TWO_AXES"] else (cdiv(rows, block_r) * cblocks,)
    scalars = (rows, n1, cols, cblocks, *(x for s in collapsed for x in s))
    return launcher, grid, scalars, copy_dy


def launch(prepared: tuple, *tensors: torch.Tensor | None) -> None:
    """Launch what :func:`prepare` described: ``(gate, up, out)`` or ``(dy, gate, up, dgate, dup)``."""
    launcher, grid, scalars, copy_dy = prepared
    if len(tensors) == 3:
        launcher(grid, *tensors, *scalars)
        return
    dy, gate, up, dgate, dup = tensors
    if copy_dy is not None:
        dy = torch.empty_strided(dy.shape, copy_dy, dtype=dy.dtype, device=dy.device).copy_(dy)
    first = dgate if dgate is not None else dup
    launcher(grid, dy, gate, up, first, dup if dup is not None else first, *scalars)


#: The implementations of the ``OpImpl`` lines (their checks, layouts and autograd are the front's).
silu_mul = front.entry(prepare, launch, front.SILU)
gelu_tanh_mul = front.entry(prepare, launch, front.GELU_TANH)
gelu_mul = front.entry(prepare, launch, front.GELU)
