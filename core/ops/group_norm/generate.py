"""The group_norm family's random case generators (the randomized kit): ``group_norm``, ``native_group_norm``,
``native_group_norm_backward`` and ``flaggems::group_norm_silu``.

Same contract as every generator (:mod:`flaggems.testing._generators`); ``group_norm_silu`` draws as the
other fused ops do (:mod:`flaggems.testing._generators_fused`). Tolerances: the registered cases'
(:mod:`flaggems.ops.group_norm.cases.native`); why every group has at least three elements: :func:`norm_shape`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import torch

from ...testing import NATIVE_CONTIGUOUS_ON_GPU, _sweep
from ...testing import _generators_fused as fused
from ...testing._generators import MAX_NUMEL, Gen, randn
from ...testing._generators_fused import BF16, DTYPES, F16, F32, F64, RELAYOUT_SHARE
from ...testing._inputs import FLOATS, GRAD_SHARE


def norm_shape(rng: random.Random) -> tuple[tuple[int, ...], int]:
    """``(N, C, *spatial)`` with ``C`` a multiple of the groups (N = 0 now and then), and the groups.

    Every group has at least three elements: a one-element group has variance 0 and ``rstd = eps ** -0.5``
    (316 for 1e-5), and torch's own ``y = x * a + b`` then errs by ulps of ``|x * a|``, hundreds of ulps
    of ``y``: outside the ulps-of-``y`` tolerance the cases document (:mod:`flaggems.ops.group_norm.cases.native`).
    In a two-element group the normalised values are +-1 and the input's gradient is exactly zero: both
    sides return rounding noise of the cancelling terms (a bf16 case differed so on the H200).
    """
    while True:
        groups = rng.choice((1, 1, 2, 3, 4, 8))
        per_group = rng.choice((1, 1, 2, 3, 5))
        n = rng.choice((0, 1, 1, 2, 3)) if rng.random() < 0.1 else rng.choice((1, 2, 3))
        dims = (n, groups * per_group, *(rng.choice((1, 2, 3, 5, 8)) for _ in range(rng.randint(0, 3))))
        if math.prod(dims) <= MAX_NUMEL and per_group * math.prod(dims[2:]) >= 3:
            return _sweep.grow(dims, range(2, len(dims))), groups


def affine(rng: random.Random, channels: int, dtype: torch.dtype, dev: torch.device) -> tuple[Any, Any]:
    """Optional weight (around 1) and bias."""
    w = randn((channels,), dtype, dev, 0.5, 1.0) if rng.random() < 0.8 else None
    b = randn((channels,), dtype, dev, 0.5) if rng.random() < 0.8 else None
    return w, b


def norm_dtypes(rng: random.Random, dev: torch.device) -> tuple[torch.dtype, torch.dtype]:
    """Input dtype and parameter dtype (mixed half input / fp32 parameters only where torch's CPU kernel takes
    them)."""
    dtype = rng.choice(FLOATS)
    mixed = dev.type == "cpu" and dtype in (torch.float16, torch.bfloat16) and rng.random() < 0.3
    return dtype, (torch.float32 if mixed else dtype)


def gen_group_norm(rng: random.Random, dev: torch.device) -> Gen:
    """``group_norm(input, num_groups, weight, bias, eps, cudnn_enabled)`` (forward values; with inputs that
    require grad, the kit compares gradients too)."""
    from .cases.native import FORWARD_ULPS

    dims, groups = norm_shape(rng)
    dtype, param = norm_dtypes(rng, dev)
    x = randn(dims, dtype, dev, shift=rng.choice((0.0, 0.0, 2.0)))
    w, b = affine(rng, dims[1], param, dev)
    eps = rng.choice((1e-5, 1e-5, 1e-3, 0.5))
    kind = str(dtype)
    if rng.random() < GRAD_SHARE:  # now and then a frozen input: only the weight's and bias's gradients
        for t in (x, w, b):
            if t is not None and rng.random() < 0.8:
                t.requires_grad_()
        kind += " grad"
    return Gen((x, groups, w, b, eps, True), ulps=FORWARD_ULPS[dtype], check_strides=dev.type == "cpu",
               kind=kind)


def gen_native_group_norm(rng: random.Random, dev: torch.device) -> Gen:
    """``native_group_norm(input, weight, bias, N, C, HxW, group, eps)``."""
    from .cases.native import FORWARD_ULPS

    dims, groups = norm_shape(rng)
    dtype, param = norm_dtypes(rng, dev)
    x = randn(dims, dtype, dev, shift=rng.choice((0.0, 0.0, 2.0)))
    w, b = affine(rng, dims[1], param, dev)
    hxw = math.prod(dims[2:])
    return Gen((x, w, b, dims[0], dims[1], hxw, groups, rng.choice((1e-5, 1e-3))), ulps=FORWARD_ULPS[dtype],
               check_strides=dev.type == "cpu", tags=(NATIVE_CONTIGUOUS_ON_GPU,), kind=str(dtype))


def gen_native_group_norm_backward(rng: random.Random, dev: torch.device) -> Gen:
    """``native_group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask)``."""
    from .cases.native import BACKWARD_ULPS, EPS, _stats

    dims, groups = norm_shape(rng)
    dtype, param = norm_dtypes(rng, dev)
    x, dy = randn(dims, dtype, dev), randn(dims, dtype, dev)
    mean, rstd = _stats(x, dims[0], groups, EPS, param)
    w = randn((dims[1],), param, dev, 0.5, 1.0) if rng.random() < 0.8 else None
    mask = [rng.random() < 0.8 for _ in range(3)]
    hxw = math.prod(dims[2:])
    return Gen((dy, x, mean, rstd, w, dims[0], dims[1], hxw, groups, mask),
               ulps=BACKWARD_ULPS[dtype] * sum_scale(dtype, max(dims[0], dims[1] // groups) * hxw),
               check_strides=dev.type == "cpu", tags=(NATIVE_CONTIGUOUS_ON_GPU,), kind=str(dtype))


def sum_scale(dtype: torch.dtype, terms: int) -> int:
    """How much a float64 tolerance grows for results that sum ``terms`` values: float64 has no wider type
    for the kit's judge, and two summation orders of n terms differ by about sqrt(n) * eps * sqrt(n) *
    rms (a dbias of 55,591 terms: 1.1e-13 apart, 512 ulps of the result). ``1`` for other dtypes (the
    float64 judge covers them)."""
    return max(1, terms >> 12) if dtype == torch.float64 else 1


# -- group_norm_silu ----------------------------------------------------------------------------------------

GNS_ARGS = ("input", "num_groups", "weight", "bias", "eps")


def gns_input(rng: random.Random, dims: tuple[int, ...], dtype: torch.dtype, dev: torch.device,
              shift: float) -> tuple[torch.Tensor, str]:
    """The input: contiguous, channels_last(_3d), a strided or offset view, permuted, expanded over the batch."""
    names = ["contiguous", "strided", "offset", "permuted", "expanded-batch"]
    weights = [4, 2, 1, 1, 1]
    if len(dims) in (4, 5):
        names.append("channels-last")
        weights.append(5)
    how = rng.choices(names, weights)[0]
    if how == "channels-last":
        fmt = torch.channels_last if len(dims) == 4 else torch.channels_last_3d
        return randn(dims, dtype, dev, shift=shift).contiguous(memory_format=fmt), how
    if how == "strided":  # every other element of the last dimension, or of the channels
        if rng.random() < 0.5:
            return randn((*dims[:-1], 2 * dims[-1]), dtype, dev, shift=shift)[..., ::2], how
        return randn((dims[0], 2 * dims[1], *dims[2:]), dtype, dev, shift=shift)[:, ::2], how + "-channels"
    if how == "offset":
        return randn((dims[0] + 1, *dims[1:]), dtype, dev, shift=shift)[1:], how
    if how == "permuted":
        order = list(range(len(dims)))
        rng.shuffle(order)
        return fused._stored_in(order, dims, dtype, dev, 1.0, shift), f"permuted{tuple(order)}"
    if how == "expanded-batch" and dims[0] > 1:
        return randn((1, *dims[1:]), dtype, dev, shift=shift).expand(dims), how
    return randn(dims, dtype, dev, shift=shift), "contiguous"


def gen_group_norm_silu(rng: random.Random, dev: torch.device) -> Gen:
    """``flaggems::group_norm_silu(input, num_groups, weight=None, bias=None, eps=1e-05)``."""
    from .cases.native import FORWARD_ULPS, NATIVE_TAKES_CHANNELS_LAST

    dims, groups = norm_shape(rng)
    if rng.random() < 0.03:  # an empty spatial extent (norm_shape keeps three elements a group otherwise)
        dims = (*dims[:2], 0, *dims[3:]) if len(dims) > 2 else (*dims, 0)
    dtype = rng.choices((*DTYPES, F64), (4, 4, 4, 0.3))[0]
    mixed = NATIVE_TAKES_CHANNELS_LAST and dtype in (F16, BF16) and rng.random() < 0.2  # torch's CPU kernel only
    param = F32 if mixed else dtype
    relayout = rng.random() < RELAYOUT_SHARE
    shift = rng.choice((0.0, 0.0, 2.0))
    if relayout:
        x, how = randn(dims, dtype, dev, shift=shift), "relayout"
    else:
        x, how = gns_input(rng, dims, dtype, dev, shift)
    C = dims[1]
    w = b = None
    if rng.random() < 0.8:
        w = randn((2 * C,), param, dev, 0.5, 1.0)[::2] if rng.random() < 0.15 else randn((C,), param, dev, 0.5, 1.0)
    if rng.random() < 0.8:
        b = randn((C,), param, dev, 0.5, rng.choice((0.0, 0.0, 0.0, 20.0, -20.0)))  # +-20: the SiLU's tails
    if rng.random() < 0.03:
        groups = rng.choice([g for g in (0, 5, 7, C + 1) if g == 0 or C % g])  # the reference raises
    eps = rng.choice((1e-5, 1e-5, 1e-6, 1e-3, 0.1))
    x, w, b = fused._leaf(x), fused._leaf(w), fused._leaf(b)
    grad = rng.random() < GRAD_SHARE
    if grad:
        fused.requires_grad(x, *(p for p in (w, b) if rng.random() < 0.7))
    args = fused.trim_defaults(rng, [x, groups, w, b, eps], (None, None, 1e-5))
    args, kwargs = fused._by_keyword(rng, args, GNS_ARGS, rng.randint(2, len(args)))
    kind = (f"{fused.short(dtype)}{'/f32-affine' if mixed else ''} {dims} groups={groups} x={how} "
            f"w={'none' if w is None else tuple(w.stride())} b={'none' if b is None else 'yes'}"
            f"{' grad' if grad else ''}")
    return fused._gen(args, kwargs, ulps=float(FORWARD_ULPS[dtype]), check_strides=NATIVE_TAKES_CHANNELS_LAST,
                      fixed=fused.fixed_positions(tuple(args), kwargs, not relayout), kind=kind)


GENERATORS: dict[str, Callable[[random.Random, torch.device], Gen]] = {
    "group_norm": gen_group_norm,
    "native_group_norm": gen_native_group_norm,
    "native_group_norm_backward": gen_native_group_norm_backward,
    "flaggems::group_norm_silu": gen_group_norm_silu,
}
