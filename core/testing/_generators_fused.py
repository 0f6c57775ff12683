"""Shared helpers of the random case generators of flaggems' fused operators (:mod:`flaggems.ops`).

The generators live in their families' folders (``flaggems/ops/<family>/generate.py``); this module holds
what they share: dtypes, leading shapes, layouts, argument spellings, inputs that require grad.

Same contract as :mod:`flaggems.testing._generators`: ``gen(rng, dev) -> Gen``,
every decision (shapes, dtypes, layouts, optional arguments, scalars) from
``rng``, tensor values from torch's generator, so that a case rebuilt from the
same ``rng`` seed keeps its layout and validity and changes only its values.
The expected values are the op's torch reference (its
``CompositeImplicitAutograd`` kernel), which the kit's native side runs for a
``flaggems::`` op as it does for the registered fused cases.

What every generator draws:

* the dtypes the ops declare (float32, float16, bfloat16) and now and then one
  they decline (float64) or a mix the reference promotes;
* leading shapes of rank 0 to 3 with size-1 and size-0 dimensions;
* layouts built here as transformers and diffusers make them (transposed head
  views of a projection, halves of a merged projection, sliced and padded rows,
  storage offsets, dense permutations, expanded stride-0 dimensions, a column
  stride, channels_last): these arguments are ``fixed``, so the kit's relayout
  keeps them. About a fifth of the cases leave their tensors contiguous and
  unfixed instead: the kit re-lays them out into poisoned buffers;
* the optional arguments (a weight or not, its dtype and stride, ``eps``,
  ``weight_offset``/``cast_first``, ``unsqueeze_dim``, ``interleaved``), some
  passed by keyword;
* inputs that require grad (the autograd path, forward and backward);
* calls the kernels cannot take (hidden stride != 1, empty inputs, odd head
  dimensions, rows that do not collapse, promoting or broadcasting operands)
  and calls the reference rejects: those are left to the op, which declines
  them (the kit counts declines) or raises the reference's error.

The ops have no separate backward operators in the contract: their backwards
are :class:`flaggems.autograd.Derivative` records reached through autograd
only. A case that requires grad runs the forward that records them, and the
kit then runs the backward through the dispatcher (planned on the first call,
replayed on the second) and compares the gradients with the reference's.

Tolerances are those of the registered cases (each family's ``cases``),
whose docstrings give their derivation and measurements.
"""

from __future__ import annotations

import math
import random
from typing import Any

import torch

from . import _sweep
from ._generators import Gen, randn

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
#: The dtypes every fused op declares (the plugin's ``OpImpl(..., dtypes=...)``).
DTYPES = (F32, F16, BF16)
#: The largest tensor a generator builds (Triton's interpreter is slow): ``_generators.MAX_NUMEL``'s budget.
MAX_NUMEL = 2048
#: Sizes of a random leading dimension (0 and 1 on purpose) and their weights: an empty input is declined,
#: so size 0 comes now and then only.
LEAD_SIZES = (0, 1, 2, 3, 4, 5)
LEAD_WEIGHTS = (0.3, 3, 2, 2, 1, 1)
#: Share of cases left contiguous and unfixed, for the kit's own relayout.
RELAYOUT_SHARE = 0.2


def _gen(args: tuple, kwargs: dict | None = None, **fields: Any) -> Gen:
    """A :class:`~flaggems.testing._generators.Gen` of ``args`` (a tuple) and ``kwargs`` (a new dict)."""
    return Gen(tuple(args), dict(kwargs or {}), **fields)


def lead_shape(rng: random.Random, low: int, high: int, row: int, budget: int = MAX_NUMEL) -> tuple[int, ...]:
    """Leading dimensions of rank ``low..high`` whose product times ``row`` stays within ``budget``."""
    while True:
        dims = tuple(rng.choices(LEAD_SIZES, LEAD_WEIGHTS)[0] for _ in range(rng.randint(low, high)))
        if math.prod(dims) * row <= budget:
            return _sweep.grow((*dims, row), range(len(dims)))[:-1]


def short(dtype: torch.dtype) -> str:
    """``bf16``-style label of a dtype for the case's ``kind``."""
    from ._inputs import short_name

    return short_name(dtype)


# -- layouts -------------------------------------------------------------------------------------------------

#: Layouts :func:`laid_out` builds, and their weights; ``contiguous`` is also the relayout kit's starting point.
LAYOUTS = (("contiguous", 3), ("offset", 2), ("sliced-rows", 3), ("padded-rows", 2), ("permuted", 2),
           ("transposed-last", 1), ("column-stride", 1), ("expanded", 2), ("gapped", 1))


def pick_layout(rng: random.Random, rank: int, exclude: tuple[str, ...] = ()) -> str:
    """A layout of :data:`LAYOUTS` that means something at ``rank``."""
    usable = {"contiguous"}
    if rank >= 1:
        usable |= {"offset", "padded-rows", "column-stride", "expanded"}
    if rank >= 2:
        usable |= {"sliced-rows", "permuted", "transposed-last", "gapped"}
    names = [name for name, _ in LAYOUTS if name in usable and name not in exclude]
    weights = [w for name, w in LAYOUTS if name in names]
    return rng.choices(names, weights)[0]


def laid_out(rng: random.Random, shape: tuple[int, ...], dtype: torch.dtype, dev: torch.device, how: str,
             scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    """Random values of ``shape`` in the layout ``how`` (the view's shape is ``shape``, whatever ``how``).

    * ``offset``: ``base[1:]`` of a tensor one larger in dimension 0 (a storage offset);
    * ``sliced-rows``: every other index of one leading dimension (rows not dense, as ``x[:, ::2]``);
    * ``padded-rows``: ``base[..., :n]`` of rows a few elements wider (row stride not ``n``);
    * ``permuted``: a dense tensor stored in another order of its leading dimensions (``.transpose(1, 2)`` of
      a projection's heads, channels_last for rank 4);
    * ``transposed-last``: the last dimension swapped with another (a hidden dimension of stride != 1);
    * ``column-stride``: ``base[..., ::2]`` (every other element of each row);
    * ``expanded``: one dimension of size 1 expanded (stride 0);
    * ``gapped``: every leading dimension sliced with a step of 2 (none merges with its neighbour);
    * anything else (``contiguous``, ``relayout``: left to the kit's relayout): a contiguous tensor.
    """
    rank = len(shape)
    if how == "offset" and rank:
        return randn((shape[0] + 1, *shape[1:]), dtype, dev, scale, shift)[1:]
    if how == "sliced-rows" and rank >= 2:
        d = rng.randrange(rank - 1)
        wide = list(shape)
        wide[d] *= 2
        index = (slice(None),) * d + (slice(None, None, 2),)
        return randn(tuple(wide), dtype, dev, scale, shift)[index]
    if how == "padded-rows" and rank:
        pad = rng.choice((1, 3, 5, 16))
        return randn((*shape[:-1], shape[-1] + pad), dtype, dev, scale, shift)[..., : shape[-1]]
    if how == "permuted" and rank >= 2:
        order = list(range(rank - 1))
        rng.shuffle(order)
        order.append(rank - 1)
        return _stored_in(order, shape, dtype, dev, scale, shift)
    if how == "transposed-last" and rank >= 2:
        order = list(range(rank))
        d = rng.randrange(rank - 1)
        order[d], order[-1] = order[-1], order[d]
        return _stored_in(order, shape, dtype, dev, scale, shift)
    if how == "column-stride" and rank:
        return randn((*shape[:-1], 2 * shape[-1]), dtype, dev, scale, shift)[..., ::2]
    if how == "expanded" and rank:
        d = rng.randrange(rank)
        one = tuple(1 if i == d else n for i, n in enumerate(shape))
        return randn(one, dtype, dev, scale, shift).expand(shape)
    if how == "gapped" and rank >= 2:
        wide = tuple(2 * n for n in shape[:-1]) + (shape[-1],)
        return randn(wide, dtype, dev, scale, shift)[(slice(None, None, 2),) * (rank - 1)]
    return randn(shape, dtype, dev, scale, shift)


def _stored_in(order: list[int], shape: tuple[int, ...], dtype: torch.dtype, dev: torch.device, scale: float,
               shift: float) -> torch.Tensor:
    """A dense tensor of ``shape`` whose storage runs through its dimensions in ``order`` (outermost first)."""
    stored = randn(tuple(shape[d] for d in order), dtype, dev, scale, shift)
    inverse = [order.index(d) for d in range(len(order))]
    return stored.permute(inverse)


def requires_grad(*tensors: torch.Tensor | None) -> None:
    """Mark each floating-point tensor (a leaf, see :func:`_leaf`) as requiring grad, in place: its layout
    stays, and the kit's relayout leaves it as it is."""
    for t in tensors:
        if t is not None and t.dtype.is_floating_point:
            t.requires_grad_()


def _leaf(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` detached: a leaf with ``t``'s layout that may then require grad."""
    return None if t is None else t.detach()


def fixed_positions(args: tuple, kwargs: dict, keep: bool) -> frozenset:
    """Every tensor argument's position or name when ``keep`` (its layout is the case), else none."""
    if not keep:
        return frozenset()
    found = {i for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
    found |= {k for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    return frozenset(found)


def _same(value: Any, default: Any) -> bool:
    """Whether an argument is its schema default (``None``, or a scalar of the default's type and value)."""
    if value is None or default is None:
        return value is default
    return not isinstance(value, torch.Tensor) and type(value) is type(default) and value == default


def trim_defaults(rng: random.Random, args: list, defaults: tuple) -> list:
    """Leave out trailing arguments equal to their schema defaults (``defaults``: those of the last
    parameters), half of the time: the implementations must take the shortened calls too."""
    if rng.random() < 0.5:
        return args
    first = len(args) - len(defaults)
    while len(args) > first and _same(args[-1], defaults[len(args) - 1 - first]):
        args = args[:-1]
    return args


def _by_keyword(rng: random.Random, args: list, names: tuple[str, ...], first: int) -> tuple[list, dict]:
    """Pass the arguments from position ``first`` on by keyword, half of the time (the dispatcher and the
    implementations must take both spellings)."""
    if rng.random() < 0.5 or first >= len(args):
        return args, {}
    return args[:first], dict(zip(names[first:], args[first:]))
