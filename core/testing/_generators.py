"""Op-specific random case generators of the generic plugin's ops (the randomized kit).

A generator is ``gen(rng, dev) -> Gen``: every decision (shapes, dtypes, dims,
kinds of index, repeats, scalar arguments) comes from ``rng`` (a
:class:`random.Random`), tensor values from torch's generator. Built twice from
the same ``rng`` seed with different torch seeds, a case keeps its layout and
validity (an out-of-range index stays out of range, ``output_size`` stays the
sum of the repeats) and changes only values: the dispatcher check plans with
the first and replays with the second.

What the generators leave out, and why:

* ``index_copy`` with a duplicated index writes rows torch leaves unspecified
  (the winner); duplicates are generated only with equal source rows.
* float -> unsigned casts use non-negative values (negative ones are undefined
  in C++ and differ between devices); values stay representable in every dtype.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import DEVICE_ASSERT, NATIVE_CONTIGUOUS_ON_GPU, _sweep
from ._inputs import ALL_COPY_DTYPES, FLOATS, GRAD_SHARE, nonneg_values, values

#: Sizes a random dimension takes (0 and 1 included on purpose).
SIZES = (0, 1, 1, 2, 3, 4, 5, 7)
#: The largest tensor a generator builds (Triton's interpreter is slow).
MAX_NUMEL = 2048
I64, I32 = torch.int64, torch.int32


@dataclass
class Gen:
    """A generated case: arguments, tolerances and the arguments whose layout is part of the case."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    ulps: float = 0.0
    check_strides: bool = True
    tags: tuple[str, ...] = ()
    fixed: frozenset = frozenset()  # argument positions/names the relayout must leave as they are
    kind: str = ""


def shape(rng: random.Random, low: int, high: int, sizes: tuple[int, ...] = SIZES) -> tuple[int, ...]:
    """A random shape of rank ``low..high`` with at most :data:`MAX_NUMEL` elements."""
    while True:
        dims = tuple(rng.choice(sizes) for _ in range(rng.randint(low, high)))
        if math.prod(dims) <= MAX_NUMEL:
            return _sweep.grow(dims)


def pick_dim(rng: random.Random, rank: int) -> int:
    """A valid dim of a rank-``rank`` tensor, negative half of the time (0 or -1 for a 0-dim one)."""
    rank = max(rank, 1)
    dim = rng.randrange(rank)
    return dim - rank if rng.random() < 0.5 else dim


def data(shape_: tuple[int, ...], dtype: torch.dtype, dev: torch.device, nonneg: bool = False) -> torch.Tensor:
    """Values valid in every copy dtype (see :func:`flaggems.testing._inputs.values`)."""
    return (nonneg_values if nonneg else values)(shape_, dtype, dev)


# -- copies ----------------------------------------------------------------------------------------------------

def broadcast_source(rng: random.Random, dst: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts to ``dst``: leading dims dropped, some dims set to 1."""
    keep = dst[rng.randint(0, len(dst)):] if rng.random() < 0.3 else dst
    return tuple(1 if rng.random() < 0.2 else s for s in keep)


def gen_copy_(rng: random.Random, dev: torch.device) -> Gen:
    """``copy_(self, src)``: casts, broadcasts, self-copy, overlap and expanded-destination errors."""
    kind = rng.choices(("copy", "self", "overlap", "expanded-dst", "bad-shape"), (20, 1, 1, 1, 1))[0]
    dst_t, src_t = rng.choice(ALL_COPY_DTYPES), rng.choice(ALL_COPY_DTYPES)
    kwargs = {"non_blocking": True} if rng.random() < 0.1 else {}
    if kind == "self":
        x = data(shape(rng, 0, 4), dst_t, dev)
        return Gen((x, x), kwargs, kind=kind)
    if kind == "overlap":
        base = data((rng.randint(2, 40),), dst_t, dev)
        return Gen((base[1:], base[:-1]), kwargs, fixed=frozenset((0, 1)), kind=kind)
    dst_shape = shape(rng, 0, 4)
    src_shape = broadcast_source(rng, dst_shape)
    if kind == "bad-shape":
        src_shape = (*src_shape, 2) if src_shape else (3,)
    src = data(src_shape, src_t, dev, nonneg=dst_t == torch.uint8)
    if kind == "expanded-dst" and dst_shape:
        dst = data((1, *dst_shape[1:]), dst_t, dev).expand(max(dst_shape[0], 2), *dst_shape[1:])
        src = data(tuple(dst.shape), src_t, dev, nonneg=dst_t == torch.uint8)
        return Gen((dst, src), kwargs, fixed=frozenset((0,)), kind=kind)
    return Gen((data(dst_shape, dst_t, dev), src), kwargs, kind=kind)


def gen_to_copy(rng: random.Random, dev: torch.device) -> Gen:
    """``_to_copy(self, dtype=, memory_format=, ...)``: every dtype pair and format, ranks 0-5."""
    x_shape = shape(rng, 0, 5)
    src_t = rng.choice(ALL_COPY_DTYPES)
    dtype = rng.choice((None, *ALL_COPY_DTYPES))
    formats = [None, torch.preserve_format, torch.contiguous_format]
    formats += [torch.channels_last] * (3 if len(x_shape) == 4 else 0) + [torch.channels_last_3d] * (
        3 if len(x_shape) == 5 else 0)
    if rng.random() < 0.05:
        formats = [torch.channels_last]  # any rank but 4: torch's error
    kwargs: dict[str, Any] = {"dtype": dtype}
    fmt = rng.choice(formats)
    if fmt is not None:
        kwargs["memory_format"] = fmt
    if rng.random() < 0.2:
        kwargs.update(layout=torch.strided, device=dev, non_blocking=rng.random() < 0.5)
    x = data(x_shape, src_t, dev, nonneg=dtype == torch.uint8)
    return Gen((x,), kwargs, kind=f"format={fmt}")


# -- index ops ---------------------------------------------------------------------------------------------------

def bad_index(rng: random.Random, size: int) -> int:
    """An index outside ``[0, size)``."""
    return size + rng.randrange(3) if rng.random() < 0.6 else -1 - rng.randrange(3)


def index_values(rng: random.Random, size: int, k: int, kind: str, dev: torch.device,
                 dtype: torch.dtype = I64) -> torch.Tensor:
    """``k`` indices into ``[0, size)``: ``distinct``, ``repeated`` or with one ``out-of-range``."""
    if kind == "distinct":
        idx = torch.randperm(size, device=dev)[:k]
    else:
        idx = torch.randint(0, max(size, 1), (k,), device=dev)
    if kind == "out-of-range":
        idx[rng.randrange(k)] = bad_index(rng, size)
    return idx.to(dtype)


def index_kind(rng: random.Random, size: int) -> tuple[str, int]:
    """A kind of index and its length (out-of-range where an index exists)."""
    kind = rng.choices(("distinct", "repeated", "out-of-range"), (6, 3, 1))[0]
    if size == 0 and kind != "out-of-range":
        return kind, 0
    if kind == "out-of-range":
        return kind, rng.randint(1, 5)
    if kind == "distinct":
        return kind, rng.randint(0, size)
    return kind, rng.randint(0, size + 3)


def gen_index_copy(rng: random.Random, dev: torch.device) -> Gen:
    """``index_copy(_)(self, dim, index, source)``: distinct or repeated rows, bad indices, aliasing."""
    kind = rng.choices(("rows", "alias-source", "alias-index", "int32-index"), (20, 1, 1, 1))[0]
    dtype = rng.choice(ALL_COPY_DTYPES)
    self_shape = shape(rng, 0, 4)
    dim = pick_dim(rng, len(self_shape))
    size = self_shape[dim] if self_shape else 1
    if kind == "alias-source":
        x = data(self_shape, dtype, dev)
        return Gen((x, dim, torch.randperm(size, device=dev), x), kind=kind)
    if kind == "alias-index":  # the index is a view of self
        n = rng.randint(1, 8)
        m = rng.randint(0, n)
        x = torch.randperm(n, device=dev)  # distinct: a repeated index with unequal rows has no one answer
        return Gen((x, 0, x[:m], data((m,), I64, dev)), fixed=frozenset((0, 2)), kind=kind)
    index_kind_, k = index_kind(rng, size)
    index = index_values(rng, size, k, index_kind_, dev, I32 if kind == "int32-index" else I64)
    if k == 1 and rng.random() < 0.3:
        index = index.reshape(())
    src_shape = list(self_shape)
    if self_shape:
        src_shape[dim] = k
    table = data(self_shape, dtype, dev)  # source rows read through the index: repeated entries, equal rows
    source = table.index_select(dim, index.reshape(-1).clamp(0, max(size - 1, 0)).long()) if (
        self_shape and size) else data(tuple(src_shape), dtype, dev)
    tags = (DEVICE_ASSERT,) if index_kind_ == "out-of-range" else ()
    return Gen((data(self_shape, dtype, dev), dim, index, source.reshape(src_shape)), tags=tags,
               kind=f"{kind}/{index_kind_}")


def gen_index_select(rng: random.Random, dev: torch.device) -> Gen:
    """``index_select(self, dim, index)``: int32/int64, 0-dim or 1-d, repeated and bad indices."""
    dtype = rng.choice(ALL_COPY_DTYPES)
    self_shape = shape(rng, 0, 4)
    dim = pick_dim(rng, len(self_shape))
    size = self_shape[dim] if self_shape else 1
    kind, k = index_kind(rng, size)
    kind = "repeated" if kind == "distinct" else kind
    index = index_values(rng, size, k, kind, dev, rng.choice((I32, I64)))
    if k == 1 and rng.random() < 0.3:
        index = index.reshape(())
    tags = (DEVICE_ASSERT,) if kind == "out-of-range" else ()
    return Gen((data(self_shape, dtype, dev), dim, index), tags=tags, kind=kind)


# -- repeat_interleave -------------------------------------------------------------------------------------------

def repeat_list(rng: random.Random, n: int) -> tuple[list[int], str]:
    """``n`` repeats in ``[0, 6]``, drawn by torch's generator (the values seed: the replaying call of a case
    gets other repeats and another total, which a plan must not have kept; a swept case has a million);
    now and then one negative (torch's error)."""
    reps = torch.randint(0, 7, (n,)).tolist()
    if n and rng.random() < 0.05:
        reps[rng.randrange(n)] = -1
        return reps, "negative"
    return reps, "valid"


def output_size(rng: random.Random, total: int, kwargs: dict[str, Any]) -> str:
    """Add ``output_size`` to ``kwargs``: none, the right one, or (rarely) a wrong one."""
    choice = rng.choices(("none", "right", "wrong"), (5, 5, 1))[0]
    if choice != "none":
        kwargs["output_size"] = total + (rng.choice((1, 2)) if choice == "wrong" else 0)
    return choice


def asserts_on_device(state: str, given: str) -> tuple[str, ...]:
    """A negative repeat or a wrong ``output_size``: torch's CPU kernel raises, its CUDA one asserts."""
    return (DEVICE_ASSERT,) if state == "negative" or given == "wrong" else ()


def gen_repeat_tensor(rng: random.Random, dev: torch.device) -> Gen:
    """``repeat_interleave.Tensor(repeats, output_size=)``."""
    reps, state = repeat_list(rng, rng.randint(0, 40))
    repeats = torch.tensor(reps, dtype=rng.choice((I32, I64)), device=dev)
    if len(reps) == 1 and rng.random() < 0.3:
        repeats = repeats.reshape(())
    kwargs: dict[str, Any] = {}
    given = output_size(rng, sum(reps), kwargs)
    return Gen((repeats,), kwargs, tags=asserts_on_device(state, given), kind=f"{state}/{given}")


def gen_repeat_self_tensor(rng: random.Random, dev: torch.device) -> Gen:
    """``repeat_interleave.self_Tensor(self, repeats, dim=, output_size=)``: per-row or one repeat."""
    x_shape = shape(rng, 0, 3)
    dim = None if rng.random() < 0.3 or not x_shape else pick_dim(rng, len(x_shape))
    rows = math.prod(x_shape) if dim is None else x_shape[dim]
    n = 1 if rng.random() < 0.25 else rows
    reps, state = repeat_list(rng, n)
    repeats = torch.tensor(reps, dtype=rng.choice((I32, I64)), device=dev)
    if n == 1 and rng.random() < 0.5:
        repeats = repeats.reshape(())
    kwargs: dict[str, Any] = {} if dim is None else {"dim": dim}
    given = output_size(rng, sum(reps) * (rows if n == 1 else 1), kwargs)
    tags = asserts_on_device(state, given)
    return Gen((data(x_shape, rng.choice(ALL_COPY_DTYPES), dev), repeats), kwargs, tags=tags,
               kind=f"{state}/{given}")


def gen_repeat_self_int(rng: random.Random, dev: torch.device) -> Gen:
    """``repeat_interleave.self_int(self, repeats, dim=, output_size=)``."""
    x_shape = shape(rng, 0, 3)
    dim = None if rng.random() < 0.3 or not x_shape else pick_dim(rng, len(x_shape))
    repeats = rng.choice((0, 1, 2, 3, 4)) if rng.random() > 0.05 else -1
    rows = math.prod(x_shape) if dim is None else x_shape[dim]
    kwargs: dict[str, Any] = {} if dim is None else {"dim": dim}
    given = output_size(rng, rows * repeats, kwargs)
    return Gen((data(x_shape, rng.choice(ALL_COPY_DTYPES), dev), repeats), kwargs,
               tags=asserts_on_device("negative" if repeats < 0 else "valid", given), kind=given)


# -- group norm ------------------------------------------------------------------------------------------------

def norm_shape(rng: random.Random) -> tuple[tuple[int, ...], int]:
    """``(N, C, *spatial)`` with ``C`` a multiple of the groups (N = 0 now and then), and the groups.

    Every group has at least three elements: a one-element group has variance 0 and ``rstd = eps ** -0.5``
    (316 for 1e-5), and torch's own ``y = x * a + b`` then errs by ulps of ``|x * a|``, hundreds of ulps
    of ``y``: outside the ulps-of-``y`` tolerance the cases document (:mod:`flaggems.testing.cases.group_norm`).
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


def randn(shape_: tuple[int, ...], dtype: torch.dtype, dev: torch.device, scale: float = 1.0,
          shift: float = 0.0) -> torch.Tensor:
    """Normal values in float64, then ``dtype``."""
    return (torch.randn(shape_, device=dev, dtype=torch.float64) * scale + shift).to(dtype)


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
    from .cases.group_norm import FORWARD_ULPS

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
    from .cases.group_norm import FORWARD_ULPS

    dims, groups = norm_shape(rng)
    dtype, param = norm_dtypes(rng, dev)
    x = randn(dims, dtype, dev, shift=rng.choice((0.0, 0.0, 2.0)))
    w, b = affine(rng, dims[1], param, dev)
    hxw = math.prod(dims[2:])
    return Gen((x, w, b, dims[0], dims[1], hxw, groups, rng.choice((1e-5, 1e-3))), ulps=FORWARD_ULPS[dtype],
               check_strides=dev.type == "cpu", tags=(NATIVE_CONTIGUOUS_ON_GPU,), kind=str(dtype))


def gen_native_group_norm_backward(rng: random.Random, dev: torch.device) -> Gen:
    """``native_group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask)``."""
    from .cases.group_norm import BACKWARD_ULPS, EPS, _stats

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


# -- unfold ----------------------------------------------------------------------------------------------------

def unfold_args(rng: random.Random, x_shape: tuple[int, ...]) -> tuple[int, int, int, str]:
    """``(dim, size, step)`` for ``x_shape``, now and then invalid (torch's errors)."""
    dim = pick_dim(rng, len(x_shape))
    extent = x_shape[dim] if x_shape else 1
    # a size of at most 8: a swept extent keeps windows x size small
    size, step = rng.randint(0, min(extent, 8)), rng.randint(1, 4)
    kind = rng.choices(("valid", "size", "step"), (18, 1, 1))[0]
    if kind == "size":
        size = extent + 1
    if kind == "step":
        step = rng.choice((0, -1))
    return dim, size, step, kind


def gen_unfold(rng: random.Random, dev: torch.device) -> Gen:
    """``unfold(self, dimension, size, step)`` (a view: strides compared)."""
    x_shape = shape(rng, 0, 4)
    dim, size, step, kind = unfold_args(rng, x_shape)
    return Gen((data(x_shape, rng.choice(ALL_COPY_DTYPES), dev), dim, size, step), kind=kind)


def gen_unfold_backward(rng: random.Random, dev: torch.device) -> Gen:
    """``unfold_backward(grad_in, input_sizes, dim, size, step)``.

    Overlapping windows are sums: one ulp per overlapping window (the cases' tolerance, see
    :mod:`flaggems.testing.cases.unfold`), an ulp of the largest partial sum: a result near zero from
    terms near 8 (a swept case on the H200) differs by ulps of 8 between two summation orders.
    """
    sizes = shape(rng, 1, 4)
    dim, size, step, kind = unfold_args(rng, sizes)
    if kind == "size":
        size = sizes[dim]  # an invalid size gives no gradient shape; the step errors stay
    grad_shape = tuple(torch.empty(sizes, device="meta").unfold(dim, size, max(step, 1)).shape)
    dtype = rng.choice(FLOATS)
    overlap = math.ceil(size / step) if 0 < step < size else 0
    grad = data(grad_shape, dtype, dev)
    reach = overlap * float(grad.abs().max()) if overlap and grad.numel() else 0.0
    scale = 2.0 ** math.ceil(math.log2(reach)) if reach > 1 else 1.0
    return Gen((grad, list(sizes), dim, size, step), ulps=overlap * scale, kind=kind)


GENERATORS: dict[str, Callable[[random.Random, torch.device], Gen]] = {
    "copy_": gen_copy_,
    "_to_copy": gen_to_copy,
    "index_copy_": gen_index_copy,
    "index_copy": gen_index_copy,
    "index_select": gen_index_select,
    "repeat_interleave.Tensor": gen_repeat_tensor,
    "repeat_interleave.self_Tensor": gen_repeat_self_tensor,
    "repeat_interleave.self_int": gen_repeat_self_int,
    "group_norm": gen_group_norm,
    "native_group_norm": gen_native_group_norm,
    "native_group_norm_backward": gen_native_group_norm_backward,
    "unfold": gen_unfold,
    "unfold_backward": gen_unfold_backward,
}
