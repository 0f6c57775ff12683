"""The Triton kernels of ``aten::native_group_norm`` and ``aten::native_group_norm_backward``.

:mod:`.group_norm` plans and launches them; its docstring describes the steps
(``_stats_kernel``, ``_finalize_kernel``, ``_normalize_kernel``; ``_bwd_reduce_kernel``,
``_bwd_finalize_kernel``, ``_bwd_dx_kernel``), their numerics and the ``SILU`` flag
of ``flaggems::group_norm_silu``.
"""

# ruff: noqa: N803 - constexpr parameters are UPPER_CASE, as in every Triton kernel
from __future__ import annotations

import triton
import triton.language as tl

from flaggems.toolkit.jit_helpers import hint16 as _hint16
from flaggems.toolkit.jit_helpers import index_type as _index

from .glu import _activation, _activation_grad  # SiLU and its derivative (the glu kernels' ``ACT == 0``)

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
