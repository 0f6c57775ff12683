"""Triton kernels of :mod:`flaggems.toolkit.strided`: copy with a cast on store.

Two kernels, chosen on the host after the dimensions are collapsed:

* ``copy_flat_kernel``: both operands dense in the same order (rank 1).
* ``copy_strided_kernel``: up to 6 dimensions, in one of three shapes of work
  (constexpr): 2-D tiles with columns over the innermost dimension and rows
  over the others unravelled once per row; the same with rows over the second
  dimension alone for a transposed source; or one linear index per element
  unravelled over every dimension (rank-1 strided copies, tiny innermost
  dimensions).

Sizes and strides are runtime ``int64`` arguments that Triton does not
specialise, so a new shape or stride never compiles a new kernel; the
variants are a bounded set of constexpr flags the host computes (32- or
64-bit indexing, unit strides, alignment hints). Dimension 0 is innermost.
Unused dimensions are passed as size 1, stride 0.
"""

# ruff: noqa: N803 - constexpr parameters are UPPER_CASE, as in every Triton kernel
from __future__ import annotations

import triton
import triton.language as tl

from .jit_helpers import hint16 as _hint16
from .jit_helpers import index_type as _index

FLAT_SCALARS = ("n", "num_tiles")
SHAPE_SCALARS = tuple(f"size{d}" for d in range(6)) + tuple(f"dst_stride{d}" for d in range(6)) + tuple(
    f"src_stride{d}" for d in range(6))


@triton.jit
def _bf16_nearest_even(x):
    """float32 ``x`` to bfloat16, rounded to nearest even as ``c10::BFloat16(float)`` rounds (NaN: 0x7FC0).

    In integer arithmetic on purpose: the compiler folds ``int -> float32 ->
    bfloat16`` into one direct conversion (H200, triton 3.6: 18 of 2.3M random
    int32 differed from torch, which rounds twice), and Triton's interpreter
    truncates float32 -> bfloat16.
    """
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    top = tl.where(x != x, 0x7FC0, rounded)
    return top.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _cast(x, ty: tl.constexpr):
    """``x`` converted to ``ty`` as torch converts it.

    torch builds half and bfloat16 values from a float (c10::Half(float)), so
    integers and doubles round through float32 first; a direct conversion
    would round once and differ in the last bit now and then.
    """
    if ty == tl.bfloat16 and x.dtype != tl.bfloat16:
        return _bf16_nearest_even(x.to(tl.float32))
    if ty == tl.float16 and (x.dtype.is_int() or x.dtype == tl.float64):
        x = x.to(tl.float32)
    return x.to(ty)


@triton.jit
def _programs(INT64: tl.constexpr):
    """This program's id and the number of programs, in the index type."""
    return _index(tl.program_id(0), INT64), _index(tl.num_programs(0), INT64)


@triton.jit
def _unravel(rem, size, dst_stride, src_stride, dst_off, src_off):
    """Peel one dimension off a linear index; returns the rest and both offsets."""
    i = rem % size
    return rem // size, dst_off + i * dst_stride, src_off + i * src_stride


@triton.jit
def _outermost(RANK: tl.constexpr, x0, x1, x2, x3, x4, x5):
    """``x[RANK - 1]``: the value of the outermost dimension."""
    x = x0
    if RANK == 2:
        x = x1
    if RANK == 3:
        x = x2
    if RANK == 4:
        x = x3
    if RANK == 5:
        x = x4
    if RANK == 6:
        x = x5
    return x


@triton.jit
def _unravel_dims(rem, dst_off, src_off, FIRST: tl.constexpr, RANK: tl.constexpr,
                  s1, s2, s3, s4, s5, d1, d2, d3, d4, d5, r1, r2, r3, r4, r5):
    """Offsets of linear index ``rem`` over dimensions ``FIRST..RANK-1`` (FIRST >= 1)."""
    if FIRST <= 1 and RANK > 2:
        rem, dst_off, src_off = _unravel(rem, s1, d1, r1, dst_off, src_off)
    if FIRST <= 2 and RANK > 3:
        rem, dst_off, src_off = _unravel(rem, s2, d2, r2, dst_off, src_off)
    if FIRST <= 3 and RANK > 4:
        rem, dst_off, src_off = _unravel(rem, s3, d3, r3, dst_off, src_off)
    if FIRST <= 4 and RANK > 5:
        rem, dst_off, src_off = _unravel(rem, s4, d4, r4, dst_off, src_off)
    # The outermost dimension needs no modulo: the index is in range.
    dst_off += rem * _outermost(RANK, 0, d1, d2, d3, d4, d5)
    src_off += rem * _outermost(RANK, 0, r1, r2, r3, r4, r5)
    return dst_off, src_off


@triton.jit(do_not_specialize=FLAT_SCALARS)
def copy_flat_kernel(dst, src, n: tl.int64, num_tiles: tl.int64, BLOCK: tl.constexpr, INT64: tl.constexpr):
    """``dst[i] = src[i]`` for ``i < n``; full blocks skip the mask so loads vectorise."""
    pid, step = _programs(INT64)
    n = _index(n, INT64)
    for tile in range(pid, _index(num_tiles, INT64), step):
        start = tile * BLOCK
        offs = start + tl.arange(0, BLOCK)
        if start + BLOCK <= n:
            tl.store(dst + offs, _cast(tl.load(src + offs), dst.dtype.element_ty))
        else:
            mask = offs < n
            tl.store(dst + offs, _cast(tl.load(src + offs, mask=mask), dst.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=SHAPE_SCALARS + ("count", "tiles0", "tiles1", "num_tiles"))
def copy_strided_kernel(dst, src,
                        size0: tl.int64, size1: tl.int64, size2: tl.int64,
                        size3: tl.int64, size4: tl.int64, size5: tl.int64,
                        dst_stride0: tl.int64, dst_stride1: tl.int64, dst_stride2: tl.int64,
                        dst_stride3: tl.int64, dst_stride4: tl.int64, dst_stride5: tl.int64,
                        src_stride0: tl.int64, src_stride1: tl.int64, src_stride2: tl.int64,
                        src_stride3: tl.int64, src_stride4: tl.int64, src_stride5: tl.int64,
                        count: tl.int64, tiles0: tl.int64, tiles1: tl.int64, num_tiles: tl.int64,
                        RANK: tl.constexpr, LINEAR: tl.constexpr, BLOCK0: tl.constexpr, BLOCK1: tl.constexpr,
                        INT64: tl.constexpr, DST_UNIT0: tl.constexpr, SRC_UNIT0: tl.constexpr,
                        TRANSPOSED: tl.constexpr, ALIGNED: tl.constexpr):
    """Rank-``RANK`` (1..6) strided copy; program ``p`` handles tiles ``p, p + programs, ...``.

    ``LINEAR``: tiles of ``BLOCK0`` consecutive linear indices below ``count``
    (the number of elements), each unravelled over every dimension.

    Otherwise ``[BLOCK1, BLOCK0]`` tiles whose columns are dim 0 (``tiles0``
    tiles of it). Rows are the ``count`` indices of dims ``1..RANK-1``
    flattened, unravelled once per row; or, ``TRANSPOSED`` (the source's unit
    stride is dim 1), rows are dim 1 alone (``tiles1`` tiles of it), loaded
    along rows and stored along columns (Triton converts the layout through
    shared memory), dims ``2..`` peeled once per tile.

    ``*_UNIT0`` mark unit column strides; ``ALIGNED``: size 0 (and size 1 when
    transposed) and every stride the kernel multiplies by are multiples of 16.
    """
    pid, step = _programs(INT64)
    s0 = _hint16(_index(size0, INT64), ALIGNED)
    s1, s2, s3 = _index(size1, INT64), _index(size2, INT64), _index(size3, INT64)
    s4, s5 = _index(size4, INT64), _index(size5, INT64)
    d0, d1 = _hint16(_index(dst_stride0, INT64), ALIGNED), _hint16(_index(dst_stride1, INT64), ALIGNED)
    d2, d3 = _hint16(_index(dst_stride2, INT64), ALIGNED), _hint16(_index(dst_stride3, INT64), ALIGNED)
    d4, d5 = _hint16(_index(dst_stride4, INT64), ALIGNED), _hint16(_index(dst_stride5, INT64), ALIGNED)
    r0, r1 = _hint16(_index(src_stride0, INT64), ALIGNED), _hint16(_index(src_stride1, INT64), ALIGNED)
    r2, r3 = _hint16(_index(src_stride2, INT64), ALIGNED), _hint16(_index(src_stride3, INT64), ALIGNED)
    r4, r5 = _hint16(_index(src_stride4, INT64), ALIGNED), _hint16(_index(src_stride5, INT64), ALIGNED)
    n, t0_count, t1_count = _index(count, INT64), _index(tiles0, INT64), _index(tiles1, INT64)
    for tile in range(pid, _index(num_tiles, INT64), step):
        if LINEAR:
            idx = tile * BLOCK0 + tl.arange(0, BLOCK0)
            mask = idx < n
            if RANK == 1:
                dst_off = idx * d0
                src_off = idx * r0
            else:
                rem, dst_off, src_off = _unravel(idx, s0, d0, r0, idx * 0, idx * 0)
                dst_off, src_off = _unravel_dims(rem, dst_off, src_off, 1, RANK,
                                                 s1, s2, s3, s4, s5, d1, d2, d3, d4, d5, r1, r2, r3, r4, r5)
        else:
            i0 = (tile % t0_count) * BLOCK0 + tl.arange(0, BLOCK0)
            rest = tile // t0_count
            if TRANSPOSED:
                i1 = (rest % t1_count) * BLOCK1 + tl.arange(0, BLOCK1)
                outer = rest // t1_count
                row_mask = i1 < _hint16(s1, ALIGNED)
                dst_base = outer * 0
                src_base = outer * 0
                if RANK > 2:
                    dst_base, src_base = _unravel_dims(outer, dst_base, src_base, 2, RANK,
                                                       s1, s2, s3, s4, s5, d1, d2, d3, d4, d5, r1, r2, r3, r4, r5)
                dst_row = dst_base + i1 * d1
                src_row = src_base + i1
            else:
                i1 = rest * BLOCK1 + tl.arange(0, BLOCK1)
                row_mask = i1 < n
                dst_row, src_row = _unravel_dims(i1, i1 * 0, i1 * 0, 1, RANK,
                                                 s1, s2, s3, s4, s5, d1, d2, d3, d4, d5, r1, r2, r3, r4, r5)
            if DST_UNIT0:
                dst_col = i0
            else:
                dst_col = i0 * d0
            if SRC_UNIT0:
                src_col = i0
            else:
                src_col = i0 * r0
            mask = row_mask[:, None] & (i0 < s0)[None, :]
            dst_off = dst_row[:, None] + dst_col[None, :]
            src_off = src_row[:, None] + src_col[None, :]
        x = tl.load(src + src_off, mask=mask)
        tl.store(dst + dst_off, _cast(x, dst.dtype.element_ty), mask=mask)
