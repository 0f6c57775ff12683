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

The kernels are in :mod:`.group_norm_kernels`; this module holds the plans,
launches and entry points.
"""

# ruff: noqa: N803 - constexpr parameters are UPPER_CASE, as in every Triton kernel
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from flaggems.fronts import group_norm as front
from flaggems.fronts.group_norm import HALF_DTYPES as HALF_DTYPES  # re-exported (defined here before the front)
from flaggems.fronts.group_norm import check_group_norm_inputs as check_group_norm_inputs  # re-exported
from flaggems.fronts.group_norm import suggest_memory_format
from flaggems.ops.group_norm.policy import GroupNormPolicy
from flaggems.toolkit import FastLauncher, cdiv, collapse_dims, context, next_pow2, tuning
from flaggems.toolkit.layout import remember

from .group_norm_kernels import (
    _bwd_dx_kernel,
    _bwd_finalize_kernel,
    _bwd_reduce_kernel,
    _finalize_kernel,
    _normalize_kernel,
    _stats_kernel,
)

FLOAT_DTYPES = front.DTYPES  # re-exported, as HALF_DTYPES

# Tiles and grid (tile, num_warps, finalize_tile, param_tile, param_min_channels, max_chunks, fuse_limit,
# programs_per_sm) are the typed launch policy ``flaggems.ops.group_norm.policy.GroupNormPolicy`` (tuning key
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


def _policy() -> GroupNormPolicy:
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
