"""Gather and scatter along one dimension: the kernel behind index_copy and index_select.

Two operands of one rank: ``a`` is addressed by position ``j`` along ``dim``
and ``b`` by ``index[j]``. Scatter writes ``b[..., index[j], ...] = a[..., j, ...]``
(index_copy); gather writes ``a[..., j, ...] = b[..., index[j], ...]`` (index_select).

The host views the work as ``[outer, j, inner]``: dimensions before ``dim``
collapse into at most two "outer" dimensions and those after it into at most
two "inner" ones (:func:`~flaggems.toolkit.layout.collapse_dims`, with the
operands' real strides: transposed and sliced tensors are addressed in place,
never copied). One 2-D tile kernel covers both regimes the workload can take:
rows of ``(outer, j)`` with one index load per row, and columns over
``inner``. A narrow inner size (``<= 4`` elements, e.g. a 1-D tensor) gets
tall tiles of many rows, a wide one gets one row per tile and wide columns
(rows of 2 KiB or more: tiles of 16 KiB, whatever the dtype).

Sizes and strides are runtime ``int64`` arguments (new shapes never compile);
the constexprs are a bounded menu: tile shape, gather/scatter, 32/64-bit
offsets, whether the tiles cover the work exactly (then no edge-tile code is
compiled: fewer registers, more programs resident). Invalid indices (``< 0``
or ``>= size``) are masked: nothing is written out of bounds; a gather writes
zeros there, or (given a ``fallback`` tensor: index_copy's inverse form) that
tensor's element, or nothing at all when the fallback is the destination
itself. Callers validate indices when checking is on.

A search (``INDEX_SEARCH``) finds each row's ``j`` by comparing its position
with every entry of a short index: index_copy's one-launch out-of-place form.
Its tiles hold at most ``search_lanes`` row-and-entry pairs a step (:class:`~.tuning.GatherScatterPolicy`).

:func:`scatter_or_gather` runs a scatter plan or a gather plan in one launch,
whichever a flag in device memory (written by an earlier launch) picks: the
host never reads the flag, and no launch is left empty.
"""

# ruff: noqa: N803 - constexpr parameters are UPPER_CASE, as in every Triton kernel
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import context, tuning
from .jit_helpers import hint16 as _hint
from .jit_helpers import index_type as _narrow
from .launch import FastLauncher
from .layout import cdiv, collapse_dims, next_pow2, remember, span

INT32_LIMIT = 2**31
def _policy() -> tuning.GatherScatterPolicy:
    """Tiles and warps (tuning key ``gather_scatter``; the measured defaults are documented there)."""
    return tuning.policy("gather_scatter")


# Runtime scalars Triton must not specialise (a new shape never compiles).
_SCALARS = ("outer0", "outer1", "rows", "inner1", "cols", "col_tiles", "dim_size",
            "a_o0", "a_o1", "a_j", "a_i0", "a_i1", "b_o0", "b_o1", "b_d", "b_i0", "b_i1",
            "idx_stride", "j_size", "divisor")
_EITHER_SCALARS = ("scatter_tiles", "gather_tiles", *(side + name for side in ("s_", "g_") for name in _SCALARS))

#: How the kernel finds ``index[j]``: a tensor, ``j // int``, ``j // tensor[0]``, or a search of a tensor
#: for ``j`` (the last ``k < divisor`` with ``tensor[k] == j``; -1 where none: a scatter turned gather).
INDEX_TENSOR, INDEX_DIVIDE_INT, INDEX_DIVIDE_TENSOR, INDEX_SEARCH = 0, 1, 2, 3
#: What a gather writes where ``index[j]`` is invalid: zero, a fallback tensor's element, or nothing.
FALLBACK_ZERO, FALLBACK_TENSOR, FALLBACK_KEEP = 0, 1, 2
#: How a tile's rows split into ``(outer, j)``, dearest first (see :func:`_row_coordinates`).
ROWS_DIVIDE, ROWS_WRAP_ONCE, ROWS_ONE_OUTER, ROWS_NO_OUTER = 0, 1, 2, 3


@triton.jit
def _columns(c, inner1, stride0, stride1, UNIT: tl.constexpr):
    """Offsets of the inner positions ``c`` (``UNIT``: one unit-stride inner dimension)."""
    if UNIT:
        offsets = c
    else:
        offsets = (c // inner1) * stride0 + (c % inner1) * stride1
    return offsets


@triton.jit(do_not_specialize=_SCALARS)
def index_along_dim_kernel(a, b, idx, fallback,
                           outer0: tl.int64, outer1: tl.int64, j_size: tl.int64, rows: tl.int64,
                           inner1: tl.int64, cols: tl.int64, col_tiles: tl.int64, dim_size: tl.int64,
                           a_o0: tl.int64, a_o1: tl.int64, a_j: tl.int64, a_i0: tl.int64, a_i1: tl.int64,
                           b_o0: tl.int64, b_o1: tl.int64, b_d: tl.int64, b_i0: tl.int64, b_i1: tl.int64,
                           idx_stride: tl.int64, divisor: tl.int64,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, SCATTER: tl.constexpr,
                           INT64: tl.constexpr, INDEX_MODE: tl.constexpr, A_LINEAR: tl.constexpr,
                           A_UNIT: tl.constexpr, B_UNIT: tl.constexpr, ALIGNED: tl.constexpr,
                           FALLBACK: tl.constexpr, ROWS: tl.constexpr, WHOLE_TILES: tl.constexpr,
                           SEARCH: tl.constexpr):
    """One ``BLOCK_R x BLOCK_C`` tile of ``[(outer, j), inner]`` per program (1-D grid).

    ``A_LINEAR``: ``a`` is row-major over the work (offset ``r * cols + c``);
    ``A_UNIT``/``B_UNIT``: that operand's inner positions have unit stride.
    ``FALLBACK`` (gather), where the index is invalid: ``FALLBACK_ZERO``
    writes zero, ``FALLBACK_TENSOR`` ``fallback``'s value at ``a``'s own
    offset, ``FALLBACK_KEEP`` nothing (``fallback`` is ``a``). ``ROWS``: how a
    row splits into ``(outer, j)`` (``ROWS_*``, see :func:`_row_coordinates`).
    ``WHOLE_TILES``: the tiles cover the work exactly (no edge tile to mask).
    ``SEARCH``: index entries compared per row and step (``INDEX_SEARCH``).
    """
    _index_tile(_narrow(tl.program_id(0), INT64), a, b, idx, fallback,
                outer0, outer1, j_size, rows, inner1, cols, col_tiles, dim_size,
                a_o0, a_o1, a_j, a_i0, a_i1, b_o0, b_o1, b_d, b_i0, b_i1, idx_stride, divisor,
                BLOCK_R, BLOCK_C, SCATTER, INT64, INDEX_MODE, A_LINEAR, A_UNIT, B_UNIT, ALIGNED, FALLBACK, ROWS,
                WHOLE_TILES, SEARCH)


@triton.jit(do_not_specialize=_EITHER_SCALARS)
def scatter_or_gather_kernel(a, b, idx, inverse, scatter_tiles: tl.int64, gather_tiles: tl.int64,
                             s_outer0: tl.int64, s_outer1: tl.int64, s_j_size: tl.int64, s_rows: tl.int64,
                             s_inner1: tl.int64, s_cols: tl.int64, s_col_tiles: tl.int64, s_dim_size: tl.int64,
                             s_a_o0: tl.int64, s_a_o1: tl.int64, s_a_j: tl.int64, s_a_i0: tl.int64,
                             s_a_i1: tl.int64, s_b_o0: tl.int64, s_b_o1: tl.int64, s_b_d: tl.int64,
                             s_b_i0: tl.int64, s_b_i1: tl.int64, s_idx_stride: tl.int64, s_divisor: tl.int64,
                             g_outer0: tl.int64, g_outer1: tl.int64, g_j_size: tl.int64, g_rows: tl.int64,
                             g_inner1: tl.int64, g_cols: tl.int64, g_col_tiles: tl.int64, g_dim_size: tl.int64,
                             g_a_o0: tl.int64, g_a_o1: tl.int64, g_a_j: tl.int64, g_a_i0: tl.int64,
                             g_a_i1: tl.int64, g_b_o0: tl.int64, g_b_o1: tl.int64, g_b_d: tl.int64,
                             g_b_i0: tl.int64, g_b_i1: tl.int64, g_idx_stride: tl.int64, g_divisor: tl.int64,
                             S_BLOCK_R: tl.constexpr, S_BLOCK_C: tl.constexpr, S_INT64: tl.constexpr,
                             S_A_LINEAR: tl.constexpr, S_A_UNIT: tl.constexpr, S_B_UNIT: tl.constexpr,
                             S_ALIGNED: tl.constexpr, S_ROWS: tl.constexpr, S_WHOLE_TILES: tl.constexpr,
                             G_BLOCK_R: tl.constexpr, G_BLOCK_C: tl.constexpr, G_INT64: tl.constexpr,
                             G_A_LINEAR: tl.constexpr, G_A_UNIT: tl.constexpr, G_B_UNIT: tl.constexpr,
                             G_ALIGNED: tl.constexpr, G_ROWS: tl.constexpr, G_WHOLE_TILES: tl.constexpr):
    """In place: scatter ``a`` into ``b`` by ``idx`` when the order flag is ``<= 0``, else gather into ``b``.

    One launch that takes either form, chosen on the device by the flag the
    inverse kernel wrote after the inverse, at ``inverse[s_dim_size]``
    (positive: the index decreases somewhere; ``s_dim_size`` is the
    destination's size along ``dim``).
    ``a`` is the source, ``b`` the destination; ``s_*`` describe the scatter
    plan, ``g_*`` the gather by ``inverse`` that writes only indexed
    positions (``FALLBACK_KEEP``). The grid covers the larger plan; a program
    past the chosen plan's tiles does nothing.
    """
    pid = tl.program_id(0)
    # Both calls fix INDEX_MODE to 0 (an index tensor); FALLBACK is 0 for the scatter (unused) and 2
    # (FALLBACK_KEEP) for the gather. The two sides' arguments differ only by prefix.
    if tl.load(inverse + s_dim_size) <= 0:
        if pid < scatter_tiles:
            _index_tile(_narrow(pid, S_INT64), a, b, idx, a,
                        s_outer0, s_outer1, s_j_size, s_rows, s_inner1, s_cols, s_col_tiles, s_dim_size,
                        s_a_o0, s_a_o1, s_a_j, s_a_i0, s_a_i1, s_b_o0, s_b_o1, s_b_d, s_b_i0, s_b_i1,
                        s_idx_stride, s_divisor, S_BLOCK_R, S_BLOCK_C, True, S_INT64, 0, S_A_LINEAR, S_A_UNIT,
                        S_B_UNIT, S_ALIGNED, 0, S_ROWS, S_WHOLE_TILES, 1)
    elif pid < gather_tiles:
        _index_tile(_narrow(pid, G_INT64), b, a, inverse, b,
                    g_outer0, g_outer1, g_j_size, g_rows, g_inner1, g_cols, g_col_tiles, g_dim_size,
                    g_a_o0, g_a_o1, g_a_j, g_a_i0, g_a_i1, g_b_o0, g_b_o1, g_b_d, g_b_i0, g_b_i1,
                    g_idx_stride, g_divisor, G_BLOCK_R, G_BLOCK_C, False, G_INT64, 0, G_A_LINEAR, G_A_UNIT,
                    G_B_UNIT, G_ALIGNED, 2, G_ROWS, G_WHOLE_TILES, 1)


@triton.jit
def _index_tile(pid, a, b, idx, fallback, outer0, outer1, j_size, rows, inner1, cols, col_tiles, dim_size,
                a_o0, a_o1, a_j, a_i0, a_i1, b_o0, b_o1, b_d, b_i0, b_i1, idx_stride, divisor,
                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, SCATTER: tl.constexpr, INT64: tl.constexpr,
                INDEX_MODE: tl.constexpr, A_LINEAR: tl.constexpr, A_UNIT: tl.constexpr, B_UNIT: tl.constexpr,
                ALIGNED: tl.constexpr, FALLBACK: tl.constexpr, ROWS: tl.constexpr, WHOLE_TILES: tl.constexpr,
                SEARCH: tl.constexpr):
    """Tile ``pid`` of :func:`index_along_dim_kernel` (its arguments, documented there)."""
    # Not specialised for a grid of one column of tiles (``row_tile = pid``, no division): on the H200
    # that made the one-column inverse gathers slower ([4096, 4096] dim 1 fp16 sorted, at the
    # warps they take: in place 29.2 -> 37.7 µs, out of place 36.3 -> 42.3), for a division a program.
    col_tiles = _narrow(col_tiles, INT64)
    row_tile = pid // col_tiles
    r = row_tile * BLOCK_R + tl.arange(0, BLOCK_R)
    c_tile = pid - row_tile * col_tiles
    c = c_tile * BLOCK_C + tl.arange(0, BLOCK_C)
    cols = _narrow(cols, INT64)
    inner1 = _narrow(inner1, INT64)
    if WHOLE_TILES:
        row_ok = tl.full((BLOCK_R,), 1, tl.int1)  # every row lies inside the work
    else:
        row_ok = r < _narrow(rows, INT64)
    col_ok = c < cols
    o0, o1, j = _row_coordinates(row_tile * BLOCK_R, tl.arange(0, BLOCK_R), _narrow(j_size, INT64),
                                 _narrow(outer1, INT64), ROWS)
    if INDEX_MODE == 0:  # index tensor
        if WHOLE_TILES:
            target = tl.load(idx + j * _narrow(idx_stride, INT64))
        else:
            target = tl.load(idx + j * _narrow(idx_stride, INT64), mask=row_ok, other=-1)
    elif INDEX_MODE == 1:  # repeat by a host integer
        target = j // _narrow(divisor, INT64)
    elif INDEX_MODE == 2:  # repeat by a one-element tensor read on the device (no host sync)
        target = j // tl.maximum(tl.load(idx), 1)
    else:  # search: the last of the first ``divisor`` entries of ``idx`` equal to ``j``
        target = _search(idx, _narrow(idx_stride, INT64), _narrow(divisor, INT64), j, SEARCH)
    if target.dtype.primitive_bitwidth > 32:  # range-checked before narrowing: 2**32 + d must not become d
        valid = row_ok & (target.to(tl.uint64) < dim_size.to(tl.uint64))  # negative: huge, out of range
        target = _narrow(target, INT64)
    else:
        target = _narrow(target, INT64)
        valid = row_ok & (target >= 0) & (target < _narrow(dim_size, INT64))
    b_row = _hint(o0 * _narrow(b_o0, INT64) + o1 * _narrow(b_o1, INT64) + target * _narrow(b_d, INT64), ALIGNED)
    b_off = b_row[:, None] + _columns(c, inner1, _narrow(b_i0, INT64), _narrow(b_i1, INT64), B_UNIT)[None, :]
    # One column (BLOCK_C 1, index_select/index_copy along the last dimension): ``a``'s rows are
    # consecutive, but vectorising along them was slower on the H200 (index_select [4096, 4096]
    # dim 1 fp16 28.3 -> 33.5 µs, fp32 37.5 -> 41.7; index_copy_ fp16 122.2 -> 125.6): each thread then
    # loads 4-8 consecutive indices, and a warp's index loads span 4-8 times the sectors.
    if A_LINEAR:
        a_off = _hint(r * cols, ALIGNED)[:, None] + c[None, :]
    else:
        a_row = _hint(o0 * _narrow(a_o0, INT64) + o1 * _narrow(a_o1, INT64) + j * _narrow(a_j, INT64), ALIGNED)
        a_off = a_row[:, None] + _columns(c, inner1, _narrow(a_i0, INT64), _narrow(a_i1, INT64), A_UNIT)[None, :]
    # An interior tile: only the index masks its accesses, so the contiguous side vectorises (size
    # arguments are not specialised, so a mask built from them would split every access). With
    # WHOLE_TILES the edge branch is not compiled at all: its scalar accesses held registers that cost
    # occupancy: on the H200, fp16 index_select [4096, 4096] dim 0 takes 20 registers (8 blocks an SM)
    # and 14.56 µs with it, 40 (6) and 15.26 without; [64, 512, 512] dim 1: 32 (8) and 24.6 µs, 80 (3)
    # and 27.3 without.
    if WHOLE_TILES:
        _move(a + a_off, b + b_off, fallback + a_off, valid[:, None], row_ok[:, None], SCATTER, False, FALLBACK)
    elif ((row_tile + 1) * BLOCK_R <= rows) & ((c_tile + 1) * BLOCK_C <= cols):
        _move(a + a_off, b + b_off, fallback + a_off, valid[:, None], row_ok[:, None], SCATTER, False, FALLBACK)
    else:
        _move(a + a_off, b + b_off, fallback + a_off, valid[:, None] & col_ok[None, :],
              row_ok[:, None] & col_ok[None, :], SCATTER, True, FALLBACK)


@triton.jit
def _search(idx, idx_stride, n, j, LANES: tl.constexpr):
    """Per row, the largest ``k < n`` with ``idx[k] == j`` (-1 where none), ``LANES`` entries a step."""
    found = tl.full(j.shape, -1, j.dtype)
    for start in range(0, n, LANES):
        k = start + tl.arange(0, LANES)
        entries = tl.load(idx + k * idx_stride, mask=k < n, other=-1)
        hits = tl.where(entries[None, :] == j[:, None], k[None, :].to(j.dtype), -1)
        found = tl.maximum(found, tl.max(hits, 1))
    return found


@triton.jit
def _row_coordinates(first, lanes, j_size, outer1, ROWS: tl.constexpr):
    """``(o0, o1, j)`` of the rows ``r = first + lanes``, where ``r = (o0 * outer1 + o1) * j_size + j``.

    Dividing every row by the runtime sizes (``ROWS_DIVIDE``) costs ~20
    instructions a division: in a one-column tile, where each element is its
    own row, that is most of the kernel's work. The host picks the cheapest
    form its geometry allows:

    * ``ROWS_NO_OUTER`` (both outer sizes are 1): every row is its own ``j``.
    * ``ROWS_ONE_OUTER`` (``BLOCK_R`` divides ``j_size``): the tile lies in one
      ``(o0, o1)``, found by divisions of the scalar ``first``; ``j`` is
      consecutive.
    * ``ROWS_WRAP_ONCE`` (``BLOCK_R <= j_size``): the tile spans at most two
      ``(o0, o1)``; the divisions run on ``first`` and each row only compares.
    """
    if ROWS == 3:  # ROWS_NO_OUTER
        j = first + lanes
        o0 = 0
        o1 = 0
    elif ROWS == 2:  # ROWS_ONE_OUTER
        o = first // j_size
        o1 = o % outer1
        o0 = o // outer1
        j = (first - o * j_size) + lanes
    elif ROWS == 1:  # ROWS_WRAP_ONCE
        o = first // j_size
        o1 = o % outer1
        o0 = o // outer1
        j = first - o * j_size + lanes
        wrap = j >= j_size  # the next (o0, o1)
        j = tl.where(wrap, j - j_size, j)
        carry = o1 + 1 == outer1
        next1 = tl.where(carry, 0, o1 + 1)
        next0 = tl.where(carry, o0 + 1, o0)
        o1 = tl.where(wrap, next1, o1)
        o0 = tl.where(wrap, next0, o0)
    else:  # ROWS_DIVIDE
        r = first + lanes
        j = r % j_size
        o = r // j_size
        o1 = o % outer1
        o0 = o // outer1
    return o0, o1, j


@triton.jit
def _move(a_ptrs, b_ptrs, fallback_ptrs, valid, live, SCATTER: tl.constexpr, EDGE: tl.constexpr,
          FALLBACK: tl.constexpr):
    """Scatter ``a`` into ``b`` where ``valid``, or gather ``b`` into ``a`` (elsewhere: see ``FALLBACK``).

    ``live`` marks the tile's positions inside the work; only an edge tile has any outside.
    """
    if SCATTER:
        if EDGE:
            values = tl.load(a_ptrs, mask=live)
        else:
            values = tl.load(a_ptrs)
        tl.store(b_ptrs, values, mask=valid)
    else:
        values = tl.load(b_ptrs, mask=valid, other=0)
        if FALLBACK == 1:  # FALLBACK_TENSOR
            values = tl.where(valid, values, tl.load(fallback_ptrs, mask=live & (valid == 0)))
        if FALLBACK == 2:  # FALLBACK_KEEP
            tl.store(a_ptrs, values, mask=valid)
        elif EDGE:
            tl.store(a_ptrs, values, mask=live)
        else:
            tl.store(a_ptrs, values)


@dataclass(frozen=True)
class IndexPlan:
    """Collapsed geometry of one gather/scatter and its launch."""

    scalars: tuple[int, ...]
    grid: tuple[int]
    launcher: FastLauncher


_LAUNCHERS: dict[tuple, FastLauncher] = {}


def _launcher(num_warps: int, **constexprs: int | bool) -> FastLauncher:
    key = (num_warps, *sorted(constexprs.items()))
    launcher = _LAUNCHERS.get(key)
    if launcher is None:
        launcher = _LAUNCHERS[key] = FastLauncher(index_along_dim_kernel, constexprs, num_warps=num_warps)
    return launcher


def _tile(rows: int, cols: int, j_size: int, min_programs: int, element_size: int,
          policy: tuning.GatherScatterPolicy | None = None) -> tuple[int, int]:
    """``(BLOCK_R, BLOCK_C)``: ``policy.tile`` elements, shrunk while the grid has under ``min_programs`` tiles.

    Wide rows (``wide_row_bytes``) take ``wide_tile_bytes`` instead. Rows
    shrink to at most ``j_size`` when that keeps ``min_tile`` elements, so the
    kernel's tiles span at most two outer positions (``ROWS_WRAP_ONCE``).
    """
    policy = policy or _policy()
    block_c = min(next_pow2(max(cols, 1)), policy.max_cols)
    wide = block_c * element_size >= policy.wide_row_bytes
    block_r = max((policy.wide_tile_bytes // element_size if wide else policy.tile) // block_c, 1)
    if block_r > j_size >= 1:
        within = 1 << (j_size.bit_length() - 1)  # the largest power of two <= j_size
        if within * block_c >= policy.min_tile:
            block_r = within
    while (block_r * block_c > policy.min_tile
           and cdiv(rows, block_r) * cdiv(cols, block_c) < min_programs):
        if block_r > 1:
            block_r //= 2
        else:
            block_c //= 2
    return block_r, block_c


def _pad2(sizes: tuple[int, ...], strides: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, int], ...] | None:
    """Left-pad a collapsed group to two dimensions (size 1, stride 0); None when it has more."""
    if len(sizes) > 2:
        return None
    pad = 2 - len(sizes)
    return ((1,) * pad + sizes, *(((0,) * pad + s) for s in strides))


def plan_index(a: torch.Tensor, b: torch.Tensor, dim: int, index: torch.Tensor, scatter: bool,
               mode: int = INDEX_TENSOR, divisor: int = 1, fallback: int = FALLBACK_ZERO) -> IndexPlan | None:
    """Plan a gather/scatter of ``a`` (addressed by ``j``) and ``b`` (by ``index[j]``) along ``dim``.

    ``mode`` says how ``index[j]`` is found (:data:`INDEX_TENSOR` reads
    ``index``; the divide modes compute ``j // divisor`` or ``j // index[0]``,
    which is ``repeat_interleave`` by a constant; :data:`INDEX_SEARCH`, for a
    gather, searches the ``divisor`` entries of ``index`` for ``j``: a short
    scatter run as a gather over its destination, in one launch). ``fallback``:
    what a gather writes at invalid indices (``FALLBACK_*``; see
    :func:`index_along_dim`).

    Returns ``None`` when the layout needs more than two outer or two inner
    dimensions after collapsing (the caller then declines to native).
    """
    shape, a_st, b_st = a.shape, a.stride(), b.stride()
    # The written operand decides the order, so stores coalesce.
    first, second = (b_st, a_st) if scatter else (a_st, b_st)
    outer = collapse_dims(shape[:dim], first[:dim], second[:dim])
    inner = collapse_dims(shape[dim + 1:], first[dim + 1:], second[dim + 1:])
    outer_p, inner_p = _pad2(outer[0], outer[1]), _pad2(inner[0], inner[1])
    if outer_p is None or inner_p is None:
        return None
    (o_sizes, o_first, o_second), (i_sizes, i_first, i_second) = outer_p, inner_p
    o_a, o_b = (o_second, o_first) if scatter else (o_first, o_second)
    i_a, i_b = (i_second, i_first) if scatter else (i_first, i_second)
    j_size = shape[dim]
    rows = o_sizes[0] * o_sizes[1] * j_size
    cols = i_sizes[0] * i_sizes[1]
    # the CPU interpreter runs programs one after another: there, fewer is faster
    policy = _policy()
    block_r, block_c = _tile(rows, cols, j_size, 0 if a.device.type == "cpu" else policy.min_programs,
                             a.element_size(), policy)
    if mode == INDEX_SEARCH:  # each row compares with every index entry: one step of search_lanes a program
        block_r = min(block_r, max(policy.search_lanes // next_pow2(divisor), 1))
    col_tiles = cdiv(cols, block_c)
    tiles = cdiv(rows, block_r) * col_tiles
    a_unit, b_unit = _unit_inner(i_sizes, i_a), _unit_inner(i_sizes, i_b)
    a_linear = _row_major((*o_sizes, j_size, *i_sizes), (*o_a, a_st[dim], *i_a))
    row_strides = (*o_a, a_st[dim], *o_b, b_st[dim]) + ((cols,) if a_linear else ())
    aligned = all(st % 16 == 0 for st in row_strides) and (a_unit or a_linear) and b_unit
    constexprs = {"BLOCK_R": block_r, "BLOCK_C": block_c, "SCATTER": scatter, "INDEX_MODE": mode,
                  "INT64": _needs_int64(a, b, index, rows * cols, (block_r + 1) * max(cols, 1), b.shape[dim]),
                  "A_LINEAR": a_linear, "A_UNIT": a_unit, "B_UNIT": b_unit, "ALIGNED": aligned,
                  "FALLBACK": fallback, "ROWS": _rows_form(o_sizes, j_size, block_r),
                  "WHOLE_TILES": rows % block_r == 0 and cols % block_c == 0,
                  "SEARCH": min(next_pow2(divisor), max(policy.search_lanes // block_r, 1)) if mode == INDEX_SEARCH
                  else 1}
    scalars = (o_sizes[0], o_sizes[1], j_size, rows, i_sizes[1], cols, col_tiles, b.shape[dim],
               o_a[0], o_a[1], a_st[dim], i_a[0], i_a[1], o_b[0], o_b[1], b_st[dim], i_b[0], i_b[1],
               index.stride(0) if index.dim() else 0, max(divisor, 1))
    if mode == INDEX_SEARCH:  # a warp per elements_per_warp comparisons too (one warp was 2x slower)
        work, most = block_r * max(block_c, constexprs["SEARCH"]), policy.num_warps
    elif block_r <= policy.few_rows and block_c * a.element_size() >= policy.wide_row_bytes:
        work, most = block_r * block_c, policy.few_rows_warps
    else:
        work = block_r * block_c
        most = policy.merged_gather_warps if fallback == FALLBACK_TENSOR and block_c == 1 else policy.num_warps
    warps = max(min(most, work // policy.elements_per_warp), 1)
    return IndexPlan(scalars, (tiles,), _launcher(warps, **constexprs))


def _rows_form(outer: tuple[int, int], j_size: int, block_r: int) -> int:
    """The cheapest ``ROWS_*`` split of rows into ``(outer, j)`` that this geometry allows."""
    if outer[0] * outer[1] == 1:
        return ROWS_NO_OUTER
    if j_size and j_size % block_r == 0:
        return ROWS_ONE_OUTER
    return ROWS_WRAP_ONCE if block_r <= j_size else ROWS_DIVIDE


def _unit_inner(sizes: tuple[int, int], strides: tuple[int, int]) -> bool:
    """The two (padded) inner dimensions address consecutive elements."""
    return strides[1] == 1 and (sizes[0] == 1 or strides[0] == sizes[1])


def _row_major(sizes: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Every dimension of more than one element has the row-major stride of ``sizes``."""
    expected = 1
    for size, stride in zip(reversed(sizes), reversed(strides)):
        if size > 1 and stride != expected:
            return False
        expected *= size
    return True


def _needs_int64(a: torch.Tensor, b: torch.Tensor, index: torch.Tensor, work: int, pad: int,
                 dim_size: int = 0) -> bool:
    """Any index or offset (a masked tile's overhang of ``pad`` included) reaching 2**31.

    ``index`` counts too: a view with a large stride (a column of a big
    matrix) is read at ``j * stride``. So does ``dim_size``, ``b``'s size along
    the indexed dimension, which every index is compared with: an expanded
    (stride-0) view spans nothing yet may have 2**31 rows or more, and the
    size narrowed to int32 would declare every index out of range (zeros
    written). Past 2**30 already: a layout class's sizes share one power-of-two
    bucket, which then takes one choice.
    """
    limit = INT32_LIMIT - pad
    return (work >= limit or dim_size > INT32_LIMIT // 2
            or any(span(t.shape, t.stride()) >= limit for t in (a, b, index)))


#: Plans per geometry: planning costs ~10 µs of Python, a cached launch ~3 µs.
_PLANS: dict[tuple, IndexPlan | None] = context.cache()  # plans hold the policy's tiles


def index_along_dim(a: torch.Tensor, b: torch.Tensor, dim: int, index: torch.Tensor, scatter: bool,
                    mode: int = INDEX_TENSOR, divisor: int = 1, fallback: torch.Tensor | None = None) -> bool:
    """Run the gather/scatter; returns False (nothing done) when the layout is unsupported.

    ``fallback`` (gather only; ``a``'s shape and strides): where ``index[j]``
    is out of range, ``a`` takes ``fallback``'s element instead of zero. It may
    be ``a`` itself: the invalid positions are then not written at all.
    """
    invalid = FALLBACK_ZERO if fallback is None else FALLBACK_KEEP if fallback is a else FALLBACK_TENSOR
    key = (a.shape, a.stride(), b.stride(), b.shape[dim], dim, index.stride(), a.element_size(), scatter, mode,
           divisor, invalid)
    plan = _PLANS.get(key, _PLANS)
    if plan is _PLANS:
        plan = remember(_PLANS, key, plan_index(a, b, dim, index, scatter, mode, divisor, invalid))
    if plan is None:
        return False
    if plan.grid[0]:
        plan.launcher(plan.grid, a, b, index, a if fallback is None else fallback, *plan.scalars)
    return True


#: Constexprs each side of :func:`scatter_or_gather_kernel` takes from its plan (the rest are fixed).
_EITHER_CONSTEXPRS = ("BLOCK_R", "BLOCK_C", "INT64", "A_LINEAR", "A_UNIT", "B_UNIT", "ALIGNED", "ROWS",
                      "WHOLE_TILES")
_EITHER_LAUNCHERS: dict[tuple, FastLauncher] = {}
#: Per geometry: the two plans' launcher, grid and runtime scalars (None: a layout is unsupported).
_EITHER_PLANS: dict[tuple, tuple[FastLauncher, tuple[int], tuple[int, ...]] | None] = context.cache()


def _plan_either(dest: torch.Tensor, source: torch.Tensor, dim: int, index: torch.Tensor,
                 inverse: torch.Tensor) -> tuple[FastLauncher, tuple[int], tuple[int, ...]] | None:
    scatter = plan_index(source, dest, dim, index, True)
    gather = plan_index(dest, source, dim, inverse, False, fallback=FALLBACK_KEEP)
    if scatter is None or gather is None:
        return None
    warps = max(scatter.launcher.options["num_warps"], gather.launcher.options["num_warps"])
    constexprs = {**{"S_" + k: scatter.launcher.constexprs[k] for k in _EITHER_CONSTEXPRS},
                  **{"G_" + k: gather.launcher.constexprs[k] for k in _EITHER_CONSTEXPRS}}
    key = (warps, *constexprs.values())
    launcher = _EITHER_LAUNCHERS.get(key)
    if launcher is None:
        launcher = _EITHER_LAUNCHERS[key] = FastLauncher(scatter_or_gather_kernel, constexprs, num_warps=warps)
    grid = (max(scatter.grid[0], gather.grid[0]),)
    return launcher, grid, (scatter.grid[0], gather.grid[0], *scatter.scalars, *gather.scalars)


def scatter_or_gather(dest: torch.Tensor, source: torch.Tensor, dim: int, index: torch.Tensor,
                      inverse: torch.Tensor) -> bool:
    """In place ``dest[..., index[j], ...] = source[..., j, ...]`` in one launch, either form chosen on the device.

    ``inverse`` (int32, ``dest.shape[dim] + 1`` elements, written by an
    earlier launch): ``inverse[d]`` is the ``j`` with ``index[j] == d`` (``< 0``
    where none), and the last element is the order flag. A flag ``<= 0``
    says ``index`` never decreases: the plain scatter runs, writing in the
    index's order. Otherwise a gather over ``dest`` through ``inverse``
    writes the indexed positions in ``dest``'s order. No host
    synchronisation. Returns False (nothing done) when a layout is unsupported.
    """
    key = (dest.shape, dest.stride(), source.stride(), source.shape[dim], dim, index.stride(), dest.element_size())
    entry = _EITHER_PLANS.get(key, _EITHER_PLANS)
    if entry is _EITHER_PLANS:
        entry = remember(_EITHER_PLANS, key, _plan_either(dest, source, dim, index, inverse))
    if entry is None:
        return False
    launcher, grid, scalars = entry
    if grid[0]:
        launcher(grid, source, dest, index, inverse, *scalars)
    return True
