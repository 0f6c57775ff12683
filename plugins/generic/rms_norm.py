"""``flaggems::rms_norm`` and ``flaggems::add_rms_norm``: one launch forward, one or two backward.

The semantics (checks, output dtypes and layouts, autograd) are
:mod:`flaggems.fronts.rms_norm`'s; this module is the kernels, :func:`forward`
and :func:`backward`.

Rows are every index but the last (hidden) dimension ``H``. Each operand is
addressed through its own row strides: the row dimensions are collapsed
jointly for all operands (:func:`~flaggems.toolkit.collapse_dims`, ordered by
the input's strides; at most three remain, more decline) and the hidden
dimension has stride 1 (else declined). ``rstd`` is an operand like the others
(contiguous over the row dimensions), so forward and backward agree on it
whatever order each collapses the rows in.

Forward, ``_forward_kernel``, one launch: a program normalises ``ROWS`` rows.
When ``next_pow2(H) <= WHOLE_ROW`` a row stays in registers (``[ROWS, BLOCK_H]``
tile, several rows a program for small ``H`` and many rows, e.g. per-head q/k
norms); otherwise ``CHUNKS`` chunks of ``CHUNK``: sum of squares in a first
pass, normalised in a second that reads the row again (``add_rms_norm``: the
sum it wrote, after a barrier). Bytes: ``rms_norm`` reads ``x`` and writes
``y`` (``2 * 2 * rows * H`` for bf16, weight from cache); ``add_rms_norm``
reads ``x`` and ``residual`` and writes ``y`` and the sum (``4 * 2 * rows * H``
for bf16), against 3 and 6-7 passes (plus fp32 temporaries) for the
reference's unfused ops. ``rstd`` (4 bytes a row) is written only when a
gradient is needed.

Backward, ``_backward_kernel``: ``dx = rstd * (g - n * mean(g * n))`` per row
(``n = x * rstd`` from the saved ``rstd``, ``g`` the gradient reaching ``n``,
rounded as the reference's autograd rounds it); ``add_rms_norm`` adds the
sum's gradient (one read more). The weight's gradient: each program sums
``dy * round_in(n)`` over its contiguous range of row tiles into one fp32 row of a
``[programs, H]`` workspace (``programs`` about two per multiprocessor), then
``_dweight_kernel`` sums the partials column-wise in a fixed order (no
atomics: deterministic). Bytes: ``x``, ``dy`` read and ``dx`` written once
(``3 * 2 * rows * H`` for bf16), plus ``2 * 4 * programs * H`` for the
partials.

Numerics: fp32 math; the mean of squares is ``sum / H`` (``1 / sqrt_rn``:
correctly rounded). Every rounding the reference makes is made here too
(``round_in(n)``, ``round_w(weight + offset)``, the product rounded to the
output dtype), so the forward differs from the reference only by the fp32
reduction order of the mean of squares (about 1 ulp of fp32 in ``rstd``;
rarely a 1-ulp difference after rounding to a 16-bit dtype). The backward
keeps the products of ``dweight`` in fp32 where the reference rounds each
to the output dtype before summing.

Row strides and the row count are runtime arguments (64-bit, never
specialised); ``H`` is a ``constexpr`` (one compiled kernel per hidden size:
masks fold away when ``H`` is a power of two); ``ALIGNED`` tells the compiler
the row strides are multiples of 16 elements (checked on the host) so loads
vectorise. 64-bit offsets where an operand's reach passes 2**31.
"""

# ruff: noqa: N803, N806 - constexpr parameters and the hidden size are UPPER_CASE, as in every Triton kernel
from __future__ import annotations

import functools
import math
from typing import Any

import torch
import triton
import triton.language as tl

from flaggems import Decline
from flaggems.fronts import rms_norm as front
from flaggems.toolkit import FastLauncher, cdiv, collapse_dims, context, next_pow2
from flaggems.toolkit.jit_helpers import hint16 as _hint16
from flaggems.toolkit.jit_helpers import index_type as _index
from flaggems.toolkit.layout import remember

#: Largest ``next_pow2(H)`` a forward program keeps in registers (16 warps: 32 fp32 values a thread);
#: the backward holds more values a row and stops at :data:`WHOLE_ROW_BACKWARD`.
WHOLE_ROW = 16384
WHOLE_ROW_BACKWARD = 8192
#: Chunk width of the looped path (hidden sizes past the whole-row limits).
CHUNK = 4096
#: Elements of a tile that holds several short rows (per-head norms: ``H = 64, 128``).
TILE = 4096
#: Programs a multiprocessor should get at least, before rows are packed several to a program; the backward's
#: own count is also its number of partial ``dweight`` rows.
PROGRAMS_PER_SM = 2
BACKWARD_PROGRAMS_PER_SM = 2
#: Elements of a row tile a warp takes (warps = tile elements / this, 1 to 16). The backward's 4-row tiles of
#: 1,024 columns took 21.4 us on 16 warps (256 elements a warp) and 3.9 us on 4 (H100, 2,048 bf16 rows).
WARP_ELEMENTS = 256
BACKWARD_WARP_ELEMENTS = 1024
#: Program target where the device facts give no multiprocessor count (interpreter).
DEFAULT_TARGET = 4
#: ``_dweight_kernel``'s tile (``[BLOCK_P, BLOCK_C]`` partials summed per step) and warps: the 256 partial
#: rows of 2,048 rows in one step (1.8 us on the H100; 3.5 us in eight ``[32, 64]`` steps).
BLOCK_P, BLOCK_C, DWEIGHT_WARPS = 256, 16, 8
INT32_LIMIT = 2**31
ROW_DIMS = 3

_STRIDES = tuple(f"{t}s{i}" for t in ("x", "r", "y", "t", "q") for i in range(3))
_FWD_NO_SPECIALIZE = ("rows", "m1", "m2", *_STRIDES, "wsd")
_BWD_STRIDES = tuple(f"{t}s{i}" for t in ("g", "h", "x", "d", "q") for i in range(3))
_BWD_NO_SPECIALIZE = ("rows", "m1", "m2", "tiles", *_BWD_STRIDES, "wsd")


# --------------------------------------------------------------------------- kernels
@triton.jit
def _row_offsets(r, m1, m2, s0, s1, s2, LEAD: tl.constexpr, ALIGNED: tl.constexpr, INT64: tl.constexpr):
    """Offsets of rows ``r`` (indices over the collapsed row dimensions ``(rows / (m1 m2), m1, m2)``)."""
    s2 = _hint16(_index(s2, INT64), ALIGNED)
    if LEAD == 1:
        off = r * s2
    elif LEAD == 2:
        m2 = _index(m2, INT64)
        off = (r // m2) * _hint16(_index(s1, INT64), ALIGNED) + (r % m2) * s2
    else:
        m1, m2 = _index(m1, INT64), _index(m2, INT64)
        off = ((r // m2 // m1) * _hint16(_index(s0, INT64), ALIGNED) + (r // m2 % m1) * _hint16(_index(s1, INT64),
                                                                                               ALIGNED)
               + (r % m2) * s2)
    return off


@triton.jit
def _scale(w, cols, cmask, wsd, offset, W_UNIT: tl.constexpr, HAS_OFFSET: tl.constexpr, CAST_FIRST: tl.constexpr):
    """The weight's factor in fp32: ``round_w(w + offset)`` with ``cast_first`` (the reference adds in the
    weight's dtype), ``w + offset`` in fp32 without."""
    if W_UNIT:
        s = tl.load(w + cols, mask=cmask, other=0.0)
    else:
        s = tl.load(w + cols * wsd, mask=cmask, other=0.0)
    s = s.to(tl.float32)
    if HAS_OFFSET:
        s = s + offset
        if CAST_FIRST:
            s = s.to(w.dtype.element_ty).to(tl.float32)
    return s


@triton.jit
def _normed(n, s, x, y, HAS_W: tl.constexpr, CAST_FIRST: tl.constexpr):
    """The output from fp32 ``n = x * rstd``, rounded as the reference rounds it, in ``y``'s dtype."""
    if HAS_W:
        if CAST_FIRST:
            out = n.to(x.dtype.element_ty).to(tl.float32) * s[None, :]
        else:
            out = n * s[None, :]
    else:
        out = n
    return out.to(y.dtype.element_ty)


@triton.jit
def _rstd(sum_sq, eps, H: tl.constexpr):
    """``1 / sqrt(sum_sq / H + eps)``, correctly rounded steps."""
    return 1.0 / tl.sqrt_rn(sum_sq / H + eps)


@triton.jit
def _load_sum(x, res, total, xo, ro, to, mask, HAS_RES: tl.constexpr):
    """``x`` in fp32; with a residual ``round_in(x + residual)``, also stored into ``total``."""
    v = tl.load(x + xo, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        v = (v + tl.load(res + ro, mask=mask, other=0.0).to(tl.float32)).to(total.dtype.element_ty)
        tl.store(total + to, v, mask=mask)
        v = v.to(tl.float32)
    return v


@triton.jit(do_not_specialize=_FWD_NO_SPECIALIZE)
def _forward_kernel(x, res, w, y, total, rstd, rows: tl.int64, m1: tl.int64, m2: tl.int64,
                    xs0: tl.int64, xs1: tl.int64, xs2: tl.int64, rs0: tl.int64, rs1: tl.int64, rs2: tl.int64,
                    ys0: tl.int64, ys1: tl.int64, ys2: tl.int64, ts0: tl.int64, ts1: tl.int64, ts2: tl.int64,
                    qs0: tl.int64, qs1: tl.int64, qs2: tl.int64, wsd: tl.int64, eps, offset,
                    H: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr, CHUNKS: tl.constexpr,
                    LEAD: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, W_UNIT: tl.constexpr,
                    CAST_FIRST: tl.constexpr, HAS_OFFSET: tl.constexpr, SAVE_RSTD: tl.constexpr,
                    ALIGNED: tl.constexpr, INT64: tl.constexpr):
    """Rows ``[pid * ROWS, pid * ROWS + ROWS)`` normalised (and, ``HAS_RES``, their sum with the residual stored)."""
    r = _index(tl.program_id(0), INT64) * ROWS + tl.arange(0, ROWS)
    rmask = r < _index(rows, INT64)
    xr = _row_offsets(r, m1, m2, xs0, xs1, xs2, LEAD, ALIGNED, INT64)[:, None]
    rr = _row_offsets(r, m1, m2, rs0, rs1, rs2, LEAD, ALIGNED, INT64)[:, None]
    yr = _row_offsets(r, m1, m2, ys0, ys1, ys2, LEAD, ALIGNED, INT64)[:, None]
    tr = _row_offsets(r, m1, m2, ts0, ts1, ts2, LEAD, ALIGNED, INT64)[:, None]
    if CHUNKS == 1:  # the whole row in registers
        cols = tl.arange(0, BLOCK_H)
        cmask = cols < H
        mask = rmask[:, None] & cmask[None, :]
        v = _load_sum(x, res, total, xr + cols[None, :], rr + cols[None, :], tr + cols[None, :], mask, HAS_RES)
        rs = _rstd(tl.sum(v * v, axis=1), eps, H)
        s = cols
        if HAS_W:
            s = _scale(w, cols, cmask, wsd, offset, W_UNIT, HAS_OFFSET, CAST_FIRST)
        tl.store(y + yr + cols[None, :], _normed(v * rs[:, None], s, x, y, HAS_W, CAST_FIRST), mask=mask)
    else:  # two passes over chunks; the second reads the row again (the sum, as stored)
        acc = tl.zeros([ROWS, BLOCK_H], tl.float32)
        for c in range(CHUNKS):
            cols = c * BLOCK_H + tl.arange(0, BLOCK_H)
            mask = rmask[:, None] & (cols < H)[None, :]
            v = _load_sum(x, res, total, xr + cols[None, :], rr + cols[None, :], tr + cols[None, :], mask, HAS_RES)
            acc += v * v
        rs = _rstd(tl.sum(acc, axis=1), eps, H)
        if HAS_RES:
            tl.debug_barrier()  # the sum stored by other threads of this program is read back below
        for c in range(CHUNKS):
            cols = c * BLOCK_H + tl.arange(0, BLOCK_H)
            cmask = cols < H
            mask = rmask[:, None] & cmask[None, :]
            if HAS_RES:
                v = tl.load(total + tr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            else:
                v = tl.load(x + xr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            s = cols
            if HAS_W:
                s = _scale(w, cols, cmask, wsd, offset, W_UNIT, HAS_OFFSET, CAST_FIRST)
            tl.store(y + yr + cols[None, :], _normed(v * rs[:, None], s, x, y, HAS_W, CAST_FIRST), mask=mask)
    if SAVE_RSTD:
        tl.store(rstd + _row_offsets(r, m1, m2, qs0, qs1, qs2, LEAD, False, INT64), rs, mask=rmask)


@triton.jit
def _grad_normed(g, s, dy, x, HAS_W: tl.constexpr, CAST_FIRST: tl.constexpr):
    """The gradient reaching fp32 ``n`` from ``dy`` (fp32 ``g``), rounded as the reference's autograd rounds it:
    ``round_in(round_out(dy * s))`` with ``cast_first`` (``mul``'s backward in the output dtype, then the cast
    to ``round_in(n)``'s dtype), ``dy * s`` in fp32 without."""
    if HAS_W:
        if CAST_FIRST:
            g = (g * s[None, :]).to(dy.dtype.element_ty).to(x.dtype.element_ty).to(tl.float32)
        else:
            g = g * s[None, :]
    return g


@triton.jit
def _weight_terms(g, n, x, CAST_FIRST: tl.constexpr):
    """Per-column sums of ``dy * round_in(n)`` (``cast_first``) or ``dy * n`` over the tile's rows."""
    if CAST_FIRST:
        n = n.to(x.dtype.element_ty).to(tl.float32)
    return tl.sum(g * n, axis=0)


@triton.jit
def _dx(g, n, rs, c, dsum, dx, ho, mask, HAS_DSUM: tl.constexpr):
    """``rstd * (g - n * c)`` in ``dx``'s dtype; with the sum's gradient ``round(round(.) + dsum)``."""
    d = rs[:, None] * (g - n * c[:, None])
    if HAS_DSUM:
        d = d.to(dx.dtype.element_ty).to(tl.float32) + tl.load(dsum + ho, mask=mask, other=0.0).to(tl.float32)
    return d.to(dx.dtype.element_ty)


@triton.jit(do_not_specialize=_BWD_NO_SPECIALIZE)
def _backward_kernel(dy, dsum, x, rstd, w, dx, part, rows: tl.int64, m1: tl.int64, m2: tl.int64, tiles: tl.int64,
                     gs0: tl.int64, gs1: tl.int64, gs2: tl.int64, hs0: tl.int64, hs1: tl.int64, hs2: tl.int64,
                     xs0: tl.int64, xs1: tl.int64, xs2: tl.int64, ds0: tl.int64, ds1: tl.int64, ds2: tl.int64,
                     qs0: tl.int64, qs1: tl.int64, qs2: tl.int64, wsd: tl.int64, offset,
                     H: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr, CHUNKS: tl.constexpr,
                     LEAD: tl.constexpr, HAS_DSUM: tl.constexpr, HAS_W: tl.constexpr, W_UNIT: tl.constexpr,
                     CAST_FIRST: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_DX: tl.constexpr,
                     HAS_DW: tl.constexpr, ALIGNED: tl.constexpr, INT64: tl.constexpr):
    """Row tiles ``[pid * tiles, pid * tiles + tiles)``: ``dx``, and this program's partial ``dweight`` row."""
    pid = _index(tl.program_id(0), INT64)
    count = _index(tiles, INT64)
    nrows = _index(rows, INT64)
    prow = part + pid.to(tl.int64) * H
    if CHUNKS == 1:
        cols = tl.arange(0, BLOCK_H)
        cmask = cols < H
        s = cols
        if HAS_W:
            s = _scale(w, cols, cmask, wsd, offset, W_UNIT, HAS_OFFSET, CAST_FIRST)
        dw_acc = tl.zeros([BLOCK_H], tl.float32)
        for t in range(0, count):
            r = (pid * count + t) * ROWS + tl.arange(0, ROWS)
            rmask = r < nrows
            mask = rmask[:, None] & cmask[None, :]
            rs = tl.load(rstd + _row_offsets(r, m1, m2, qs0, qs1, qs2, LEAD, False, INT64), mask=rmask, other=0.0)
            go = _row_offsets(r, m1, m2, gs0, gs1, gs2, LEAD, ALIGNED, INT64)[:, None] + cols[None, :]
            xo = _row_offsets(r, m1, m2, xs0, xs1, xs2, LEAD, ALIGNED, INT64)[:, None] + cols[None, :]
            g = tl.load(dy + go, mask=mask, other=0.0).to(tl.float32)
            n = tl.load(x + xo, mask=mask, other=0.0).to(tl.float32) * rs[:, None]
            if HAS_DX:
                gn = _grad_normed(g, s, dy, x, HAS_W, CAST_FIRST)
                c = tl.sum(gn * n, axis=1) / H
                ho = _row_offsets(r, m1, m2, hs0, hs1, hs2, LEAD, ALIGNED, INT64)[:, None] + cols[None, :]
                do = _row_offsets(r, m1, m2, ds0, ds1, ds2, LEAD, ALIGNED, INT64)[:, None] + cols[None, :]
                tl.store(dx + do, _dx(gn, n, rs, c, dsum, dx, ho, mask, HAS_DSUM), mask=mask)
            if HAS_DW:
                dw_acc += _weight_terms(g, n, x, CAST_FIRST)
        if HAS_DW:
            tl.store(prow + cols, dw_acc, mask=cmask)
    else:  # long rows: one row a tile, chunks read twice (dot product, then dx); partials kept in ``part``
        if HAS_DW:
            for c0 in range(CHUNKS):
                cols = c0 * BLOCK_H + tl.arange(0, BLOCK_H)
                tl.store(prow + cols, tl.zeros([BLOCK_H], tl.float32), mask=cols < H)
            tl.debug_barrier()
        for t in range(0, count):
            r = (pid * count + t) * ROWS + tl.arange(0, ROWS)
            rmask = r < nrows
            rs = tl.load(rstd + _row_offsets(r, m1, m2, qs0, qs1, qs2, LEAD, False, INT64), mask=rmask, other=0.0)
            gr = _row_offsets(r, m1, m2, gs0, gs1, gs2, LEAD, ALIGNED, INT64)[:, None]
            xr = _row_offsets(r, m1, m2, xs0, xs1, xs2, LEAD, ALIGNED, INT64)[:, None]
            hr = _row_offsets(r, m1, m2, hs0, hs1, hs2, LEAD, ALIGNED, INT64)[:, None]
            dr = _row_offsets(r, m1, m2, ds0, ds1, ds2, LEAD, ALIGNED, INT64)[:, None]
            c = tl.zeros([ROWS], tl.float32)
            if HAS_DX:
                acc = tl.zeros([ROWS, BLOCK_H], tl.float32)
                for c0 in range(CHUNKS):
                    cols = c0 * BLOCK_H + tl.arange(0, BLOCK_H)
                    cmask = cols < H
                    mask = rmask[:, None] & cmask[None, :]
                    s = cols
                    if HAS_W:
                        s = _scale(w, cols, cmask, wsd, offset, W_UNIT, HAS_OFFSET, CAST_FIRST)
                    g = tl.load(dy + gr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                    n = tl.load(x + xr + cols[None, :], mask=mask, other=0.0).to(tl.float32) * rs[:, None]
                    acc += _grad_normed(g, s, dy, x, HAS_W, CAST_FIRST) * n
                c = tl.sum(acc, axis=1) / H
            for c0 in range(CHUNKS):
                cols = c0 * BLOCK_H + tl.arange(0, BLOCK_H)
                cmask = cols < H
                mask = rmask[:, None] & cmask[None, :]
                g = tl.load(dy + gr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                n = tl.load(x + xr + cols[None, :], mask=mask, other=0.0).to(tl.float32) * rs[:, None]
                if HAS_DX:
                    s = cols
                    if HAS_W:
                        s = _scale(w, cols, cmask, wsd, offset, W_UNIT, HAS_OFFSET, CAST_FIRST)
                    gn = _grad_normed(g, s, dy, x, HAS_W, CAST_FIRST)
                    tl.store(dx + dr + cols[None, :], _dx(gn, n, rs, c, dsum, dx, hr + cols[None, :], mask, HAS_DSUM),
                             mask=mask)
                if HAS_DW:
                    # each column of the partial row is read and written by the same thread (one layout)
                    kept = tl.load(prow + cols, mask=cmask, other=0.0)
                    tl.store(prow + cols, kept + _weight_terms(g, n, x, CAST_FIRST), mask=cmask)


@triton.jit(do_not_specialize=("programs",))
def _dweight_kernel(part, dw, programs: tl.int64, H: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """``dweight[c] = sum over p of part[p, c]`` in a fixed order (``[BLOCK_P, BLOCK_C]`` steps, then a tree)."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < H
    acc = tl.zeros([BLOCK_P, BLOCK_C], tl.float32)
    for p0 in range(0, programs, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        mask = (p < programs)[:, None] & cmask[None, :]
        acc += tl.load(part + p.to(tl.int64)[:, None] * H + cols[None, :], mask=mask, other=0.0)
    tl.store(dw + cols, tl.sum(acc, axis=0).to(dw.dtype.element_ty), mask=cmask)


# --------------------------------------------------------------------------- host: plans
@functools.cache
def _launcher(kernel: Any, num_warps: int, **constexprs: Any) -> FastLauncher:
    return FastLauncher(kernel, constexprs, num_warps=num_warps)


@context.cached
def _target_programs(device_type: str, index: int, per_sm: int) -> int:
    units = context.current().facts(index).multiprocessors if device_type != "cpu" else None
    return per_sm * units if units else DEFAULT_TARGET




def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _rows(shape: tuple[int, ...], operands: list[tuple[int, ...]]) -> tuple[int, int, int, int, list[tuple]] | None:
    """``(rows, m1, m2, LEAD, row stride triples)`` of the row dimensions collapsed for all ``operands``
    (each a full stride tuple), or ``None`` when more than three remain."""
    sizes, strides = collapse_dims(shape[:-1], *(s[:-1] for s in operands))
    if len(sizes) > ROW_DIMS:
        return None
    lead = max(len(sizes), 1)
    pad = ROW_DIMS - len(sizes)
    sizes = (1,) * pad + tuple(sizes)
    triples = [(0,) * pad + tuple(s) for s in strides] if strides else [(0, 0, 0)] * len(operands)
    return math.prod(sizes), sizes[1], sizes[2], lead, triples


def _layout_flags(rows: int, m1: int, m2: int, H: int, triples: list[tuple]) -> tuple[bool, bool]:
    """``(ALIGNED, INT64)``: every row stride a multiple of 16; some operand's reach past 2**31."""
    aligned = all(s % 16 == 0 for t in triples for s in t)
    sizes = (cdiv(rows, m1 * m2), m1, m2)
    reach = max(sum((n - 1) * s for n, s in zip(sizes, t, strict=True)) for t in triples) + H
    return aligned, reach >= INT32_LIMIT or rows + TILE >= INT32_LIMIT


def _tiling(H: int, rows: int, device: torch.device, whole_row: int, per_sm: int,
            warp_elements: int) -> tuple[int, int, int, int]:
    """``(BLOCK_H, ROWS, CHUNKS, num_warps)``: whole rows when they fit, several when short and plentiful."""
    block = next_pow2(H)
    if block > whole_row:
        return CHUNK, 1, cdiv(H, CHUNK), 16
    per_program = cdiv(rows, _target_programs(device.type, device.index or 0, per_sm))
    packed = max(1, min(TILE // block, 1 << (per_program.bit_length() - 1)))  # a power of two <= per_program
    return block, packed, 1, min(16, max(1, packed * block // warp_elements))


def _unit_last(t: torch.Tensor) -> bool:
    return t.shape[-1] == 1 or t.stride(-1) == 1


def _forward_plan(input: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                  y: torch.Tensor, total: torch.Tensor | None, save_rstd: bool, cast_first: bool,
                  has_offset: bool) -> tuple:
    shape, H = tuple(input.shape), input.shape[-1]
    tensors = [t for t in (input, residual, y, total) if t is not None]
    if not all(_unit_last(t) for t in tensors):
        raise Decline("a hidden dimension of stride != 1")
    q = _contiguous_strides(shape[:-1]) + (1,)
    operands = [input.stride(), (residual if residual is not None else input).stride(), y.stride(),
                (total if total is not None else y).stride(), q]
    found = _rows(shape, operands)
    if found is None:
        raise Decline(f"row dimensions of {shape} do not collapse to {ROW_DIMS}")
    rows, m1, m2, lead, triples = found
    block, packed, chunks, warps = _tiling(H, rows, input.device, WHOLE_ROW, PROGRAMS_PER_SM, WARP_ELEMENTS)
    aligned, int64 = _layout_flags(rows, m1, m2, H, triples[:4])
    launcher = _launcher(_forward_kernel, warps, H=H, BLOCK_H=block, ROWS=packed, CHUNKS=chunks, LEAD=lead,
                         HAS_RES=residual is not None, HAS_W=weight is not None,
                         W_UNIT=weight is None or weight.stride(0) == 1, CAST_FIRST=cast_first,
                         HAS_OFFSET=has_offset, SAVE_RSTD=save_rstd, ALIGNED=aligned, INT64=int64)
    scalars = (rows, m1, m2, *(s for t in triples for s in t), 0 if weight is None else weight.stride(0))
    return launcher, (cdiv(rows, packed),), scalars


_FORWARD: dict[tuple, tuple] = context.cache()
_BACKWARD: dict[tuple, tuple] = context.cache()


def _weight_key(weight: torch.Tensor | None) -> tuple | None:
    return None if weight is None else (weight.stride(0), weight.dtype)


def forward(input: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, y: torch.Tensor,
            total: torch.Tensor | None, rstd: torch.Tensor | None, eps: float, offset: float,
            cast_first: bool) -> None:
    """Fill ``y`` (and ``total``, ``rstd`` where given) in one launch; ``Decline`` before it for a layout
    the kernel does not take (see the module docstring)."""
    has_offset = offset != 0.0
    key = (input.shape, input.stride(), input.dtype, input.device,
           None if residual is None else residual.stride(), _weight_key(weight), y.stride(), y.dtype,
           None if total is None else total.stride(), rstd is None, cast_first, has_offset)
    plan = _FORWARD.get(key)
    if plan is None:
        plan = remember(_FORWARD, key, _forward_plan(input, residual, weight, y, total, rstd is not None,
                                                     cast_first, has_offset))
    launcher, grid, scalars = plan
    launcher(grid, input, input if residual is None else residual, input if weight is None else weight, y,
             y if total is None else total, y if rstd is None else rstd, *scalars, eps, offset)


def _backward_plan(dy: torch.Tensor, dsum: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor | None,
                   dx: torch.Tensor | None, need_dw: bool, cast_first: bool, has_offset: bool) -> tuple | None:
    shape, H = tuple(x.shape), x.shape[-1]
    if not all(_unit_last(t) for t in (dy, dsum, x, dx) if t is not None):
        return None
    q = _contiguous_strides(shape[:-1]) + (1,)
    operands = [x.stride(), dy.stride(), (dsum if dsum is not None else dy).stride(),
                (dx if dx is not None else x).stride(), q]
    found = _rows(shape, operands)
    if found is None:
        return None
    rows, m1, m2, lead, (xs, gs, hs, ds, qs) = found
    block, packed, chunks, warps = _tiling(H, rows, x.device, WHOLE_ROW_BACKWARD, BACKWARD_PROGRAMS_PER_SM,
                                         BACKWARD_WARP_ELEMENTS)
    aligned, int64 = _layout_flags(rows, m1, m2, H, [xs, gs, hs, ds])
    tiles = cdiv(rows, packed)
    target = _target_programs(x.device.type, x.device.index or 0, BACKWARD_PROGRAMS_PER_SM)
    per_program = cdiv(tiles, target) if need_dw else 1
    programs = cdiv(tiles, per_program)
    launcher = _launcher(_backward_kernel, warps, H=H, BLOCK_H=block, ROWS=packed, CHUNKS=chunks, LEAD=lead,
                         HAS_DSUM=dsum is not None, HAS_W=weight is not None,
                         W_UNIT=weight is None or weight.stride(0) == 1, CAST_FIRST=cast_first,
                         HAS_OFFSET=has_offset, HAS_DX=dx is not None, HAS_DW=need_dw, ALIGNED=aligned,
                         INT64=int64)
    scalars = (rows, m1, m2, per_program, *gs, *hs, *xs, *ds, *qs, 0 if weight is None else weight.stride(0))
    finish = None
    if need_dw:
        finish = (_launcher(_dweight_kernel, DWEIGHT_WARPS, H=H, BLOCK_P=BLOCK_P, BLOCK_C=BLOCK_C), (cdiv(H, BLOCK_C),))
    return launcher, (programs,), scalars, programs, finish


def backward(dy: torch.Tensor, dsum: torch.Tensor | None, x: torch.Tensor, rstd: torch.Tensor,
             weight: torch.Tensor | None, dx: torch.Tensor | None, dw: torch.Tensor | None, offset: float,
             cast_first: bool) -> None:
    """Fill ``dx`` and ``dw`` (where not ``None``): one launch, two with ``dw``. Never declines: operands
    the kernel cannot address in place are copied first (an expanded ``dy``, rows that do not collapse)."""
    has_offset = offset != 0.0
    key = (x.shape, x.stride(), x.dtype, x.device, dy.stride(), dy.dtype,
           None if dsum is None else (dsum.stride(), dsum.dtype), _weight_key(weight),
           None if dx is None else dx.stride(), dw is not None, cast_first, has_offset)
    plan = _BACKWARD.get(key)
    if plan is None:
        plan = _backward_plan(dy, dsum, x, weight, dx, dw is not None, cast_first, has_offset)
        if plan is None:
            _backward_copied(dy, dsum, x, rstd, weight, dx, dw, offset, cast_first)
            return
        remember(_BACKWARD, key, plan)
    launcher, grid, scalars, programs, finish = plan
    part = torch.empty((programs, x.shape[-1]) if dw is not None else (1,), dtype=torch.float32, device=x.device)
    launcher(grid, dy, dy if dsum is None else dsum, x, rstd, x if weight is None else weight,
             x if dx is None else dx, part, *scalars, offset)
    if finish is not None:
        finish[0](finish[1], part, dw, programs)


def _backward_copied(dy: torch.Tensor, dsum: torch.Tensor | None, x: torch.Tensor, rstd: torch.Tensor,
                     weight: torch.Tensor | None, dx: torch.Tensor | None, dw: torch.Tensor | None, offset: float,
                     cast_first: bool) -> None:
    """The backward on contiguous copies (``dx`` computed into a contiguous tensor when its own layout
    does not collapse with them, then copied)."""
    dy, x = dy.contiguous(), x.contiguous()
    dsum = None if dsum is None else dsum.contiguous()
    out = dx if dx is None or dx.is_contiguous() else torch.empty_like(dx, memory_format=torch.contiguous_format)
    backward(dy, dsum, x, rstd, weight, out, dw, offset, cast_first)
    if out is not dx:
        dx.copy_(out)


#: The implementations of the two ``OpImpl`` lines (checks, layouts and autograd are the front's).
rms_norm, add_rms_norm = front.entries(forward, backward)
