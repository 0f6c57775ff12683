"""Strided elementwise copy with a cast on store: :func:`strided_copy`.

The host collapses dimensions (:func:`~flaggems.toolkit.layout.collapse_dims`),
picks a kernel (:mod:`~flaggems.toolkit.copy_kernels`) and its
constexpr flags, and launches it through a cached
:class:`~flaggems.toolkit.launch.FastLauncher`. Plans are cached per
``(shape, dst strides, src strides)`` so a repeated call does no planning.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import context
from . import copy_kernels as kernels
from .dtypes import SUPPORTED_DTYPES
from .launch import FastLauncher
from .layout import collapse_dims, move_dim, remember, span
from .tuning import ElementwisePolicy, elementwise_policy, on_policy_change

#: dtypes :func:`strided_copy` reads and writes.
#: Most dimensions a kernel takes after collapsing; more are split on the host.
MAX_RANK = 6
#: Offsets at or beyond this switch to the 64-bit indexed kernel variant.
INT32_LIMIT = 2**31
#: Innermost sizes below this use the linear kernel (a tile would be mostly masked).
SMALL_INNER = 8
#: Column widths of the tiled kernel: a bounded menu, so shapes never add compiles.
TILE_COLUMNS = (512, 64, 16)


def needs_int64(numel: int, sizes: Sequence[int], stride_lists: Sequence[Sequence[int]], pad: int) -> bool:
    """Whether any index or offset (including a tile's masked overhang of ``pad`` elements) reaches 2**31."""
    if numel + pad >= INT32_LIMIT:
        return True
    for strides in stride_lists:
        widest = max((abs(s) for s in strides), default=0)
        if span(sizes, strides) + pad * max(widest, 1) >= INT32_LIMIT:
            return True
    return False


@dataclass(frozen=True)
class KernelPlan:
    """One launch: a kernel with its constexprs, grid and scalar arguments."""

    kernel: str
    constexprs: tuple[tuple[str, Any], ...]
    grid: tuple[int, ...]
    scalars: tuple[int, ...]
    num_warps: int
    launcher: FastLauncher = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Resolved once per plan rather than looked up (hashing the constexpr tuple) per call.
        object.__setattr__(self, "launcher", _launcher(self.kernel, self.constexprs, self.num_warps))

    def run(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Launch on ``dst`` and ``src`` (views matching the planned layout)."""
        self.launcher(self.grid, dst, src, *self.scalars)


@dataclass(frozen=True)
class SplitPlan:
    """More than :data:`MAX_RANK` dimensions: one inner launch per index of the outer ones."""

    outer_sizes: tuple[int, ...]
    outer_strides: tuple[tuple[int, ...], tuple[int, ...]]
    inner_sizes: tuple[int, ...]
    inner_strides: tuple[tuple[int, ...], tuple[int, ...]]
    inner: KernelPlan

    def run(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Launch the inner plan on ``as_strided`` views, one per outer index."""
        (dst_outer, src_outer), (dst_inner, src_inner) = self.outer_strides, self.inner_strides
        dst_base, src_base = dst.storage_offset(), src.storage_offset()
        for index in itertools.product(*map(range, self.outer_sizes)):
            dst_off = dst_base + sum(i * s for i, s in zip(index, dst_outer, strict=True))
            src_off = src_base + sum(i * s for i, s in zip(index, src_outer, strict=True))
            self.inner.run(dst.as_strided(self.inner_sizes, dst_inner, dst_off),
                           src.as_strided(self.inner_sizes, src_inner, src_off))


class _EmptyPlan:
    def run(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        return None


EMPTY_PLAN = _EmptyPlan()

_KERNELS = {
    "flat": kernels.copy_flat_kernel,
    "linear": kernels.copy_strided_kernel,
    "tiled": kernels.copy_strided_kernel,
}
_LAUNCHERS: dict[tuple, FastLauncher] = {}


def _launcher(kernel: str, constexprs: tuple[tuple[str, Any], ...], num_warps: int) -> FastLauncher:
    key = (kernel, constexprs, num_warps)
    launcher = _LAUNCHERS.get(key)
    if launcher is None:
        launcher = _LAUNCHERS[key] = FastLauncher(_KERNELS[kernel], dict(constexprs), num_warps=num_warps)
    return launcher


def _padded(values: Sequence[int], fill: int) -> tuple[int, ...]:
    return (*values, *(fill,) * (MAX_RANK - len(values)))


def flat_plan(numel: int, policy: ElementwisePolicy) -> KernelPlan:
    """Plan for two dense operands in the same order."""
    block = policy.block_size
    tiles = max(math.ceil(numel / block), 1)
    int64 = needs_int64(numel, (numel,), ((1,),), block)
    return KernelPlan("flat", (("BLOCK", block), ("INT64", int64)), policy.grid(tiles), (numel, tiles),
                      policy.num_warps)


def _linear_plan(sizes: Sequence[int], dst: Sequence[int], src: Sequence[int], numel: int,
                 policy: ElementwisePolicy) -> KernelPlan:
    """Inner-first ``sizes``/strides, one linear index per element."""
    block = policy.block_size
    tiles = math.ceil(numel / block)
    int64 = needs_int64(numel, sizes, (dst, src), block)
    constexprs = _strided_constexprs(len(sizes), True, block, 1, int64, False, False, False, False)
    scalars = (*_padded(sizes, 1), *_padded(dst, 0), *_padded(src, 0), numel, 1, 1, tiles)
    return KernelPlan("linear", constexprs, policy.grid(tiles), scalars, policy.num_warps)


def _strided_constexprs(rank: int, linear: bool, block0: int, block1: int, int64: bool, dst_unit0: bool,
                        src_unit0: bool, transposed: bool, aligned: bool) -> tuple[tuple[str, Any], ...]:
    return (("RANK", rank), ("LINEAR", linear), ("BLOCK0", block0), ("BLOCK1", block1), ("INT64", int64),
            ("DST_UNIT0", dst_unit0), ("SRC_UNIT0", src_unit0), ("TRANSPOSED", transposed), ("ALIGNED", aligned))


def _tile_shape(sizes: Sequence[int], transposed: bool, policy: ElementwisePolicy) -> tuple[int, int]:
    """``(BLOCK0, BLOCK1)`` from a fixed menu, so no shape adds a compile."""
    if transposed:
        rows, cols = policy.transpose_tile
        return cols, rows
    cols = next((c for c in TILE_COLUMNS if sizes[0] >= c // 2), TILE_COLUMNS[-1])
    return cols, max(policy.tile // cols, 1)


def _tiled_plan(sizes: Sequence[int], dst: Sequence[int], src: Sequence[int], numel: int,
                policy: ElementwisePolicy) -> KernelPlan:
    """Inner-first ``sizes``/strides (rank 2..6), 2-D tiles with columns over dim 0."""
    dst_unit0, src_unit0 = dst[0] == 1, src[0] == 1
    rows, cols = policy.transpose_tile
    # A transposed tile pays off only when it is mostly full.
    transposed = src[1] == 1 and not src_unit0 and sizes[0] >= cols // 2 and sizes[1] >= rows // 2
    block0, block1 = _tile_shape(sizes, transposed, policy)
    multiplied = [*dst[1:], *src[2:]]
    multiplied += [] if dst_unit0 else [dst[0]]
    multiplied += [] if src_unit0 else [src[0]]
    multiplied += [sizes[1]] if transposed else [src[1]]
    aligned = all(v % 16 == 0 for v in (sizes[0], *multiplied))
    tiles0 = math.ceil(sizes[0] / block0)
    if transposed:
        tiles1 = math.ceil(sizes[1] / block1)
        tiles = tiles0 * tiles1 * math.prod(sizes[2:])
    else:
        tiles1 = math.ceil(math.prod(sizes[1:]) / block1)
        tiles = tiles0 * tiles1
    int64 = needs_int64(numel, sizes, (dst, src), block0 + block1)
    constexprs = _strided_constexprs(len(sizes), False, block0, block1, int64, dst_unit0, src_unit0, transposed,
                                     aligned)
    scalars = (*_padded(sizes, 1), *_padded(dst, 0), *_padded(src, 0), math.prod(sizes[1:]), tiles0, tiles1, tiles)
    return KernelPlan("tiled", constexprs, policy.grid(tiles), scalars, policy.num_warps)


def kernel_plan(sizes: Sequence[int], dst: Sequence[int], src: Sequence[int],
                policy: ElementwisePolicy) -> KernelPlan:
    """Plan for an already collapsed layout (outermost first, at most :data:`MAX_RANK` dims)."""
    numel = math.prod(sizes)
    if not sizes or (len(sizes) == 1 and dst[0] == 1 and src[0] == 1):
        return flat_plan(numel, policy)
    rank = len(sizes)
    if rank > 2 and src[-1] != 1 and 1 in src[:-2]:
        # Put the source's unit-stride dimension next to the destination's: a transposed tile.
        sizes, (dst, src) = move_dim(sizes, (dst, src), src.index(1), rank - 2)
    sizes, dst, src = sizes[::-1], dst[::-1], src[::-1]
    if rank == 1 or sizes[0] < SMALL_INNER:
        return _linear_plan(sizes, dst, src, numel, policy)
    return _tiled_plan(sizes, dst, src, numel, policy)


def plan_copy(shape: Sequence[int], dst_strides: Sequence[int], src_strides: Sequence[int],
              policy: ElementwisePolicy) -> KernelPlan | SplitPlan | _EmptyPlan:
    """Choose the kernel(s), constexprs, grid and scalars for one copy layout."""
    if math.prod(shape) == 0:
        return EMPTY_PLAN
    sizes, (dst, src) = collapse_dims(shape, dst_strides, src_strides)
    if len(sizes) <= MAX_RANK:
        return kernel_plan(sizes, dst, src, policy)
    cut = len(sizes) - MAX_RANK
    inner = kernel_plan(sizes[cut:], dst[cut:], src[cut:], policy)
    return SplitPlan(sizes[:cut], (dst[:cut], src[:cut]), sizes[cut:], (dst[cut:], src[cut:]), inner)


#: Plans per layout key, valid for the current policy (emptied when it is forced or the context resets).
_PLANS: dict[tuple, Any] = context.cache()
on_policy_change(_PLANS.clear)


def _check(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"strided_copy: shapes differ: dst {tuple(dst.shape)}, src {tuple(src.shape)} "
                         "(expand the source first)")
    if dst.dtype not in SUPPORTED_DTYPES or src.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"strided_copy: unsupported dtype pair {src.dtype} -> {dst.dtype}")
    if dst.get_device() != src.get_device():
        raise ValueError(f"strided_copy: operands on different devices: {dst.device}, {src.device}")


def strided_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` into ``dst`` elementwise, casting to ``dst.dtype`` on store.

    Args:
        dst: destination, any strides (its memory must not overlap itself).
        src: source with ``dst``'s shape (expand broadcasts first: zero
            strides are fine), on the same device.

    Casts follow Triton's conversions, which match torch's for values in the
    destination's range (floats truncate toward zero into integers; any
    non-zero becomes ``True``). Overlap between ``dst`` and ``src`` is the
    caller's business.
    """
    _check(dst, src)
    if dst.is_contiguous() and src.is_contiguous():
        key: tuple = (dst.numel(),)
    else:
        key = (dst.shape, dst.stride(), src.stride())
    plan = _PLANS.get(key)
    if plan is None:
        plan = _new_plan(key, dst, src)
    plan.run(dst, src)


def copy_dense(dst: torch.Tensor, src: torch.Tensor, numel: int) -> None:
    """:func:`strided_copy` for two contiguous operands of ``numel`` elements, unchecked.

    For callers that already validated shapes, dtypes and devices (``copy_``'s
    hot path): skips the checks and the layout key, ~1 µs of host time.
    """
    key = (numel,)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _new_plan(key, dst, src)
    plan.run(dst, src)


def _new_plan(key: tuple, dst: torch.Tensor, src: torch.Tensor) -> KernelPlan | SplitPlan | _EmptyPlan:
    policy = elementwise_policy()
    if len(key) == 1:
        plan = EMPTY_PLAN if key[0] == 0 else flat_plan(key[0], policy)
    else:
        plan = plan_copy(dst.shape, dst.stride(), src.stride(), policy)
    return remember(_PLANS, key, plan)
