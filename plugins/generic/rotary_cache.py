"""``flaggems::rotary_cache_append``: q and k rotated and the cache appended to, in one launch.

The semantics (checks, output layouts) are :mod:`flaggems.fronts.rotary_cache`'s; this module is the kernel:
:func:`prepare` (a launch described from metadata) and :func:`launch`.

One kernel, ``_rotary_cache_kernel``, grid ``(blocks, 5)``: grid row 0 rotates
``q`` into ``q_rot`` and row 1 ``k`` into ``keys'`` from position ``L`` on (both
through :mod:`.rotary`'s row rotation, ``BLOCK_R`` rows of the head dimension a
program); rows 2, 3 and 4 copy ``keys`` and ``values`` into the first ``L``
positions of ``keys'``/``values'`` and ``v`` into ``values'`` from ``L`` on. Each
operand's rows are collapsed jointly with its destination's (at most three row
dimensions for rank 4) and addressed through their own strides, so transposed
views of one fused qkv projection are read in place. What the unfused sequence
(rotary, then two ``cat``) launches as three kernels, and transformers' cache
update runs as Python, is one launch moving the same bytes: ``|q| + |k|`` read
and written once, the cache read once and written once at its new length.

Grid rows cover the side with the most blocks (one expression of one size, so
a plan generic over sizes serves each new cache length); the other sides'
extra blocks are masked off whole. The destination offsets (``L`` positions)
and every stride are 64-bit runtime arguments; ``INT64`` where an operand's
reach passes 2**31.
"""

# ruff: noqa: N803, N806 - constexpr parameters and the head dimension are UPPER_CASE, as in every Triton kernel
from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from flaggems.fronts import rotary_cache as front
from flaggems.toolkit import FastLauncher, cdiv, next_pow2, tuning

from .rotary import INT32_LIMIT, ROW_DIMS, _block_rows, _reach, _rotate_rows, _row_offsets, _rows, _tile

_ROTATE = ("rows", "n1", "n2", "xs0", "xs1", "xs2", "xsd", "as0", "as1", "as2", "asd", "os0", "os1", "os2", "osd",
           "off")
_COPY = ("rows", "n1", "n2", "xs0", "xs1", "xs2", "xsd", "os0", "os1", "os2", "osd", "off")
_NO_SPECIALIZE = tuple(f"{a}_{s}" for s in "qk" for a in _ROTATE) + tuple(
    f"{a}_{s}" for s in ("keys", "values", "v") for a in _COPY)


@triton.jit
def _copy_rows(x, o, block, rows, n1, n2, xs0, xs1, xs2, xsd, os0, os1, os2, osd, BLOCK_R: tl.constexpr,
               D: tl.constexpr, D_P2: tl.constexpr, UNIT: tl.constexpr, ALIGNED: tl.constexpr,
               INT64: tl.constexpr):
    """Copy rows ``[block * BLOCK_R, +BLOCK_R)`` of ``x`` (``D`` columns each) to the same rows of ``o``."""
    i0, i1, i2, rmask = _block_rows(block, rows, n1, n2, BLOCK_R, INT64)
    col = tl.arange(0, D_P2)
    if D == D_P2:
        mask = tl.broadcast_to(rmask[:, None], (BLOCK_R, D_P2))  # constant along a row: loads vectorise
    else:
        mask = rmask[:, None] & (col < D)[None, :]
    xrow = _row_offsets(i0, i1, i2, xs0, xs1, xs2, ALIGNED, INT64)
    orow = _row_offsets(i0, i1, i2, os0, os1, os2, ALIGNED, INT64)
    row = tl.load(x + _tile(xrow, col, xsd, UNIT, INT64), mask=mask)
    tl.store(o + _tile(orow, col, osd, UNIT, INT64), row, mask=mask)


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _rotary_cache_kernel(q, q_out, k, keys, values, v, keys_out, values_out, cos, sin,
                         rows_q: tl.int64, n1_q: tl.int64, n2_q: tl.int64, xs0_q: tl.int64, xs1_q: tl.int64,
                         xs2_q: tl.int64, xsd_q: tl.int64, as0_q: tl.int64, as1_q: tl.int64, as2_q: tl.int64,
                         asd_q: tl.int64, os0_q: tl.int64, os1_q: tl.int64, os2_q: tl.int64, osd_q: tl.int64,
                         off_q: tl.int64,
                         rows_k: tl.int64, n1_k: tl.int64, n2_k: tl.int64, xs0_k: tl.int64, xs1_k: tl.int64,
                         xs2_k: tl.int64, xsd_k: tl.int64, as0_k: tl.int64, as1_k: tl.int64, as2_k: tl.int64,
                         asd_k: tl.int64, os0_k: tl.int64, os1_k: tl.int64, os2_k: tl.int64, osd_k: tl.int64,
                         off_k: tl.int64,
                         rows_keys: tl.int64, n1_keys: tl.int64, n2_keys: tl.int64, xs0_keys: tl.int64,
                         xs1_keys: tl.int64, xs2_keys: tl.int64, xsd_keys: tl.int64, os0_keys: tl.int64,
                         os1_keys: tl.int64, os2_keys: tl.int64, osd_keys: tl.int64, off_keys: tl.int64,
                         rows_values: tl.int64, n1_values: tl.int64, n2_values: tl.int64, xs0_values: tl.int64,
                         xs1_values: tl.int64, xs2_values: tl.int64, xsd_values: tl.int64, os0_values: tl.int64,
                         os1_values: tl.int64, os2_values: tl.int64, osd_values: tl.int64, off_values: tl.int64,
                         rows_v: tl.int64, n1_v: tl.int64, n2_v: tl.int64, xs0_v: tl.int64, xs1_v: tl.int64,
                         xs2_v: tl.int64, xsd_v: tl.int64, os0_v: tl.int64, os1_v: tl.int64, os2_v: tl.int64,
                         osd_v: tl.int64, off_v: tl.int64,
                         BLOCK_R: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr, UNIT: tl.constexpr,
                         ALIGNED: tl.constexpr, INT64: tl.constexpr):
    """Program ``(b, side)``: block ``b`` of side 0 (``q``), 1 (``k``), 2 (``keys``), 3 (``values``), 4 (``v``)."""
    pid = tl.program_id(0)
    side = tl.program_id(1)
    if side == 0:
        _rotate_rows(q, q_out + off_q, cos, sin, pid, rows_q, n1_q, n2_q, xs0_q, xs1_q, xs2_q, xsd_q, as0_q, as1_q,
                     as2_q, asd_q, os0_q, os1_q, os2_q, osd_q, BLOCK_R, HALF, HALF_P2, False, False, UNIT, ALIGNED,
                     INT64)
    elif side == 1:
        _rotate_rows(k, keys_out + off_k, cos, sin, pid, rows_k, n1_k, n2_k, xs0_k, xs1_k, xs2_k, xsd_k, as0_k,
                     as1_k, as2_k, asd_k, os0_k, os1_k, os2_k, osd_k, BLOCK_R, HALF, HALF_P2, False, False, UNIT,
                     ALIGNED, INT64)
    elif side == 2:
        _copy_rows(keys, keys_out + off_keys, pid, rows_keys, n1_keys, n2_keys, xs0_keys, xs1_keys, xs2_keys,
                   xsd_keys, os0_keys, os1_keys, os2_keys, osd_keys, BLOCK_R, 2 * HALF, 2 * HALF_P2, UNIT, ALIGNED,
                   INT64)
    elif side == 3:
        _copy_rows(values, values_out + off_values, pid, rows_values, n1_values, n2_values, xs0_values,
                   xs1_values, xs2_values, xsd_values, os0_values, os1_values, os2_values, osd_values, BLOCK_R,
                   2 * HALF, 2 * HALF_P2, UNIT, ALIGNED, INT64)
    else:
        _copy_rows(v, values_out + off_v, pid, rows_v, n1_v, n2_v, xs0_v, xs1_v, xs2_v, xsd_v, os0_v, os1_v,
                   os2_v, osd_v, BLOCK_R, 2 * HALF, 2 * HALF_P2, UNIT, ALIGNED, INT64)


@functools.cache
def _launcher(num_warps: int, **constexprs: Any) -> FastLauncher:
    return FastLauncher(_rotary_cache_kernel, constexprs, num_warps=num_warps)


def prepare(plan: front.Plan) -> tuple:
    """``(launcher, grid, scalars)`` of the one launch serving ``plan`` (from metadata only)."""
    D = plan.q.shape[-1]
    half = D // 2
    half_p2 = next_pow2(half)
    policy = tuning.policy("rotary_embedding")  # the rotation's tile: typed, checked at enable()
    tile, num_warps = policy.tile, policy.num_warps
    sides = (plan.q, plan.k, *plan.copies)
    described = [_rows(side) for side in sides]
    most_rows = max(rows for rows, _, _ in described)
    block_r = max(1, min(tile // (2 * half_p2), next_pow2(most_rows)))
    strides = [s for _, _, triples in described for s in triples]
    unit = all(s[-1] == 1 for s in strides)
    aligned = all(x % 16 == 0 for s in strides for x in s[:ROW_DIMS])
    position = plan.cache_shape[-1]  # keys'/values' are contiguous: one position is D elements
    offsets = (0, plan.offset * position, 0, 0, plan.offset * position)
    reach = max(_reach((rows // (n1 * n2), n1, n2), s, D) for rows, (n1, n2), triples in described for s in triples)
    cache_numel = 1
    for n in plan.cache_shape:
        cache_numel *= n
    int64 = any(rows + block_r >= INT32_LIMIT for rows, _, _ in described) or max(reach, cache_numel) >= INT32_LIMIT
    launcher = _launcher(num_warps, BLOCK_R=block_r, HALF=half, HALF_P2=half_p2, UNIT=unit, ALIGNED=aligned,
                         INT64=int64)
    scalars: list[int] = []
    for i, ((rows, (n1, n2), (xs, angles, outs)), off) in enumerate(zip(described, offsets, strict=True)):
        scalars += [rows, n1, n2, *xs, *(angles if i < 2 else ()), *outs, off]
    grid = (max(cdiv(rows, block_r) for rows, _, _ in described), len(sides))
    return launcher, grid, tuple(scalars)


def launch(prepared: tuple, tensors: tuple[torch.Tensor, ...], outs: tuple[torch.Tensor, ...]) -> None:
    """Rotate and append as :func:`prepare` described: ``tensors`` ``(q, k, v, cos, sin, keys, values)``,
    ``outs`` ``(q_rot, keys', values')``."""
    launcher, grid, scalars = prepared
    q, k, v, cos, sin, keys, values = tensors
    q_rot, keys_out, values_out = outs
    launcher(grid, q, q_rot, k, keys, values, v, keys_out, values_out, cos, sin, *scalars)


#: The implementation of the ``OpImpl`` line (its checks and layouts are the front's).
rotary_cache_append = front.entry(prepare, launch, front.DTYPES)
