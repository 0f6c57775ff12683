"""``flaggems::rotary_embedding``: ``q`` and ``k`` rotated in one launch, forward and backward.

The semantics (checks, output layouts, autograd) are :mod:`flaggems.fronts.rotary`'s;
this module is the kernel: :func:`prepare` (a launch described from metadata)
and :func:`launch`.

One kernel, ``_rotary_kernel``, serves both directions: its programs cover the
rows (every index but the head dimension ``D``) of the first side (``q``) on
grid row 0 and those of the second (``k``) on grid row 1, ``BLOCK_R`` rows a
program. A row reads its
``D`` elements as two halves of ``D / 2`` (rotate-half: the first and the
second half, each a contiguous load; ``interleaved``: the even and the odd
elements, the whole row loaded and split in registers, so both vectorise),
the matching halves of ``cos`` and ``sin``, and writes

* forward: ``a * cos_a - b * sin_a`` and ``b * cos_b + a * sin_b`` (``x * cos + rotate(x) * sin``);
* inverse (the backward): ``a * cos_a + b * sin_b`` and ``b * cos_b - a * sin_a``
  (``dy * cos + rotate^T(dy * sin)``, ``rotate^T = -rotate``),

in fp32, rounded once to the output dtype. Each operand is addressed through
its own strides: its row dimensions are collapsed jointly with those of the
output and of ``cos``/``sin`` (:func:`~flaggems.toolkit.collapse_dims`, ordered
by the input's strides), at most three row dimensions remain for rank-4
inputs. A transposed ``q`` (``[B, H, S, D]`` over ``[B, S, H*D]``) becomes rows
``(B*S, H)``: a program's rows are neighbouring heads of one token, which read
the same ``cos``/``sin`` row (stride 0). Bytes moved per call: every element
of ``q`` and ``k`` read and written once (4 bytes an element in bf16), and
each ``cos``/``sin`` row a program needs (from cache after the first heads
of a token): ``2 * (|q| + |k|) + |cos| + |sin|`` element reads and writes at
least, against ~14 kernels each reading and writing whole tensors unfused.
The backward moves the same bytes (``dq``, ``dk`` in one launch).

The row strides are runtime arguments (64-bit, never specialised: one
compiled kernel per head dimension, dtype and flags); ``ALIGNED`` tells the
compiler they are multiples of 16 elements (checked on the host) so loads
vectorise; ``UNIT`` (every operand's last stride is 1) drops the column
multiply. 64-bit offsets where an operand's reach passes 2**31.
"""

# ruff: noqa: N803, N806 - constexpr parameters and the head dimension are UPPER_CASE, as in every Triton kernel
from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from flaggems import Decline
from flaggems.fronts import rotary as front
from flaggems.ops.rotary.policy import RotaryPolicy
from flaggems.toolkit import FastLauncher, cdiv, collapse_dims, next_pow2, tuning
from flaggems.toolkit.jit_helpers import hint16 as _hint16
from flaggems.toolkit.jit_helpers import index_type as _index

#: Elements of the input a program rotates (``BLOCK_R`` rows of ``D``, the head dimension padded to a
#: power of two); tuning key "rotary_embedding" (``tile``, ``num_warps``:
#: :class:`flaggems.ops.rotary.policy.RotaryPolicy`) overrides.
TILE = RotaryPolicy.tile
NUM_WARPS = RotaryPolicy.num_warps
INT32_LIMIT = 2**31
#: Row dimensions the kernel unravels (rank-4 ``q`` and ``k`` collapse to at most three).
ROW_DIMS = 3

_SIDE_ARGS = ("rows", "n1", "n2", "xs0", "xs1", "xs2", "xsd", "as0", "as1", "as2", "asd", "os0", "os1", "os2", "osd")
_NO_SPECIALIZE = tuple(f"{a}_{s}" for s in (0, 1) for a in _SIDE_ARGS)


@triton.jit
def _row_offsets(i0, i1, i2, s0, s1, s2, ALIGNED: tl.constexpr, INT64: tl.constexpr):
    """Offsets of the rows ``(i0, i1, i2)`` in an operand of row strides ``s0, s1, s2``."""
    s0 = _hint16(_index(s0, INT64), ALIGNED)
    s1 = _hint16(_index(s1, INT64), ALIGNED)
    s2 = _hint16(_index(s2, INT64), ALIGNED)
    return i0 * s0 + i1 * s1 + i2 * s2


@triton.jit
def _tile(row, col, sd, UNIT: tl.constexpr, INT64: tl.constexpr):
    """``[BLOCK_R, HALF_P2]`` offsets of columns ``col`` in rows at ``row`` (column stride ``sd``)."""
    if UNIT:
        off = row[:, None] + col[None, :]
    else:
        off = row[:, None] + col[None, :] * _index(sd, INT64)
    return off


@triton.jit
def _block_rows(block, rows, n1, n2, BLOCK_R: tl.constexpr, INT64: tl.constexpr):
    """Indices ``(i0, i1, i2)`` of rows ``[block * BLOCK_R, +BLOCK_R)`` of ``rows`` rows shaped ``(., n1, n2)``,
    and the mask of those that exist (the others address row 0: no offset overflows)."""
    r = _index(block, INT64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < _index(rows, INT64)  # also every row of a block past this side's rows (the grid covers the longer)
    r = tl.where(rmask, r, 0)
    n1 = _index(n1, INT64)
    n2 = _index(n2, INT64)
    t = r // n2
    return t // n1, t % n1, r % n2, rmask


@triton.jit
def _rotate_rows(x, o, cos, sin, block, rows, n1, n2, xs0, xs1, xs2, xsd, as0, as1, as2, asd, os0, os1, os2, osd,
                 BLOCK_R: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr, INTERLEAVED: tl.constexpr,
                 INVERSE: tl.constexpr, UNIT: tl.constexpr, ALIGNED: tl.constexpr, INT64: tl.constexpr):
    """Rotate rows ``[block * BLOCK_R, +BLOCK_R)`` of one side (see the module docstring)."""
    i0, i1, i2, rmask = _block_rows(block, rows, n1, n2, BLOCK_R, INT64)
    xrow = _row_offsets(i0, i1, i2, xs0, xs1, xs2, ALIGNED, INT64)
    arow = _row_offsets(i0, i1, i2, as0, as1, as2, ALIGNED, INT64)
    orow = _row_offsets(i0, i1, i2, os0, os1, os2, ALIGNED, INT64)
    if INTERLEAVED:
        _rotate_pairs(x, o, cos, sin, xrow, arow, orow, rmask, xsd, asd, osd, BLOCK_R, HALF, HALF_P2, INVERSE, UNIT,
                      INT64)
    else:
        _rotate_halves(x, o, cos, sin, xrow, arow, orow, rmask, xsd, asd, osd, BLOCK_R, HALF, HALF_P2, INVERSE,
                       UNIT, INT64)


@triton.jit
def _turn(xa, xb, cos_a, cos_b, sin_a, sin_b, INVERSE: tl.constexpr):
    """The rotation of the pairs ``(xa, xb)`` (fp32), or with ``INVERSE`` its transpose."""
    if INVERSE:
        ya = xa * cos_a + xb * sin_b
        yb = xb * cos_b - xa * sin_a
    else:
        ya = xa * cos_a - xb * sin_a
        yb = xb * cos_b + xa * sin_b
    return ya, yb


@triton.jit
def _rotate_halves(x, o, cos, sin, xrow, arow, orow, rmask, xsd, asd, osd, BLOCK_R: tl.constexpr,
                   HALF: tl.constexpr, HALF_P2: tl.constexpr, INVERSE: tl.constexpr, UNIT: tl.constexpr,
                   INT64: tl.constexpr):
    """Rotate-half: columns ``j`` and ``j + HALF`` pair up; each half is a contiguous (vectorised) load."""
    ca = tl.arange(0, HALF_P2)
    cb = ca + HALF
    if HALF == HALF_P2:
        mask = tl.broadcast_to(rmask[:, None], (BLOCK_R, HALF_P2))  # constant along a row: loads vectorise
    else:
        mask = rmask[:, None] & (ca < HALF)[None, :]
    xa = tl.load(x + _tile(xrow, ca, xsd, UNIT, INT64), mask=mask, other=0.0).to(tl.float32)
    xb = tl.load(x + _tile(xrow, cb, xsd, UNIT, INT64), mask=mask, other=0.0).to(tl.float32)
    cos_a = tl.load(cos + _tile(arow, ca, asd, UNIT, INT64), mask=mask, other=0.0).to(tl.float32)
    cos_b = tl.load(cos + _tile(arow, cb, asd, UNIT, INT64), mask=mask, other=0.0).to(tl.float32)
    sin_a = tl.load(sin + _tile(arow, ca, asd, UNIT, INT64), mask=mask, other=0.0).to(tl.float32)
    sin_b = tl.load(sin + _tile(arow, cb, asd, UNIT, INT64), mask=mask, other=0.0).to(tl.float32)
    ya, yb = _turn(xa, xb, cos_a, cos_b, sin_a, sin_b, INVERSE)
    tl.store(o + _tile(orow, ca, osd, UNIT, INT64), ya.to(o.dtype.element_ty), mask=mask)
    tl.store(o + _tile(orow, cb, osd, UNIT, INT64), yb.to(o.dtype.element_ty), mask=mask)


@triton.jit
def _pairs(ptr, row, col, sd, mask, BLOCK_R: tl.constexpr, HALF_P2: tl.constexpr, UNIT: tl.constexpr,
           INT64: tl.constexpr):
    """Whole rows loaded (contiguous: vectorised), split into even and odd columns (fp32)."""
    v = tl.load(ptr + _tile(row, col, sd, UNIT, INT64), mask=mask, other=0.0).to(tl.float32)
    return tl.split(tl.reshape(v, (BLOCK_R, HALF_P2, 2)))


@triton.jit
def _rotate_pairs(x, o, cos, sin, xrow, arow, orow, rmask, xsd, asd, osd, BLOCK_R: tl.constexpr,
                  HALF: tl.constexpr, HALF_P2: tl.constexpr, INVERSE: tl.constexpr, UNIT: tl.constexpr,
                  INT64: tl.constexpr):
    """Interleaved (GPT-J): columns ``2j`` and ``2j + 1`` pair up; whole rows load, then split in registers."""
    col = tl.arange(0, 2 * HALF_P2)
    if HALF == HALF_P2:
        mask = tl.broadcast_to(rmask[:, None], (BLOCK_R, 2 * HALF_P2))
    else:
        mask = rmask[:, None] & (col < 2 * HALF)[None, :]
    xa, xb = _pairs(x, xrow, col, xsd, mask, BLOCK_R, HALF_P2, UNIT, INT64)
    cos_a, cos_b = _pairs(cos, arow, col, asd, mask, BLOCK_R, HALF_P2, UNIT, INT64)
    sin_a, sin_b = _pairs(sin, arow, col, asd, mask, BLOCK_R, HALF_P2, UNIT, INT64)
    ya, yb = _turn(xa, xb, cos_a, cos_b, sin_a, sin_b, INVERSE)
    y = tl.reshape(tl.join(ya, yb), (BLOCK_R, 2 * HALF_P2))
    tl.store(o + _tile(orow, col, osd, UNIT, INT64), y.to(o.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _rotary_kernel(x0, o0, x1, o1, cos, sin,
                   rows_0: tl.int64, n1_0: tl.int64, n2_0: tl.int64, xs0_0: tl.int64, xs1_0: tl.int64,
                   xs2_0: tl.int64, xsd_0: tl.int64, as0_0: tl.int64, as1_0: tl.int64, as2_0: tl.int64,
                   asd_0: tl.int64, os0_0: tl.int64, os1_0: tl.int64, os2_0: tl.int64, osd_0: tl.int64,
                   rows_1: tl.int64, n1_1: tl.int64, n2_1: tl.int64, xs0_1: tl.int64, xs1_1: tl.int64,
                   xs2_1: tl.int64, xsd_1: tl.int64, as0_1: tl.int64, as1_1: tl.int64, as2_1: tl.int64,
                   asd_1: tl.int64, os0_1: tl.int64, os1_1: tl.int64, os2_1: tl.int64, osd_1: tl.int64,
                   BLOCK_R: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr, INTERLEAVED: tl.constexpr,
                   INVERSE: tl.constexpr, UNIT: tl.constexpr, ALIGNED: tl.constexpr, INT64: tl.constexpr):
    """Program ``(b, 0)`` rotates block ``b`` of side 0 (``x0`` into ``o0``), ``(b, 1)`` block ``b`` of side 1
    (``x1`` into ``o1``)."""
    pid = tl.program_id(0)
    if tl.program_id(1) == 0:
        _rotate_rows(x0, o0, cos, sin, pid, rows_0, n1_0, n2_0, xs0_0, xs1_0, xs2_0, xsd_0, as0_0, as1_0, as2_0,
                     asd_0, os0_0, os1_0, os2_0, osd_0, BLOCK_R, HALF, HALF_P2, INTERLEAVED, INVERSE, UNIT, ALIGNED,
                     INT64)
    else:
        _rotate_rows(x1, o1, cos, sin, pid, rows_1, n1_1, n2_1, xs0_1, xs1_1, xs2_1, xsd_1, as0_1, as1_1,
                     as2_1, asd_1, os0_1, os1_1, os2_1, osd_1, BLOCK_R, HALF, HALF_P2, INTERLEAVED, INVERSE, UNIT,
                     ALIGNED, INT64)


@functools.cache
def _launcher(num_warps: int, **constexprs: Any) -> FastLauncher:
    return FastLauncher(_rotary_kernel, constexprs, num_warps=num_warps)


def _rows(side: front.Side) -> tuple[int, tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """``(rows, (n1, n2), ((x strides), (angle strides), (out strides)))`` of one side, each stride triple
    followed by that operand's column stride."""
    shape = side.shape
    sizes, strides = collapse_dims(shape[:-1], side.strides[:-1], side.angles[:-1], side.out_strides[:-1])
    if len(sizes) > ROW_DIMS:
        raise Decline(f"row dimensions of {shape} do not collapse to {ROW_DIMS}")
    pad = ROW_DIMS - len(sizes)
    sizes = (1,) * pad + sizes
    columns = (side.strides[-1], side.angles[-1], side.out_strides[-1])
    triples = tuple((0,) * pad + s + (c,) for s, c in zip(strides, columns, strict=True))
    rows = 1
    for n in sizes:
        rows *= n
    return rows, sizes[1:], triples


def _reach(sizes: tuple[int, ...], strides: tuple[int, ...], D: int) -> int:
    """Largest offset an operand's rows and columns address, plus one."""
    return sum((n - 1) * abs(s) for n, s in zip(sizes, strides[:ROW_DIMS], strict=True)) + D * abs(strides[-1]) + 1


def prepare(sides: tuple[front.Side, ...], dtype: torch.dtype, interleaved: bool, inverse: bool) -> tuple:
    """``(launcher, grid, scalars)`` rotating one or two sides in one launch (from metadata only).

    ``dtype`` is the front's argument for kernels that need it; Triton specialises this one on its pointers.
    """
    D = sides[0].shape[-1]
    half = D // 2
    half_p2 = next_pow2(half)
    policy = tuning.policy("rotary_embedding")  # typed, checked at enable(), cached until the context resets
    tile, num_warps = policy.tile, policy.num_warps
    described = [_rows(side) for side in sides]
    most_rows = max(rows for rows, _, _ in described)
    block_r = max(1, min(tile // (2 * half_p2), next_pow2(most_rows)))
    strides = [s for _, _, triples in described for s in triples]
    unit = all(s[-1] == 1 for s in strides)
    aligned = all(x % 16 == 0 for s in strides for x in s[:ROW_DIMS])
    int64 = any(rows + block_r >= INT32_LIMIT for rows, _, _ in described) or any(
        _reach((rows // (n1 * n2), n1, n2), s, D) >= INT32_LIMIT
        for rows, (n1, n2), triples in described for s in triples)
    launcher = _launcher(num_warps, BLOCK_R=block_r, HALF=half, HALF_P2=half_p2, INTERLEAVED=bool(interleaved),
                         INVERSE=bool(inverse), UNIT=unit, ALIGNED=aligned, INT64=int64)
    scalars = []
    blocks = []
    for rows, (n1, n2), triples in described if len(described) == 2 else described * 2:  # side 1 unused
        scalars += [rows, n1, n2, *triples[0], *triples[1], *triples[2]]
        blocks.append(cdiv(rows, block_r))
    # one axis of blocks, one of sides: the blocks of the side with more rows, an expression of one size (a
    # sum of both sides' blocks is not one, so a plan generic over sizes could not compute it: a prompt of
    # a new length missed for every rotary call); the other side's extra blocks are masked off whole
    grid = (max(blocks), len(sides))
    return launcher, grid, tuple(scalars)


def launch(prepared: tuple, xs: tuple[torch.Tensor, ...], cos: torch.Tensor, sin: torch.Tensor,
           outs: tuple[torch.Tensor, ...]) -> None:
    """Rotate ``xs[i]`` into ``outs[i]`` (one or two sides) as :func:`prepare` described."""
    launcher, grid, scalars = prepared
    if len(xs) == 2:
        launcher(grid, xs[0], outs[0], xs[1], outs[1], cos, sin, *scalars)
    else:
        launcher(grid, xs[0], outs[0], xs[0], outs[0], cos, sin, *scalars)


#: The implementation of the ``OpImpl`` line (its checks, layouts and autograd are the front's).
rotary_embedding = front.entry(prepare, launch, front.DTYPES)
