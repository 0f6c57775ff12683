"""``aten::native_group_norm`` and ``aten::native_group_norm_backward``.

Every tensor is viewed as ``[N, C, S]`` (``S = HxW``) through its real strides:
contiguous, ``channels_last``/``channels_last_3d``, sliced and expanded inputs
are read in place (spatial dimensions are collapsed jointly for all operands;
two spatial dimensions that do not merge are unravelled in the kernel, more
than two are copied first). Any ``C % groups == 0`` works: a group is a range
of channels, never a power-of-two tile.

Forward, three steps, all deterministic (fixed reduction order, no atomics):

1. ``_stats_kernel``, grid ``N x channel blocks x K spatial chunks``: per
   channel and chunk, mean (as ``hi + lo``) and M2 in fp32 (fp64 for fp64
   inputs) over ``[BLOCK_C, BLOCK_S]`` tiles: each lane sums ``x - p`` and
   ``(x - p)**2`` about its first value ``p``, lanes merged once at the end
   (Chan's formula). Everything is scaled by ``2**-s``, ``s`` the exponent of
   the group's first element, so fp32 values ~1e20 do not square to inf.
   ``K`` is chosen so that the grid fills the device however few groups
   there are (a group of 262144 elements is split over several programs).
2. ``_finalize_kernel``, a few groups per program: the ``D x K`` partials of a group
   (``D = C / G``) merged in a fixed order (Chan's formula) into mean and
   ``rstd``, written in torch's dtype and kept in fp32 for step 3 (the mean
   as ``hi + lo``).
3. ``_normalize_kernel``, grid ``N x channel blocks x spatial blocks``:
   ``y = ((x - mean_hi) - mean_lo) * a + bias`` with ``a = rstd * w`` per
   channel. On fp32 ``1e4 + randn`` its error against float64 is 4e-7
   (``x * a + (bias - mean * a)``: 1.6e-3, torch's CPU kernel 1.4e-3); on
   fp32 ``randn * 1e20`` the output is finite and as accurate (torch's CPU
   kernel returns NaN there).

Backward, three steps: ``_bwd_reduce_kernel`` (per channel and chunk,
``sum(dy * (x - mean))`` and ``sum(dy)``), ``_bwd_finalize_kernel`` (the first
programs merge groups into the coefficients of ``dx = r*w*dy + q*x + o``;
the others sum ``dweight``/``dbias`` over ``N`` in order), ``_bwd_dx_kernel``.
``output_mask`` drops the work of every output not asked for.

Step 2 folds into step 3 where a tile's groups merge from few partials
(the policy's ``fuse_limit``; every contiguous input): each normalize or dx tile merges
its own groups (the same fixed order, so the same bits in every tile) and
the dx launch's extra programs sum ``dweight``/``dbias``. Two launches each
way instead of three: forward+backward fp32 on 2x320x64x64, being
host-bound, runs at 0.87x of torch's speed that way against 0.64x with three (H200).

torch's semantics are :mod:`flaggems.fronts.group_norm`'s (checks, dtypes,
output layouts and allocation): ``y`` in the input's suggested memory format;
``dx`` in it on CPU and contiguous elsewhere (as torch); mean/rstd ``[N, G]``
in the input dtype, or fp32 when a half input comes with fp32 affine
parameters (mixed, accepted where torch accepts it: on CPU). Shape errors
torch's ``check_group_norm_inputs`` reports are raised with its messages;
every other invalid call declines, so torch raises its own error. The front's
checks run when a plan is built (they read only what the plan's key holds);
per call only its allocations run.
A strided weight (``randn(3C)[::3]``) is read through its strides: the backward
equals an independent float64 composite to 1e-12, where torch's CUDA kernel
differs by ~1e-4 (it reads the weight as dense; tests/test_generic_group_norm.py).

``flaggems::group_norm_silu`` (:mod:`.group_norm_silu`) runs these kernels
with their ``SILU`` flag (:func:`group_norm_silu_forward`,
:func:`group_norm_silu_backward`): the normalize kernel applies SiLU before its
one rounding (and, when a gradient is needed, copies each channel's weight and
bias into the fp32 statistics it keeps: ``SAVE_AFFINE``); the backward kernels
read ``dy * silu'(z)`` wherever they read ``dy``, recomputing ``z`` from ``x``
and those statistics. Without the flag nothing of it is compiled in.
"""

# ruff: noqa: N803 - constexpr parameters are UPPER_CASE, as in every Triton kernel
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from flaggems.fronts import group_norm as front
from flaggems.fronts.group_norm import HALF_DTYPES as HALF_DTYPES  # re-exported (defined here before the front)
from flaggems.fronts.group_norm import check_group_norm_inputs as check_group_norm_inputs  # re-exported
from flaggems.fronts.group_norm import suggest_memory_format
from flaggems.toolkit import FastLauncher, cdiv, collapse_dims, context, next_pow2, tuning
from flaggems.toolkit.jit_helpers import hint16 as _hint16
from flaggems.toolkit.jit_helpers import index_type as _index
from flaggems.toolkit.layout import remember

from .glu import _activation, _activation_grad  # SiLU and its derivative (the glu kernels' ``ACT == 0``)

FLOAT_DTYPES = front.DTYPES  # re-exported, as HALF_DTYPES

# Tiles and grid (tile, num_warps, finalize_tile, param_tile, param_min_channels, max_chunks, fuse_limit,
# programs_per_sm) are the typed launch policy ``flaggems.toolkit.tuning.GroupNormPolicy`` (tuning key
# "group_norm"), read when a plan is built. ``fuse_limit``: step 2 is folded into step 3 (one launch less
# each way) when a tile's merge reads at most that many partials (``BLOCK_C x next_pow2(D * K)``): always
# for contiguous input, whose tiles hold one or a few channels; not for channels_last tiles, which span
# every group (each would re-merge them all).
#: Grid target where the device facts give no multiprocessor count (interpreter: small grids, split
#: paths still used).
DEFAULT_TARGET = {"cpu": 4}
INT32_LIMIT = 2**31
#: Unit-stride codes of an operand: no unit stride, spatial (contiguous-like), channel (channels_last-like).
GENERAL, SPATIAL_UNIT, CHANNEL_UNIT = 0, 1, 2

_SHAPE_ARGS = ("C", "S", "S0", "D", "G", "N", "K", "groups", "cblocks", "sblocks", "chunk_tiles", "chunk", "num_coef")
_STRIDE_ARGS = tuple(f"{t}_{s}" for t in ("x", "y", "dy", "dx") for s in ("sn", "sc", "s0", "s1"))
_OFFSET_ARGS = ("m2_at", "stat_at", "b_at", "q_at")
_NO_SPECIALIZE = _SHAPE_ARGS + _STRIDE_ARGS + _OFFSET_ARGS


# --------------------------------------------------------------------------- kernels
@triton.jit
def _acc(v, F64: tl.constexpr):
    """``v`` in the accumulation type: fp64 for fp64 tensors, fp32 otherwise."""
    return v.to(tl.float64 if F64 else tl.float32)


@triton.jit
def _tile_offsets(c, s, sc, s0, s1, S0, UNIT: tl.constexpr, SPATIAL2: tl.constexpr, ALIGNED: tl.constexpr):
    """``[BLOCK_C, BLOCK_S]`` element offsets of channels ``c`` and spatial indices ``s``.

    ``SPATIAL2``: two spatial dimensions (inner size ``S0``, strides ``s0``
    inner, ``s1`` outer); ``UNIT`` skips the multiply of a unit stride so the
    compiler sees contiguity.
    """
    if UNIT == 2:
        coff = c
    else:
        coff = c * _hint16(sc, ALIGNED)
    if SPATIAL2:
        soff = (s // S0) * _hint16(s1, ALIGNED) + (s % S0) * _hint16(s0, ALIGNED)
    elif UNIT == 1:
        soff = s
    else:
        soff = s * _hint16(s0, ALIGNED)
    return coff[:, None] + soff[None, :]


@triton.jit
def _offsets(n, c, s, sn, sc, s0, s1, S0, UNIT: tl.constexpr, SPATIAL2: tl.constexpr, ALIGNED: tl.constexpr,
             INT64: tl.constexpr):
    """Offsets of the ``[BLOCK_C, BLOCK_S]`` tile of sample ``n`` in an operand with strides ``sn, sc, s0, s1``."""
    tile = _tile_offsets(c, s, _index(sc, INT64), _index(s0, INT64), _index(s1, INT64), S0, UNIT, SPATIAL2, ALIGNED)
    return n * _hint16(_index(sn, INT64), ALIGNED) + tile


@triton.jit
def _split3(pid, inner, middle):
    """``pid`` as ``(outer, middle index, inner index)`` for a grid flattened inner-first."""
    return pid // inner // middle, pid // inner % middle, pid % inner


@triton.jit
def _elementwise_tile(pid, C, S, D, G, cblocks, sblocks, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
                      ALIGNED: tl.constexpr, INT64: tl.constexpr):
    """Tile ``pid`` of a grid flattened as ``(n, channel block, spatial block)``.

    Returns sample ``n``, channels ``c`` and their mask, the spatial block
    ``sb``, spatial indices ``s``, the ``[BLOCK_C, BLOCK_S]`` mask and each
    channel's group ``n * G + c // D``.
    """
    n, cb, sb = _split3(pid, _index(sblocks, INT64), _index(cblocks, INT64))
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < _hint16(_index(C, INT64), ALIGNED)
    s = sb * BLOCK_S + tl.arange(0, BLOCK_S)
    mask = cmask[:, None] & (s < _hint16(_index(S, INT64), ALIGNED))[None, :]
    return n, c, cmask, sb, s, mask, n * _index(G, INT64) + c // _index(D, INT64)


@triton.jit
def _group_first(x, n, c, cmask, sn, sc, D, F64: tl.constexpr):
    """Per channel ``c``: its group's first element ``x[n, c // D * D, 0]``, which sets the group's scale.

    Every program of a group loads the same element (a cached gather of
    ``BLOCK_C`` addresses), so all of them scale by the same power of two.
    """
    return _acc(tl.load(x + n * sn + c // D * D * sc, mask=cmask, other=0.0), F64)


@triton.jit
def _pow2_scale(first, F64: tl.constexpr):
    """``(2**-s, 2**s)``, ``s`` the binary exponent of ``|first|`` clamped to ``[0, emax - 1]``.

    Scaled by ``2**-s`` (exact: a power of two) a value of ``first``'s size
    lies in ``[1, 2)``, so the squares of the group's deviations stay finite
    (fp32 ``randn * 1e20`` squares to ~1e40, past fp32's 3.4e38) unless the
    others exceed ``max(|first|, 1)`` by ~2**64 / sqrt(group size). Never
    scaled up (``s >= 0``): a zero or tiny first element says nothing of the
    others (a group of fp32 values ~1e20 after a 0 still overflows: its
    ``rstd`` is 0 and ``y = bias``, never NaN).
    """
    if F64:
        e = ((first.to(tl.int64, bitcast=True) >> 52) & 0x7FF) - 1023
        s = tl.minimum(tl.maximum(e, 0), 1022)
        down = ((1023 - s) << 52).to(tl.float64, bitcast=True)
        up = ((1023 + s) << 52).to(tl.float64, bitcast=True)
    else:
        e = ((first.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        s = tl.minimum(tl.maximum(e, 0), 126)
        down = ((127 - s) << 23).to(tl.float32, bitcast=True)
        up = ((127 + s) << 23).to(tl.float32, bitcast=True)
    return down, up


@triton.jit
def _two_sum(a, b):
    """``(hi, lo)``: ``hi = fl(a + b)`` and its exact rounding error (Knuth's TwoSum; no branch on magnitudes)."""
    hi = a + b
    b_part = hi - a
    lo = (a - (hi - b_part)) + (b - b_part)
    return hi, lo


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _stats_kernel(x, ws, C: tl.int64, S: tl.int64, S0: tl.int64,
                  x_sn: tl.int64, x_sc: tl.int64, x_s0: tl.int64, x_s1: tl.int64,
                  cblocks: tl.int64, K: tl.int64, chunk_tiles: tl.int64, m2_at: tl.int64, D: tl.int64,
                  BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, X_UNIT: tl.constexpr,
                  SPATIAL2: tl.constexpr, ALIGNED: tl.constexpr, INT64: tl.constexpr,
                  F64: tl.constexpr):
    """Per channel of one chunk of ``S``: its mean as ``hi + lo`` and its M2, all scaled by the group's ``2**-s``.

    ``ws[at]``, ``ws[2 * m2_at + at]``: ``hi``, ``lo``; ``ws[m2_at + at]``: M2.
    Each lane of the ``[BLOCK_C, BLOCK_S]`` tile sums ``u = (x - p) * 2**-s``
    and ``u*u`` about its own first value ``p`` (the chunk's first tile): its
    ``M2 = sum(u*u) - sum(u)**2 / n`` cancels at most a factor ``n`` (the
    lane's tile count, as ``(p - mean)**2 <= M2``) whatever the data's offset,
    and no element costs a division (Welford's ``delta / count`` did). The
    lanes merge once at the end about ``hi``, their rounded mean: ``p - hi`` is
    exact for close values, so ``lo`` keeps the low bits of ``1e4 + randn``.
    """
    n, cb, k = _split3(_index(tl.program_id(0), INT64), _index(K, INT64), _index(cblocks, INT64))
    C, S, S0 = _hint16(_index(C, INT64), ALIGNED), _hint16(_index(S, INT64), ALIGNED), _index(S0, INT64)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    down, _ = _pow2_scale(_group_first(x, n, c, cmask, _index(x_sn, INT64), _index(x_sc, INT64),
                                       _index(D, INT64), F64), F64)
    s_begin = k * _index(chunk_tiles, INT64) * BLOCK_S
    s = s_begin + tl.arange(0, BLOCK_S)
    smask = s < S
    offs = _offsets(n, c, s, x_sn, x_sc, x_s0, x_s1, S0, X_UNIT, SPATIAL2, ALIGNED, INT64)
    lane = _acc(tl.load(x + offs, mask=cmask[:, None] & smask[None, :], other=0.0), F64) * down[:, None]
    count = _acc(smask.to(tl.float32), F64)
    s1 = _acc(tl.zeros([BLOCK_C, BLOCK_S], tl.float32), F64)
    s2 = s1
    for t in range(1, _index(chunk_tiles, INT64)):
        s = s_begin + t * BLOCK_S + tl.arange(0, BLOCK_S)
        smask = s < S
        offs = _offsets(n, c, s, x_sn, x_sc, x_s0, x_s1, S0, X_UNIT, SPATIAL2, ALIGNED, INT64)
        v = _acc(tl.load(x + offs, mask=cmask[:, None] & smask[None, :], other=0.0), F64)
        u = tl.where(smask[None, :], v * down[:, None] - lane, 0.0)
        s1 += u
        s2 += u * u
        count += smask.to(count.dtype)
    lane_mean = s1 * (1.0 / tl.maximum(count, 1.0))[None, :]  # relative to the lane's first value
    # An overflowed lane (the scale's element far below the data) stays +inf, not inf - inf = NaN.
    lane_m2 = tl.where(s2 < float("inf"), tl.maximum(s2 - s1 * lane_mean, 0.0), s2)
    weight = count[None, :]
    total = tl.maximum(tl.sum(count, axis=0), 1.0)
    hi = tl.sum((lane + lane_mean) * weight, axis=1) / total
    rel = (lane - hi[:, None]) + lane_mean
    lo = tl.sum(rel * weight, axis=1) / total
    m2 = tl.sum(tl.where(weight > 0, lane_m2 + rel * rel * weight, 0.0), axis=1) - lo * lo * total
    at = (n * C + c) * _index(K, INT64) + k
    m2_at = _index(m2_at, INT64)
    tl.store(ws + at, hi, mask=cmask)
    tl.store(ws + m2_at + at, m2, mask=cmask)
    tl.store(ws + 2 * m2_at + at, lo, mask=cmask)


@triton.jit
def _chunk_count(j, K, S, chunk):
    """Elements behind partial ``j`` (chunk ``j % K`` of a channel's ``S``)."""
    return tl.minimum(S - (j % K) * chunk, chunk)


@triton.jit
def _merge_stats(ws, gid, gmask, first, C, S, D, G, K, chunk, m2_at, eps, ROWS: tl.constexpr,
                 BLOCK_J: tl.constexpr, F64: tl.constexpr):
    """``(mean_hi, mean_lo, rstd)`` of the groups ``gid`` (one per row; a group may repeat) from their partials.

    ``first``: each group's first element (its scale). In a fixed order (every
    program merging a group gets the same bits): ``ref``, the partials' mean
    of ``hi``, then ``d = sum(n_p * ((hi_p - ref) + lo_p)) / N`` (exact
    differences for close ``hi_p``) and ``M2 = sum(M2_p + n_p * (hi_p - ref +
    lo_p)**2) - N * d**2`` (``d`` is ``ref``'s rounding: nothing cancels).
    The mean is ``ref + d`` kept as ``hi + lo`` (TwoSum): the normalize
    subtracts both, so ``y`` does not carry the mean's rounding to fp32
    (``0.5 ulp(1e4) = 4.9e-4`` on ``1e4 + randn``). A variance past the
    dtype's range unscaled (fp32 ``randn * 1e20``: ~1e40; ``eps`` no longer
    counts there) gives ``rstd = 2**-s / sqrt(var * 2**-2s)``.
    """
    base = (gid // G * C + gid % G * D) * K
    parts = D * K
    acc = _acc(tl.zeros([ROWS, BLOCK_J], tl.float32), F64)
    for j0 in range(0, parts, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        valid = gmask[:, None] & (j < parts)[None, :]
        hi = tl.load(ws + base[:, None] + j[None, :], mask=valid, other=0.0)
        acc += hi * _acc(_chunk_count(j, K, S, chunk), F64)[None, :]
    elements = _acc(D * S, F64)
    ref = tl.sum(acc, axis=1) / elements
    acc = acc * 0
    spread = acc
    for j0 in range(0, parts, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        valid = gmask[:, None] & (j < parts)[None, :]
        at = base[:, None] + j[None, :]
        n_p = tl.where(valid, _acc(_chunk_count(j, K, S, chunk), F64)[None, :], 0.0)
        hi = tl.load(ws + at, mask=valid, other=0.0)
        delta = (hi - ref[:, None]) + tl.load(ws + 2 * m2_at + at, mask=valid, other=0.0)
        acc += delta * n_p
        spread += tl.load(ws + m2_at + at, mask=valid, other=0.0) + delta * delta * n_p
    d = tl.sum(acc, axis=1) / elements
    scaled_var = tl.maximum(tl.sum(spread, axis=1) / elements - d * d, 0.0)
    down, up = _pow2_scale(first, F64)
    mean_hi, mean_lo = _two_sum(ref * up, d * up)
    var = scaled_var * up * up
    finite = var < float("inf")
    # ``zeros_like(var) + eps``: a tensor both compiled (fp64 scalar) and interpreted (Python float).
    root = tl.where(finite, var + (tl.zeros_like(var) + eps).to(var.dtype), scaled_var)
    if F64:
        root = tl.sqrt(root)  # IEEE for fp64
    else:
        root = tl.sqrt_rn(root)
    return mean_hi, mean_lo, tl.where(finite, 1.0, down) / root


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _finalize_kernel(x, ws, mean_out, rstd_out, C: tl.int64, S: tl.int64, D: tl.int64, G: tl.int64,
                     K: tl.int64, chunk: tl.int64, m2_at: tl.int64, stat_at: tl.int64, groups: tl.int64,
                     x_sn: tl.int64, x_sc: tl.int64, eps: tl.float64, BLOCK_G: tl.constexpr, BLOCK_J: tl.constexpr,
                     INT64: tl.constexpr, F64: tl.constexpr):
    """Merge the ``D x K`` partials of ``BLOCK_G`` groups into mean and rstd (Chan, fixed order).

    ``ws[stat_at:]`` gets ``mean_hi``, ``rstd`` and ``mean_lo`` of every group.
    """
    NG = _index(groups, INT64)
    gid = _index(tl.program_id(0), INT64) * BLOCK_G + tl.arange(0, BLOCK_G)
    gmask = gid < NG
    Di, Gi = _index(D, INT64), _index(G, INT64)
    first = _group_first(x, gid // Gi, gid % Gi * Di, gmask, _index(x_sn, INT64), _index(x_sc, INT64), Di, F64)
    mean, lo, rstd = _merge_stats(ws, gid, gmask, first, _index(C, INT64), _index(S, INT64), Di, Gi,
                                  _index(K, INT64), _index(chunk, INT64), _index(m2_at, INT64), eps, BLOCK_G,
                                  BLOCK_J, F64)
    tl.store(mean_out + gid, mean.to(mean_out.dtype.element_ty), mask=gmask)
    tl.store(rstd_out + gid, rstd.to(rstd_out.dtype.element_ty), mask=gmask)
    at = ws + _index(stat_at, INT64) + gid
    tl.store(at, mean, mask=gmask)
    tl.store(at + NG, rstd, mask=gmask)
    tl.store(at + 2 * NG, lo, mask=gmask)


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _normalize_kernel(x, y, w, b, ws, mean_out, rstd_out, C: tl.int64, S: tl.int64, S0: tl.int64, D: tl.int64,
                      G: tl.int64, x_sn: tl.int64, x_sc: tl.int64, x_s0: tl.int64, x_s1: tl.int64,
                      y_sn: tl.int64, y_sc: tl.int64, y_s0: tl.int64, y_s1: tl.int64,
                      cblocks: tl.int64, sblocks: tl.int64, K: tl.int64, chunk: tl.int64, m2_at: tl.int64,
                      stat_at: tl.int64, groups: tl.int64, eps: tl.float64,
                      BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_J: tl.constexpr, X_UNIT: tl.constexpr,
                      Y_UNIT: tl.constexpr, SPATIAL2: tl.constexpr, ALIGNED: tl.constexpr, HAS_W: tl.constexpr,
                      HAS_B: tl.constexpr, FUSED: tl.constexpr, INT64: tl.constexpr, F64: tl.constexpr,
                      SILU: tl.constexpr = False, SAVE_AFFINE: tl.constexpr = False):
    """``y = ((x - mean_hi) - mean_lo) * (rstd * w) + b`` on one ``[BLOCK_C, BLOCK_S]`` tile; ``silu(y)`` with ``SILU``.

    ``x - mean_hi`` is exact for ``x`` near the mean (Sterbenz), so an offset
    costs no accuracy, where ``x * a + (b - mean * a)`` rounds two terms of
    the offset's size (fp32 ``1e4 + randn`` against float64: 1.6e-3 that way,
    4e-7 this way). ``FUSED``: the tile's groups are merged here from the partials (step 2
    folded in; the first spatial block of a group's first channel writes
    ``mean_out``/``rstd_out``); otherwise they are read from ``ws``.
    ``SAVE_AFFINE`` (``group_norm_silu`` when a gradient is needed): the first
    spatial block of sample 0 also writes each channel's weight and bias, in
    fp32 (1 and 0 when absent), after the ``groups`` rstd values of ``rstd_out``,
    for the backward's recomputation of the SiLU's input (:func:`_silu_affine`).
    """
    n, c, cmask, sb, s, mask, group = _elementwise_tile(_index(tl.program_id(0), INT64), C, S, D, G, cblocks,
                                                        sblocks, BLOCK_C, BLOCK_S, ALIGNED, INT64)
    S0 = _index(S0, INT64)
    if FUSED:
        Di = _index(D, INT64)
        first = _group_first(x, n, c, cmask, _index(x_sn, INT64), _index(x_sc, INT64), Di, F64)
        mean, lo, scale = _merge_stats(ws, group, cmask, first, _index(C, INT64), _index(S, INT64), Di,
                                       _index(G, INT64), _index(K, INT64), _index(chunk, INT64),
                                       _index(m2_at, INT64), eps, BLOCK_C, BLOCK_J, F64)
        writer = cmask & (c % Di == 0) & (c * 0 + sb == 0)  # a vector: the interpreter rejects a scalar in a mask
        tl.store(mean_out + group, mean.to(mean_out.dtype.element_ty), mask=writer)
        tl.store(rstd_out + group, scale.to(rstd_out.dtype.element_ty), mask=writer)
    else:
        at = group + _index(stat_at, INT64)
        NG = _index(groups, INT64)
        mean = tl.load(ws + at, mask=cmask, other=0.0)
        scale = tl.load(ws + NG + at, mask=cmask, other=0.0)
        lo = tl.load(ws + 2 * NG + at, mask=cmask, other=0.0)
    weight = tl.zeros_like(scale) + 1.0
    if HAS_W:
        weight = _acc(tl.load(w + c, mask=cmask, other=0.0), F64)
        scale *= weight
    x_offs = _offsets(n, c, s, x_sn, x_sc, x_s0, x_s1, S0, X_UNIT, SPATIAL2, ALIGNED, INT64)
    v = _acc(tl.load(x + x_offs, mask=mask, other=0.0), F64)
    out = ((v - mean[:, None]) - lo[:, None]) * scale[:, None]
    shift = tl.zeros_like(scale)
    if HAS_B:
        shift = _acc(tl.load(b + c, mask=cmask, other=0.0), F64)
        out += shift[:, None]
    if SILU:
        out = _activation(out, 0)
    if SAVE_AFFINE:
        keeper = cmask & (c * 0 + n + sb == 0)  # sample 0, first spatial block: each channel once
        affine = rstd_out + _index(groups, INT64) + c
        tl.store(affine, weight.to(rstd_out.dtype.element_ty), mask=keeper)
        tl.store(affine + _index(C, INT64), shift.to(rstd_out.dtype.element_ty), mask=keeper)
    y_offs = _offsets(n, c, s, y_sn, y_sc, y_s0, y_s1, S0, Y_UNIT, SPATIAL2, ALIGNED, INT64)
    tl.store(y + y_offs, out.to(y.dtype.element_ty), mask=mask)


@triton.jit
def _silu_affine(stats, group, c, cmask, C, groups, SILU: tl.constexpr, F64: tl.constexpr):
    """``(a, shift)`` per channel ``c``, with which ``z = (x - mean) * a + shift`` (``SILU``; zeros otherwise).

    ``stats`` is ``group_norm_silu``'s packed fp32 buffer ``[mean | rstd |
    weight | bias]`` (``groups`` values each for the first two, ``C`` for the
    others: the forward's ``SAVE_AFFINE``).
    """
    a = _acc(tl.zeros_like(c), F64)
    shift = a
    if SILU:
        rstd = _acc(tl.load(stats + groups + group, mask=cmask, other=0.0), F64)
        at = stats + 2 * groups + c
        a = rstd * _acc(tl.load(at, mask=cmask, other=0.0), F64)
        shift = _acc(tl.load(at + C, mask=cmask, other=0.0), F64)
    return a, shift


@triton.jit
def _silu_grad(g, v, mu, a, shift):
    """``dy * silu'(z)`` for the ``[BLOCK_C, BLOCK_S]`` tile of ``x`` values ``v``, ``z = (v - mu) * a + shift``."""
    _, slope = _activation_grad((v - mu[:, None]) * a[:, None] + shift[:, None], 0)
    return g * slope


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _bwd_reduce_kernel(dy, x, mean, ws, C: tl.int64, S: tl.int64, S0: tl.int64, D: tl.int64, G: tl.int64,
                       dy_sn: tl.int64, dy_sc: tl.int64, dy_s0: tl.int64, dy_s1: tl.int64,
                       x_sn: tl.int64, x_sc: tl.int64, x_s0: tl.int64, x_s1: tl.int64,
                       cblocks: tl.int64, K: tl.int64, chunk_tiles: tl.int64, b_at: tl.int64, groups: tl.int64,
                       BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, DY_UNIT: tl.constexpr, X_UNIT: tl.constexpr,
                       SPATIAL2: tl.constexpr, ALIGNED: tl.constexpr, INT64: tl.constexpr,
                       F64: tl.constexpr, SILU: tl.constexpr = False):
    """Per channel of one chunk: ``sum(dy * (x - mean))`` and ``sum(dy)`` into ``ws``.

    ``SILU``: ``dy`` is the gradient of ``silu(z)``, ``z`` the group norm's
    output: the sums are of ``dz = dy * silu'(z)``, ``z`` recomputed from ``x``
    (``mean`` is then the packed fp32 statistics of :func:`_silu_affine`).
    """
    n, cb, k = _split3(_index(tl.program_id(0), INT64), _index(K, INT64), _index(cblocks, INT64))
    C, S, S0 = _hint16(_index(C, INT64), ALIGNED), _hint16(_index(S, INT64), ALIGNED), _index(S0, INT64)
    D, G = _index(D, INT64), _index(G, INT64)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    group = n * G + c // D
    mu = _acc(tl.load(mean + group, mask=cmask, other=0.0), F64)
    a, shift = _silu_affine(mean, group, c, cmask, C, _index(groups, INT64), SILU, F64)
    centred = _acc(tl.zeros([BLOCK_C, BLOCK_S], tl.float32), F64)
    plain = centred
    s_begin = k * _index(chunk_tiles, INT64) * BLOCK_S
    for t in range(0, _index(chunk_tiles, INT64)):
        s = s_begin + t * BLOCK_S + tl.arange(0, BLOCK_S)
        mask = cmask[:, None] & (s < S)[None, :]
        dy_offs = _offsets(n, c, s, dy_sn, dy_sc, dy_s0, dy_s1, S0, DY_UNIT, SPATIAL2, ALIGNED, INT64)
        x_offs = _offsets(n, c, s, x_sn, x_sc, x_s0, x_s1, S0, X_UNIT, SPATIAL2, ALIGNED, INT64)
        g = _acc(tl.load(dy + dy_offs, mask=mask, other=0.0), F64)
        v = _acc(tl.load(x + x_offs, mask=mask, other=0.0), F64)
        if SILU:
            g = _silu_grad(g, v, mu, a, shift)
        centred += tl.where(mask, g * (v - mu[:, None]), 0.0)
        plain += g
    at = (n * C + c) * _index(K, INT64) + k
    tl.store(ws + at, tl.sum(centred, axis=1), mask=cmask)
    tl.store(ws + _index(b_at, INT64) + at, tl.sum(plain, axis=1), mask=cmask)


@triton.jit
def _coefficients(ws, w, mean, rstd, gid, gmask, C, S, D, G, K, b_at, ROWS: tl.constexpr, BLOCK_J: tl.constexpr,
                  HAS_W: tl.constexpr, F64: tl.constexpr):
    """``q, o`` of ``dx = r*w*dy + q*x + o`` for the groups ``gid`` (one per row), from their partial sums."""
    base = (gid // G * C + gid % G * D) * K
    parts = D * K
    centred = _acc(tl.zeros([ROWS, BLOCK_J], tl.float32), F64)
    plain = centred
    for j0 in range(0, parts, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        valid = gmask[:, None] & (j < parts)[None, :]
        at = base[:, None] + j[None, :]
        a = tl.load(ws + at, mask=valid, other=0.0)
        s = tl.load(ws + b_at + at, mask=valid, other=0.0)
        if HAS_W:
            channel = (gid % G * D)[:, None] + (j // K)[None, :]
            weight = _acc(tl.load(w + channel, mask=valid, other=0.0), F64)
            a *= weight
            s *= weight
        centred += a
        plain += s
    r = _acc(tl.load(rstd + gid, mask=gmask, other=0.0), F64)
    mu = _acc(tl.load(mean + gid, mask=gmask, other=0.0), F64)
    elements = _acc(D * S, F64)
    q = -r * r * r * tl.sum(centred, axis=1) / elements
    o = -r * tl.sum(plain, axis=1) / elements - mu * q
    return q, o


@triton.jit
def _param_sums(ws, rstd, dw, db, block, C, D, G, N, K, b_at, BLOCK_N: tl.constexpr, BLOCK_CF: tl.constexpr,
                BLOCK_K: tl.constexpr, HAS_DW: tl.constexpr, HAS_DB: tl.constexpr, F64: tl.constexpr):
    """``dweight``/``dbias`` of channel block ``block`` from the partial sums.

    ``[BLOCK_N, BLOCK_CF, BLOCK_K]`` tiles: chunks summed, then samples (a
    tree of fixed shape: deterministic).
    """
    c = block * BLOCK_CF + tl.arange(0, BLOCK_CF)
    cmask = c < C
    kk = tl.arange(0, BLOCK_K)
    dw_acc = _acc(tl.zeros([BLOCK_CF], tl.float32), F64)
    db_acc = dw_acc
    for n0 in range(0, N, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        rows = (n < N)[:, None] & cmask[None, :]
        at = ((n[:, None] * C + c[None, :]) * K)[:, :, None] + kk[None, None, :]
        mask = rows[:, :, None] & (kk < K)[None, None, :]
        if HAS_DW:
            r = _acc(tl.load(rstd + n[:, None] * G + (c // D)[None, :], mask=rows, other=0.0), F64)
            dw_acc += tl.sum(tl.sum(tl.load(ws + at, mask=mask, other=0.0), axis=2) * r, axis=0)
        if HAS_DB:
            db_acc += tl.sum(tl.sum(tl.load(ws + b_at + at, mask=mask, other=0.0), axis=2), axis=0)
    if HAS_DW:
        tl.store(dw + c, dw_acc.to(dw.dtype.element_ty), mask=cmask)
    if HAS_DB:
        tl.store(db + c, db_acc.to(db.dtype.element_ty), mask=cmask)


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _bwd_finalize_kernel(ws, w, mean, rstd, dw, db, C: tl.int64, S: tl.int64, D: tl.int64, G: tl.int64,
                         N: tl.int64, K: tl.int64, b_at: tl.int64, q_at: tl.int64, groups: tl.int64,
                         num_coef: tl.int64, BLOCK_G: tl.constexpr, BLOCK_J: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_CF: tl.constexpr, BLOCK_K: tl.constexpr, HAS_W: tl.constexpr,
                         HAS_DW: tl.constexpr, HAS_DB: tl.constexpr, INT64: tl.constexpr, F64: tl.constexpr):
    """Programs ``< num_coef``: ``q, o`` of ``BLOCK_G`` groups; the others: ``dw, db`` of a channel block."""
    pid = _index(tl.program_id(0), INT64)
    C, S, D, G, K = _index(C, INT64), _index(S, INT64), _index(D, INT64), _index(G, INT64), _index(K, INT64)
    num_coef, NG, b_at = _index(num_coef, INT64), _index(groups, INT64), _index(b_at, INT64)
    if pid < num_coef:
        gid = pid * BLOCK_G + tl.arange(0, BLOCK_G)
        gmask = gid < NG
        q, o = _coefficients(ws, w, mean, rstd, gid, gmask, C, S, D, G, K, b_at, BLOCK_G, BLOCK_J, HAS_W, F64)
        tl.store(ws + _index(q_at, INT64) + gid, q, mask=gmask)
        tl.store(ws + _index(q_at, INT64) + NG + gid, o, mask=gmask)
    else:
        _param_sums(ws, rstd, dw, db, pid - num_coef, C, D, G, _index(N, INT64), K, b_at, BLOCK_N, BLOCK_CF,
                    BLOCK_K, HAS_DW, HAS_DB, F64)


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _bwd_dx_kernel(dy, x, dx, w, mean, rstd, ws, dw, db, C: tl.int64, S: tl.int64, S0: tl.int64, D: tl.int64,
                   G: tl.int64, N: tl.int64, K: tl.int64,
                   dy_sn: tl.int64, dy_sc: tl.int64, dy_s0: tl.int64, dy_s1: tl.int64,
                   x_sn: tl.int64, x_sc: tl.int64, x_s0: tl.int64, x_s1: tl.int64,
                   dx_sn: tl.int64, dx_sc: tl.int64, dx_s0: tl.int64, dx_s1: tl.int64,
                   cblocks: tl.int64, sblocks: tl.int64, b_at: tl.int64, q_at: tl.int64, groups: tl.int64,
                   dx_programs: tl.int64, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_J: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_CF: tl.constexpr, BLOCK_K: tl.constexpr, DY_UNIT: tl.constexpr,
                   X_UNIT: tl.constexpr, DX_UNIT: tl.constexpr, SPATIAL2: tl.constexpr, ALIGNED: tl.constexpr,
                   HAS_W: tl.constexpr, HAS_DW: tl.constexpr, HAS_DB: tl.constexpr, FUSED: tl.constexpr,
                   INT64: tl.constexpr, F64: tl.constexpr, SILU: tl.constexpr = False):
    """``dx = rstd * w * dy + q * x + o`` on one ``[BLOCK_C, BLOCK_S]`` tile per program ``< dx_programs``.

    ``FUSED`` (step 2 folded in): each tile merges its groups' ``q, o`` from
    the partial sums, and the programs past ``dx_programs`` compute
    ``dweight``/``dbias``; otherwise ``q, o`` are read from ``ws``.
    ``SILU``: ``dy`` is replaced by ``dy * silu'(z)``, as in :func:`_bwd_reduce_kernel`.
    """
    pid = _index(tl.program_id(0), INT64)
    if pid < _index(dx_programs, INT64):
        n, c, cmask, sb, s, mask, group = _elementwise_tile(pid, C, S, D, G, cblocks, sblocks, BLOCK_C, BLOCK_S,
                                                            ALIGNED, INT64)
        inner = _index(S0, INT64)  # a new name: a runtime branch may not retype S0
        p = _acc(tl.load(rstd + group, mask=cmask, other=0.0), F64)
        if HAS_W:
            p *= _acc(tl.load(w + c, mask=cmask, other=0.0), F64)
        if FUSED:
            q, o = _coefficients(ws, w, mean, rstd, group, cmask, _index(C, INT64), _index(S, INT64),
                                 _index(D, INT64), _index(G, INT64), _index(K, INT64), _index(b_at, INT64), BLOCK_C,
                                 BLOCK_J, HAS_W, F64)
        else:
            q = tl.load(ws + _index(q_at, INT64) + group, mask=cmask, other=0.0)
            o = tl.load(ws + _index(q_at, INT64) + _index(groups, INT64) + group, mask=cmask, other=0.0)
        dy_offs = _offsets(n, c, s, dy_sn, dy_sc, dy_s0, dy_s1, inner, DY_UNIT, SPATIAL2, ALIGNED, INT64)
        x_offs = _offsets(n, c, s, x_sn, x_sc, x_s0, x_s1, inner, X_UNIT, SPATIAL2, ALIGNED, INT64)
        g = _acc(tl.load(dy + dy_offs, mask=mask, other=0.0), F64)
        v = _acc(tl.load(x + x_offs, mask=mask, other=0.0), F64)
        if SILU:
            mu = _acc(tl.load(mean + group, mask=cmask, other=0.0), F64)
            a, shift = _silu_affine(mean, group, c, cmask, _index(C, INT64), _index(groups, INT64), SILU, F64)
            g = _silu_grad(g, v, mu, a, shift)
        out = p[:, None] * g + q[:, None] * v + o[:, None]
        dx_offs = _offsets(n, c, s, dx_sn, dx_sc, dx_s0, dx_s1, inner, DX_UNIT, SPATIAL2, ALIGNED, INT64)
        tl.store(dx + dx_offs, out.to(dx.dtype.element_ty), mask=mask)
    else:
        _param_sums(ws, rstd, dw, db, pid - _index(dx_programs, INT64), _index(C, INT64), _index(D, INT64),
                    _index(G, INT64), _index(N, INT64), _index(K, INT64), _index(b_at, INT64), BLOCK_N, BLOCK_CF,
                    BLOCK_K, HAS_DW, HAS_DB, F64)


# --------------------------------------------------------------------------- host: layout
@dataclass(frozen=True)
class Layout:
    """Operands viewed as ``[N, C, S]``: shared spatial split, per-operand strides and unit codes."""

    S0: int
    spatial2: bool
    strides: tuple[tuple[int, int, int, int], ...]  # per operand: (sn, sc, s0, s1)
    units: tuple[int, ...]
    channel_inner: bool
    int64: bool
    aligned: bool


def _ncs_view(t: torch.Tensor, N: int, C: int, HxW: int) -> tuple[int, int, tuple[int, ...], tuple[int, ...]] | None:
    """``(sn, sc, spatial sizes, spatial strides)`` of ``t`` read as ``[N, C, HxW]``; ``None`` if unreadable."""
    if t.dim() >= 2 and t.shape[0] == N and t.shape[1] == C:
        return t.stride(0), t.stride(1), tuple(t.shape[2:]), tuple(t.stride()[2:])
    if t.is_contiguous():  # torch reads any contiguous tensor of N*C*HxW elements so
        return C * HxW, HxW, (HxW,), (1,)
    return None


def _reach(N: int, C: int, HxW: int, view: tuple) -> int:
    sn, sc, sizes, strides = view
    return (N - 1) * abs(sn) + (C - 1) * abs(sc) + sum((n - 1) * abs(s) for n, s in zip(sizes, strides))


def plan_layout(tensors: tuple[torch.Tensor, ...], N: int, C: int, HxW: int) -> Layout | None:
    """Joint ``[N, C, S]`` layout of ``tensors`` (first one decides the tile orientation).

    ``None`` when a tensor cannot be read in place (the caller copies it).
    """
    views = [_ncs_view(t, N, C, HxW) for t in tensors]
    if any(v is None for v in views) or len({v[2] for v in views}) != 1:
        return None
    sizes, spatial = collapse_dims(views[0][2], *(v[3] for v in views))
    if len(sizes) > 2:
        return None
    S0 = sizes[-1] if sizes else 1
    spatial2 = len(sizes) == 2
    strides = tuple((v[0], v[1], sp[-1] if sp else 0, sp[0] if spatial2 else 0) for v, sp in zip(views, spatial))
    x_sc, x_s0 = strides[0][1], strides[0][2]
    channel_inner = x_sc == 1 and (HxW == 1 or x_s0 != 1 or spatial2)
    units = tuple(_unit(sc, s0, spatial2, channel_inner, HxW) for _, sc, s0, _ in strides)
    reach = max(_reach(N, C, HxW, v) for v in views)
    hinted = [C, HxW]  # every value the kernels pass through ``_aligned``
    for (sn, sc, s0, s1), unit in zip(strides, units):
        hinted += [sn, *([] if unit == CHANNEL_UNIT else [sc]), *([s0, s1] if spatial2 else
                                                                ([] if unit == SPATIAL_UNIT else [s0]))]
    aligned = all(v % 16 == 0 for v in hinted)
    return Layout(S0, spatial2, strides, units, channel_inner, reach + _policy().tile >= INT32_LIMIT, aligned)


def _unit(sc: int, s0: int, spatial2: bool, channel_inner: bool, HxW: int) -> int:
    if sc == 1 and (channel_inner or HxW == 1):
        return CHANNEL_UNIT
    if s0 == 1 and not spatial2:
        return SPATIAL_UNIT
    return CHANNEL_UNIT if sc == 1 else GENERAL



@dataclass(frozen=True)
class Tiling:
    """Tile shape and the split of each channel's ``S`` into ``K`` chunks."""

    block_c: int
    block_s: int
    cblocks: int
    sblocks: int
    K: int
    chunk_tiles: int


@context.cached
def _target_programs(device_type: str, index: int) -> int:
    units = context.current().facts(index).multiprocessors if device_type != "cpu" else None
    if units:
        return _policy().programs_per_sm * units
    return DEFAULT_TARGET.get(device_type, 512)


def plan_tiling(N: int, C: int, HxW: int, channel_inner: bool, device: torch.device) -> Tiling:
    """Tile orientation from the input's unit stride; enough chunks to fill the device."""
    policy = _policy()
    tile = policy.tile
    if channel_inner:
        block_c = min(next_pow2(C), tile, policy.channel_block_max)
        block_s = min(max(tile // block_c, 1), next_pow2(HxW))
    else:
        block_s = min(next_pow2(HxW), tile)
        block_c = min(max(tile // block_s, 1), next_pow2(C))
    cblocks, sblocks = cdiv(C, block_c), cdiv(HxW, block_s)
    wanted = cdiv(_target_programs(device.type, device.index or 0), N * cblocks)
    if channel_inner:  # partials per channel and chunk: no chunk shorter than min_chunk_rows
        wanted = min(wanted, max(1, HxW // policy.min_chunk_rows))
    K = max(1, min(wanted, sblocks, policy.max_chunks))
    chunk_tiles = cdiv(sblocks, K)
    return Tiling(block_c, block_s, cblocks, sblocks, cdiv(sblocks, chunk_tiles), chunk_tiles)


def _fuses(tiling: Tiling, D: int) -> bool:
    """Whether step 2 folds into step 3: each tile merges its own groups' ``D x K`` partials."""
    return tiling.block_c * next_pow2(D * tiling.K) <= _policy().fuse_limit


def _group_blocks(groups: int, parts: int) -> tuple[int, int]:
    """``(BLOCK_G, BLOCK_J)`` of the finalize kernels: several small groups per program."""
    finalize_tile = _policy().finalize_tile
    block_j = min(next_pow2(parts), finalize_tile)
    return max(min(next_pow2(groups), finalize_tile // block_j), 1), block_j


def _policy() -> tuning.GroupNormPolicy:
    return tuning.policy("group_norm")


def _launcher(kernel: Any, **constexprs: Any) -> FastLauncher:
    return _cached_launcher(kernel, _policy().num_warps, **constexprs)


@functools.cache
def _cached_launcher(kernel: Any, num_warps: int, **constexprs: Any) -> FastLauncher:
    return FastLauncher(kernel, constexprs, num_warps=num_warps)


def _dense(param: torch.Tensor | None) -> torch.Tensor | None:
    """A strided affine parameter copied (C elements; torch's CPU kernel would ignore its strides)."""
    return param if param is None or param.is_contiguous() else param.contiguous()


# --------------------------------------------------------------------------- forward
@dataclass(frozen=True)
class ForwardPlan:
    """Everything a forward call launches, computed once per input layout.

    ``stats_size``: elements of ``group_norm_silu``'s packed fp32 statistics (0 for the aten op).
    """

    y_format: torch.memory_format
    stat_dtype: torch.dtype
    acc_dtype: torch.dtype
    ws_size: int
    x_contiguous: torch.memory_format | None
    stats: tuple[FastLauncher, tuple[int, ...], tuple[int, ...]]
    finalize: tuple[FastLauncher, tuple[int, ...], tuple[int, ...]] | None
    normalize: tuple[FastLauncher, tuple[int, ...], tuple[int, ...]]
    stats_size: int = 0


_FORWARD_PLANS: dict[tuple, ForwardPlan] = context.cache()


def _forward_plan(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, N: int, C: int,
                  HxW: int, group: int, silu: bool = False, save_affine: bool = False) -> ForwardPlan:
    """The launches of one layout; ``silu``: ``group_norm_silu``'s (``save_affine``: keep what its backward reads)."""
    y_format = suggest_memory_format(x)
    y_meta = torch.empty_like(x, device="meta", memory_format=y_format)
    layout = plan_layout((x, y_meta), N, C, HxW)
    x_contiguous = None
    if layout is None:  # more than two spatial dims that do not merge: copy x first
        x_contiguous = y_format
        layout = plan_layout((y_meta, y_meta), N, C, HxW)
    tiling = plan_tiling(N, C, HxW, layout.channel_inner, x.device)
    f64 = x.dtype == torch.float64
    acc_dtype = torch.float64 if f64 else torch.float32
    K, NG, D = tiling.K, N * group, C // group
    m2_at, stat_at = N * C * K, 3 * N * C * K
    chunk = tiling.chunk_tiles * tiling.block_s
    fused = _fuses(tiling, D)
    common = {"INT64": layout.int64, "F64": f64}
    tile = {"BLOCK_C": tiling.block_c, "BLOCK_S": tiling.block_s, "SPATIAL2": layout.spatial2,
            "ALIGNED": layout.aligned}
    stats = _launcher(_stats_kernel, X_UNIT=layout.units[0], **tile, **common)
    xs, ys = layout.strides
    finalize = None
    if not fused:
        block_g, block_j = _group_blocks(NG, D * K)
        finalize = (_launcher(_finalize_kernel, BLOCK_G=block_g, BLOCK_J=block_j, **common), (cdiv(NG, block_g),),
                    (C, HxW, D, group, K, chunk, m2_at, stat_at, NG, xs[0], xs[1]))
    normalize = _launcher(_normalize_kernel, X_UNIT=layout.units[0], Y_UNIT=layout.units[1],
                          HAS_W=weight is not None, HAS_B=bias is not None, FUSED=fused,
                          BLOCK_J=next_pow2(D * K) if fused else 1, SILU=silu, SAVE_AFFINE=save_affine, **tile,
                          **common)
    return ForwardPlan(
        y_format, acc_dtype if silu else front.stat_dtype(x, (weight, bias)), acc_dtype,
        stat_at if fused else stat_at + 3 * NG, x_contiguous,
        (stats, (N * tiling.cblocks * K,),
         (C, HxW, layout.S0, *xs, tiling.cblocks, K, tiling.chunk_tiles, m2_at, D)),
        finalize,
        (normalize, (N * tiling.cblocks * tiling.sblocks,),
         (C, HxW, layout.S0, D, group, *xs, *ys, tiling.cblocks, tiling.sblocks, K, chunk, m2_at, stat_at, NG)),
        stats_size=2 * NG + (2 * C if save_affine else 0) if silu else 0,
    )


def _param_key(p: torch.Tensor | None) -> tuple | None:
    return None if p is None else (p.shape, p.dtype, p.device)


def _launch_forward(plan: ForwardPlan, input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                    y: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, eps: float) -> None:
    """The plan's launches: ``y``, ``mean`` and ``rstd`` filled."""
    x = input if plan.x_contiguous is None else input.contiguous(memory_format=plan.x_contiguous)
    ws = torch.empty(plan.ws_size, dtype=plan.acc_dtype, device=input.device)
    eps = float(eps)
    stats, grid0, args0 = plan.stats
    stats(grid0, x, ws, *args0)
    if plan.finalize is not None:
        finalize, grid1, args1 = plan.finalize
        finalize(grid1, x, ws, mean, rstd, *args1, eps)
    normalize, grid2, args2 = plan.normalize
    normalize(grid2, x, y, x if weight is None else _dense(weight), x if bias is None else _dense(bias), ws, mean,
              rstd, *args2, eps)


def native_group_norm(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, N: int, C: int,
                      HxW: int, group: int, eps: float, dense_only: bool = True,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``aten::native_group_norm``: ``(y, mean, rstd)`` exactly as torch returns them.

    As the aten op (``dense_only``), an input that is not dense in its suggested
    memory format declines: torch's kernel raises for it. ``aten::group_norm``
    (:mod:`.group_norm_op`) passes ``dense_only=False`` and reads any layout in place.
    Everything checked (:func:`flaggems.fronts.group_norm.check_forward`)
    depends only on the plan key: a call whose key has a plan was valid, so
    the hot path checks nothing; per call it allocates the outputs
    (:func:`~flaggems.fronts.group_norm.allocate_forward`).
    """
    key = (input.shape, input.stride(), input.dtype, input.device, _param_key(weight), _param_key(bias), N, C, HxW,
           group, dense_only)
    plan = _FORWARD_PLANS.get(key)
    if plan is None:
        front.check_forward(input, weight, bias, N, C, HxW, group, dense_only=dense_only)
        plan = remember(_FORWARD_PLANS, key, _forward_plan(input, weight, bias, N, C, HxW, group))
    y, mean, rstd = front.allocate_forward(input, N, group, plan.y_format, plan.stat_dtype)
    _launch_forward(plan, input, weight, bias, y, mean, rstd, eps)
    return y, mean, rstd


def group_norm_silu_forward(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, N: int,
                            C: int, HxW: int, group: int, eps: float, y: torch.Tensor, save: bool) -> torch.Tensor:
    """``y = silu(group_norm(input))`` in the same launches as the aten op; returns the packed statistics.

    The call was checked by :mod:`flaggems.fronts.group_norm_silu`; ``y`` is
    laid out in the input's suggested memory format. The statistics are one
    fp32 tensor ``[mean | rstd]`` (``N * group`` each), followed with ``save``
    by each channel's weight and bias in fp32 (what :func:`group_norm_silu_backward`
    reads to recompute the SiLU's input ``z``: the forward's normalize writes them).
    """
    key = ("silu", input.shape, input.stride(), input.dtype, input.device, _param_key(weight), _param_key(bias), N,
           C, HxW, group, save)
    plan = _FORWARD_PLANS.get(key)
    if plan is None:
        plan = remember(_FORWARD_PLANS, key, _forward_plan(input, weight, bias, N, C, HxW, group, True, save))
    stats = torch.empty(plan.stats_size, dtype=plan.acc_dtype, device=input.device)
    _launch_forward(plan, input, weight, bias, y, stats, stats[N * group:], eps)
    return stats


# --------------------------------------------------------------------------- backward
@dataclass(frozen=True)
class BackwardPlan:
    """Everything a backward call launches, computed once per layout and mask."""

    dx_like_x: bool
    dx_format: torch.memory_format
    acc_dtype: torch.dtype
    ws_size: int
    copy_format: torch.memory_format | None
    reduce: tuple[FastLauncher, tuple[int, ...], tuple[int, ...]]
    finalize: tuple[FastLauncher, tuple[int, ...], tuple[int, ...]] | None
    dx: tuple[FastLauncher, tuple[int, ...], tuple[int, ...]] | None


_BACKWARD_PLANS: dict[tuple, BackwardPlan] = context.cache()
# Plans hold tiles and grids from the policy: a new context (new tuning) drops them.
#: The dweight/dbias constexprs of a dx launch that computes neither.
_NO_PARAMS = {"BLOCK_N": 1, "BLOCK_CF": 1, "BLOCK_K": 1, "HAS_DW": False, "HAS_DB": False}


def _backward_plan(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, N: int, C: int, HxW: int,
                   group: int, mask: tuple[bool, bool, bool], dx_like_input: bool, silu: bool = False,
                   ) -> BackwardPlan:
    """The launches of one layout and mask; ``silu``: ``group_norm_silu``'s (weights from the packed statistics)."""
    dx_like_x, dx_format = front.dx_format(x, dx_like_input)
    dx_meta = torch.empty_like(x, device="meta") if dx_like_x else torch.empty_like(x, device="meta",
                                                                                      memory_format=dx_format)
    layout = plan_layout((x, dy, dx_meta), N, C, HxW)
    copy_format = None
    if layout is None:
        copy_format = suggest_memory_format(x)
        dense = torch.empty_like(x, device="meta", memory_format=copy_format)
        layout = plan_layout((dense, dense, dx_meta), N, C, HxW)
    tiling = plan_tiling(N, C, HxW, layout.channel_inner, x.device)
    f64 = x.dtype == torch.float64
    K, NG, D = tiling.K, N * group, C // group
    b_at, q_at = N * C * K, 2 * N * C * K
    has_w = silu or weight is not None
    common = {"INT64": layout.int64, "F64": f64}
    tile = {"BLOCK_C": tiling.block_c, "BLOCK_S": tiling.block_s, "SPATIAL2": layout.spatial2,
            "ALIGNED": layout.aligned}
    xs, dys, dxs = layout.strides
    x_unit, dy_unit, dx_unit = layout.units
    reduce = _launcher(_bwd_reduce_kernel, DY_UNIT=dy_unit, X_UNIT=x_unit, SILU=silu, **tile, **common)
    block_k = next_pow2(K)
    spread = next_pow2(cdiv(C, _target_programs(x.device.type, x.device.index or 0)))
    policy = _policy()
    block_cf = max(min(max(spread, policy.param_min_channels), policy.finalize_tile // block_k, next_pow2(C)), 1)
    params = {"BLOCK_N": max(min(next_pow2(N), policy.param_tile // (block_k * block_cf)), 1), "BLOCK_CF": block_cf,
              "BLOCK_K": block_k, "HAS_DW": mask[1], "HAS_DB": mask[2]}
    param_programs = cdiv(C, block_cf) if mask[1] or mask[2] else 0
    fused = mask[0] and _fuses(tiling, D)
    finalize = dx = None
    if not fused:
        block_g, block_j = _group_blocks(NG, D * K)
        num_coef = cdiv(NG, block_g) if mask[0] else 0
        finalize = (_launcher(_bwd_finalize_kernel, BLOCK_G=block_g, BLOCK_J=block_j, HAS_W=has_w, **params,
                              **common),
                    (num_coef + param_programs,), (C, HxW, D, group, N, K, b_at, q_at, NG, num_coef))
    if mask[0]:
        dx_programs = N * tiling.cblocks * tiling.sblocks
        # Folded: the dx launch's extra programs sum dweight/dbias; otherwise the finalize launch does.
        dx_params = params if fused else _NO_PARAMS
        dx = (_launcher(_bwd_dx_kernel, DY_UNIT=dy_unit, X_UNIT=x_unit, DX_UNIT=dx_unit, HAS_W=has_w, FUSED=fused,
                        BLOCK_J=next_pow2(D * K) if fused else 1, SILU=silu, **dx_params, **tile, **common),
              (dx_programs + (param_programs if fused else 0),),
              (C, HxW, layout.S0, D, group, N, K, *dys, *xs, *dxs, tiling.cblocks, tiling.sblocks, b_at, q_at, NG,
               dx_programs))
    return BackwardPlan(
        dx_like_x, dx_format, torch.float64 if f64 else torch.float32, q_at if fused else q_at + 2 * NG,
        copy_format,
        (reduce, (N * tiling.cblocks * K,),
         (C, HxW, layout.S0, D, group, *dys, *xs, tiling.cblocks, K, tiling.chunk_tiles, b_at, NG)),
        finalize, dx,
    )


def _launch_backward(plan: BackwardPlan, grad_out: torch.Tensor, input: torch.Tensor, w: torch.Tensor,
                     mean: torch.Tensor, rstd: torch.Tensor, dx: torch.Tensor | None, dw: torch.Tensor | None,
                     db: torch.Tensor | None) -> None:
    """The plan's launches: every one of ``dx``, ``dw``, ``db`` that is not ``None`` filled."""
    x, dy = input, grad_out
    if plan.copy_format is not None:
        x, dy = x.contiguous(memory_format=plan.copy_format), dy.contiguous(memory_format=plan.copy_format)
    ws = torch.empty(plan.ws_size, dtype=plan.acc_dtype, device=input.device)
    reduce, grid0, args0 = plan.reduce
    reduce(grid0, dy, x, mean, ws, *args0)
    dw_out, db_out = ws if dw is None else dw, ws if db is None else db
    if plan.finalize is not None:
        finalize, grid1, args1 = plan.finalize
        if grid1[0]:
            finalize(grid1, ws, w, mean, rstd, dw_out, db_out, *args1)
    if plan.dx is not None:
        launch, grid2, args2 = plan.dx
        launch(grid2, dy, x, dx, w, mean, rstd, ws, dw_out, db_out, *args2)


def native_group_norm_backward(grad_out: torch.Tensor, input: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                               weight: torch.Tensor | None, N: int, C: int, HxW: int, group: int,
                               output_mask: list[bool], *, dx_like_input: bool = False,
                               ) -> tuple[torch.Tensor | None, ...]:
    """``aten::native_group_norm_backward``: ``(dx, dweight, dbias)``, each only if ``output_mask`` asks.

    ``dx`` is laid out as torch's kernel lays it out, or, with ``dx_like_input``,
    in the input's suggested memory format on every device (the
    ``aten::group_norm`` route: a channels_last input gets a channels_last
    gradient, which the convolution before it consumes without a copy).
    """
    mask = front.backward_mask(grad_out, input, output_mask)
    if not (mask[0] or mask[1] or mask[2]):
        return None, None, None
    key = (input.shape, input.stride(), grad_out.shape, grad_out.stride(), input.dtype, input.device,
           grad_out.device, mean.shape, mean.stride(), mean.dtype, mean.device, rstd.shape, rstd.stride(),
           rstd.dtype, rstd.device, _param_key(weight), N, C, HxW, group, mask, dx_like_input)
    plan = _BACKWARD_PLANS.get(key)
    if plan is None:
        front.check_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, mask)
        plan = remember(_BACKWARD_PLANS, key, _backward_plan(grad_out, input, weight, N, C, HxW, group, mask,
                                                             dx_like_input))
    dx, dw, db = front.allocate_backward(input, weight, C, mask, plan.dx_like_x, plan.dx_format)
    _launch_backward(plan, grad_out, input, mean if weight is None else _dense(weight), mean, rstd, dx, dw, db)
    return dx, dw, db


def group_norm_silu_backward(grad_out: torch.Tensor, input: torch.Tensor, stats: torch.Tensor, N: int, C: int,
                             HxW: int, group: int, dx: torch.Tensor | None, dweight: torch.Tensor | None,
                             dbias: torch.Tensor | None) -> None:
    """The gradients of ``silu(group_norm(input))`` for ``grad_out``: every one of ``dx``, ``dweight``, ``dbias``
    that is not ``None`` filled (``dx`` laid out as :func:`flaggems.fronts.group_norm.dx_format` says with
    ``like_input``).

    ``stats``: :func:`group_norm_silu_forward`'s (saved). The aten op's
    launches, each kernel with ``SILU``: ``dy`` becomes ``dy * silu'(z)`` where
    it is read, ``z`` recomputed from the input and the packed statistics.
    """
    mask = (dx is not None, dweight is not None, dbias is not None)
    key = ("silu", input.shape, input.stride(), grad_out.shape, grad_out.stride(), input.dtype, input.device,
           grad_out.device, N, C, HxW, group, mask)
    plan = _BACKWARD_PLANS.get(key)
    if plan is None:
        plan = remember(_BACKWARD_PLANS, key, _backward_plan(grad_out, input, None, N, C, HxW, group, mask, True,
                                                             silu=True))
    NG = N * group
    _launch_backward(plan, grad_out, input, stats[2 * NG:], stats, stats[NG:], dx, dweight, dbias)
