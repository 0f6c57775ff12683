"""Random case generators of flaggems' fused operators (:mod:`flaggems.ops`) for the randomized kit.

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

Tolerances are those of the registered cases (:mod:`flaggems.testing.cases`),
whose docstrings give their derivation and measurements.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from . import _sweep
from ._inputs import GRAD_SHARE

if TYPE_CHECKING:  # imported where used: _generators imports this module at its end to register these
    from ._generators import Gen

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
    """A :class:`~flaggems.testing._generators.Gen` (imported here: that module imports this one)."""
    from ._generators import Gen

    return Gen(tuple(args), dict(kwargs or {}), **fields)


def randn(shape: tuple[int, ...], dtype: torch.dtype, dev: torch.device, scale: float = 1.0,
          shift: float = 0.0) -> torch.Tensor:
    """Normal values drawn in float64 (the same values whatever the dtype), then ``dtype``."""
    return (torch.randn(shape, device=dev, dtype=torch.float64) * scale + shift).to(dtype)


def lead_shape(rng: random.Random, low: int, high: int, row: int, budget: int = MAX_NUMEL) -> tuple[int, ...]:
    """Leading dimensions of rank ``low..high`` whose product times ``row`` stays within ``budget``."""
    while True:
        dims = tuple(rng.choices(LEAD_SIZES, LEAD_WEIGHTS)[0] for _ in range(rng.randint(low, high)))
        if math.prod(dims) * row <= budget:
            return _sweep.grow((*dims, row), range(len(dims)))[:-1]


def size(rng: random.Random, *choices: int) -> int:
    """One of ``choices`` (a size), or 0 now and then (an empty input: declined)."""
    return 0 if rng.random() < 0.04 else rng.choice(choices)


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


# -- rms_norm / add_rms_norm ---------------------------------------------------------------------------------

#: Hidden sizes: tiny, odd, powers of two and not (896 is Qwen2-0.5B's; 1000 an odd one).
HIDDEN = (1, 2, 7, 8, 16, 33, 64, 96, 128, 256, 896, 1000)
RMS_ARGS = ("input", "weight", "eps", "weight_offset", "cast_first")
ADD_ARGS = ("input", "residual", "weight", "eps", "weight_offset", "cast_first")


def rms_weight(rng: random.Random, H: int, dtype: torch.dtype, dev: torch.device) -> tuple[Any, str]:
    """An optional weight around 1 and its label: the input's dtype, float32 with a half input (autocast),
    the other half type, strided, absent; now and then one element (broadcast: declined) or of the wrong
    size (the reference raises)."""
    kind = rng.choices(("same", "none", "float32", "other-half", "bfloat16", "strided", "broadcast",
                        "wrong-size"), (10, 4, 3, 1, 1, 2, 0.5, 0.3))[0]
    if kind == "none":
        return None, kind
    if kind == "broadcast":
        return randn((1,), dtype, dev, 0.5, 1.0), kind
    if kind == "wrong-size":
        return randn((H + 1,), dtype, dev, 0.5, 1.0), kind
    wdtype = dtype
    if kind == "float32":
        wdtype = F32
    elif kind == "other-half":
        wdtype = BF16 if dtype == F16 else F16
    elif kind == "bfloat16":
        wdtype = BF16
    if kind == "strided":
        return randn((2 * H,), wdtype, dev, 0.5, 1.0)[::2], kind
    return randn((H,), wdtype, dev, 0.5, 1.0), kind


def rms_ulps(dtype: torch.dtype, weight: torch.Tensor | None, offset: float, cast_first: bool) -> float:
    """The registered cases' tolerance for this mix (:mod:`flaggems.testing.cases.rms_norm`).

    With ``cast_first`` and a weight the output has the promoted dtype; a float32 output of a half input
    multiplies ``round_in(n)``, whose flipped last bit is an ulp of the input's dtype (2**16 float32 ulps for
    bfloat16, 2**13 for float16): two of them, as the ``fp32-weight-bf16-input`` cases allow.

    Under Triton's interpreter a kernel's fp32 -> bfloat16 cast truncates (on a GPU it rounds, as torch
    does). The kit allows one more ulp of a bfloat16 *output* for that; a bfloat16 weight with an offset and
    ``cast_first`` is also rounded *inside* the kernel (``round_w(weight + offset)``), and a float32 output
    then carries that truncation: one bfloat16 ulp of the scale, 2**16 float32 ulps.
    """
    from . import _interpreted
    from .cases.rms_norm import ULPS

    out = dtype if weight is None or not cast_first else torch.promote_types(weight.dtype, dtype)
    if out == F32 and dtype in (F16, BF16):
        ulps = 2.0 * (2**16 if dtype == BF16 else 2**13)
    else:
        ulps = float(ULPS.get(out, ULPS[F32]))
    if weight is not None and weight.dtype == BF16 and offset and cast_first and out == F32 and _interpreted():
        ulps += 2.0**16
    return ulps


def _rms_case(rng: random.Random, dev: torch.device, add: bool) -> Gen:
    """One case of ``rms_norm`` (``add``: of ``add_rms_norm``, with a residual)."""
    dtype = rng.choices((*DTYPES, F64), (4, 4, 4, 0.3))[0]
    H = rng.choice(HIDDEN)
    shape = (*lead_shape(rng, 0, 3, H), H)
    relayout = rng.random() < RELAYOUT_SHARE
    # a hidden dimension of stride != 1 declines: drawn less often, so that two operands leave cases to serve
    hidden_strided = () if rng.random() < 0.4 else ("transposed-last", "column-stride")
    how = "relayout" if relayout else pick_layout(rng, len(shape), hidden_strided)
    x = laid_out(rng, shape, dtype, dev, how, 2.0)
    weight, wkind = rms_weight(rng, H, dtype, dev)
    offset = rng.choice((0.0, 0.0, 0.0, 1.0))
    cast_first = rng.random() < (0.5 if offset else 0.8)  # Gemma: offset 1 without cast_first
    eps = rng.choice((1e-6, 1e-6, 1e-5, 1e-3, 0.5))
    kind = f"{short(dtype)} H={H} x={how} w={wkind} offset={offset:g} cast_first={cast_first}"
    if add:
        rkind = rng.choices(("layout", "same-layout", "broadcast", "promotes"), (10, 3, 0.5, 0.5))[0]
        rdtype = F32 if rkind == "promotes" and dtype != F32 else (BF16 if rkind == "promotes" else dtype)
        rshape = shape[1:] if rkind == "broadcast" and len(shape) > 1 else shape
        rhow = how if rkind == "same-layout" else (
            "relayout" if relayout else pick_layout(rng, len(rshape), hidden_strided))
        residual = laid_out(rng, rshape, rdtype, dev, rhow)
        kind += f" residual={rkind}:{rhow}"
        tensors = [_leaf(x), _leaf(residual), _leaf(weight)]
        args = [tensors[0], tensors[1], tensors[2], eps, offset, cast_first]
        names, first = ADD_ARGS, 2
    else:
        tensors = [_leaf(x), _leaf(weight)]
        args = [tensors[0], tensors[1], eps, offset, cast_first]
        names, first = RMS_ARGS, 1
    if rng.random() < GRAD_SHARE:
        requires_grad(*tensors)
        kind += " grad"
    args = trim_defaults(rng, args, (0.0, True))
    args, kwargs = _by_keyword(rng, args, names, rng.randint(first, len(args)))
    return _gen(args, kwargs, ulps=rms_ulps(dtype, weight, offset, cast_first),
                fixed=fixed_positions(tuple(args), kwargs, not relayout), kind=kind)


def gen_rms_norm(rng: random.Random, dev: torch.device) -> Gen:
    """``flaggems::rms_norm(input, weight, eps, weight_offset=0.0, cast_first=True)``."""
    return _rms_case(rng, dev, add=False)


def gen_add_rms_norm(rng: random.Random, dev: torch.device) -> Gen:
    """``flaggems::add_rms_norm(input, residual, weight, eps, weight_offset=0.0, cast_first=True)``."""
    return _rms_case(rng, dev, add=True)


# -- rotary_embedding -----------------------------------------------------------------------------------------

ROTARY_ARGS = ("q", "k", "cos", "sin", "unsqueeze_dim", "interleaved")
#: How ``q`` and ``k`` are laid out (and their weights): transformers' transposed views of the projections,
#: ``[B, S, H, D]`` with ``unsqueeze_dim=2``, contiguous ``[B, H, S, D]``, slices of a fused QKV projection,
#: ``[S, H, D]``, a column stride, a storage offset, contiguous for the kit's relayout.
ROTARY_LAYOUTS = (("bhsd-view", 6), ("bshd", 3), ("bhsd-contiguous", 2), ("fused-qkv", 2), ("rank-3", 2),
                  ("column-stride", 1), ("offset", 1), ("relayout", 3))


def rotary_angles(rng: random.Random, batch: int, seq: int, dim: int, dtype: torch.dtype, dev: torch.device,
                  interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` ``[batch, seq, dim]`` as a rotary embedding module builds them (base 10000 or 1e6),
    each sequence starting at a random position (decode)."""
    base = rng.choice((10000.0, 1e6))
    half = (dim + 1) // 2  # an odd head dimension gets angles of its own width (the reference then computes)
    inv_freq = 1.0 / (base ** (torch.arange(0, half, dtype=torch.float64, device=dev) * 2 / max(dim, 1)))
    start = torch.randint(0, 4096, (batch, 1), device=dev).double()
    freqs = (torch.arange(seq, dtype=torch.float64, device=dev) + start)[..., None] * inv_freq
    emb = freqs.repeat_interleave(2, -1) if interleaved else torch.cat((freqs, freqs), -1)
    emb = emb[..., :dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def angle_layout(rng: random.Random, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str]:
    """``cos``/``sin`` laid out alike: contiguous, expanded over the batch, rows of a wider cache, every other
    position of a cache holding each twice; now and then laid out unlike each other (declined)."""
    how = rng.choices(("contiguous", "expanded-batch", "padded", "sliced", "unalike"), (8, 2, 1, 1, 0.5))[0]
    if how == "expanded-batch" and cos.dim() == 3:
        return cos[:1].expand(cos.shape), sin[:1].expand(sin.shape), how
    if how == "padded":
        def pad(t: torch.Tensor) -> torch.Tensor:
            """``t`` as the first columns of rows three elements wider."""
            wide = torch.zeros((*t.shape[:-1], t.shape[-1] + 3), dtype=t.dtype, device=t.device)
            wide[..., : t.shape[-1]] = t
            return wide[..., : t.shape[-1]]
        return pad(cos), pad(sin), how
    if how == "sliced" and cos.dim() >= 2:
        d = cos.dim() - 2
        index = (slice(None),) * d + (slice(None, None, 2),)
        return torch.repeat_interleave(cos, 2, d)[index], torch.repeat_interleave(sin, 2, d)[index], how
    if how == "unalike" and cos.dim() >= 2 and cos.shape[-2] > 1:
        return cos.transpose(-1, -2).contiguous().transpose(-1, -2), sin.contiguous(), how
    return cos.contiguous(), sin.contiguous(), "contiguous"


def gen_rotary_embedding(rng: random.Random, dev: torch.device) -> Gen:
    """``flaggems::rotary_embedding(q, k, cos, sin, unsqueeze_dim=1, interleaved=False)``."""
    from .cases.rotary import ULPS

    dtype = rng.choices((*DTYPES, F64), (4, 4, 4, 0.3))[0]
    interleaved = rng.random() < 0.35
    D = rng.choices((2, 4, 6, 8, 16, 32, 64, 128, 3, 7), (2, 3, 1, 4, 4, 3, 2, 1, 0.3, 0.3))[0]
    layout = rng.choices([n for n, _ in ROTARY_LAYOUTS], [w for _, w in ROTARY_LAYOUTS])[0]
    while True:
        B, S = size(rng, 1, 1, 2, 3), size(rng, 1, 1, 2, 3, 5)
        Hq = rng.choice((1, 2, 3, 4))
        Hkv = rng.choice([h for h in range(1, Hq + 1) if Hq % h == 0])
        if B * S * (Hq + 2 * Hkv) * D <= MAX_NUMEL:
            break
    B, S = _sweep.grow((B, S, (Hq + 2 * Hkv) * D), (0, 1))[:2]  # a sweep's points: other sequence lengths
    ab = rng.choices((B, 1, 2), (6, 3, 0.3))[0]  # angles per sequence, shared ([1, S, D]), growing the batch
    cos, sin = rotary_angles(rng, ab, S, D, dtype, dev, interleaved)
    unsqueeze = rng.choice((1, -3))
    if layout in ("bhsd-view", "relayout", "bhsd-contiguous", "column-stride", "offset"):
        how = {"bhsd-view": "view", "column-stride": "column-stride", "offset": "offset"}.get(layout, "contiguous")
        q, k = (_bhsd(B, S, h, D, dtype, dev, how) for h in (Hq, Hkv))
    elif layout == "bshd":
        q, k = randn((B, S, Hq, D), dtype, dev), randn((B, S, Hkv, D), dtype, dev)
        unsqueeze = rng.choice((2, -2))
    elif layout == "fused-qkv":
        qkv = randn((B, S, (Hq + 2 * Hkv) * D), dtype, dev)
        q = qkv[..., : Hq * D].view(B, S, Hq, D).transpose(1, 2)
        k = qkv[..., Hq * D: (Hq + Hkv) * D].view(B, S, Hkv, D).transpose(1, 2)
    else:  # rank-3: [S, H, D] with cos [S, D]
        q, k = randn((S, Hq, D), dtype, dev), randn((S, Hkv, D), dtype, dev)
        cos, sin = (t[0] for t in rotary_angles(rng, 1, S, D, dtype, dev, interleaved))
        unsqueeze = rng.choice((1, -2))
    cos, sin, ahow = angle_layout(rng, cos, sin)
    odd = rng.choices(("none", "mixed-dtype", "wrong-unsqueeze", "partial", "angles-grad"), (40, 1, 1, 0.5, 0.5))[0]
    if odd == "mixed-dtype":
        cos, sin = cos.to(F32 if dtype != F32 else BF16), sin.to(F32 if dtype != F32 else BF16)
    elif odd == "wrong-unsqueeze":
        unsqueeze = rng.choice((0, 2, 3, -1, 4))
    elif odd == "partial":  # partial rotary (the reference raises: its angles cover only part of D)
        cos, sin = cos[..., : max(D // 2, 1)], sin[..., : max(D // 2, 1)]
    q, k, cos, sin = _leaf(q), _leaf(k), _leaf(cos), _leaf(sin)
    grad = rng.random() < GRAD_SHARE
    if grad:
        requires_grad(q, k)
    if odd == "angles-grad":
        requires_grad(cos, sin)
    args = trim_defaults(rng, [q, k, cos, sin, unsqueeze, interleaved], (1, False))
    args, kwargs = _by_keyword(rng, args, ROTARY_ARGS, rng.randint(2, len(args)))
    kind = (f"{short(dtype)} {layout} B={B} S={S} Hq={Hq} Hkv={Hkv} D={D} angles[{ab}]:{ahow} "
            f"unsqueeze={unsqueeze} interleaved={interleaved}{' ' + odd if odd != 'none' else ''}"
            f"{' grad' if grad else ''}")
    fixed = fixed_positions(tuple(args), kwargs, True)
    if layout == "relayout":  # q and k only: cos and sin laid out unlike each other decline
        fixed = fixed - {0, 1, "q", "k"}
    return _gen(args, kwargs, ulps=float(ULPS.get(dtype, 4)), fixed=fixed, kind=kind)


def _bhsd(B: int, S: int, H: int, D: int, dtype: torch.dtype, dev: torch.device, how: str) -> torch.Tensor:
    """``[B, H, S, D]``: the transposed view of a ``[B, S, H*D]`` projection (``view``), contiguous, every
    other element of wider rows (``column-stride``), or a slice of a larger batch (``offset``)."""
    if how == "view":
        return randn((B, S, H * D), dtype, dev).view(B, S, H, D).transpose(1, 2)
    if how == "column-stride":
        return randn((B, H, S, 2 * D), dtype, dev)[..., ::2]
    if how == "offset":
        return randn((B + 1, H, S, D), dtype, dev)[1:]
    return randn((B, H, S, D), dtype, dev)


# -- silu_mul / gelu_tanh_mul / gelu_mul -------------------------------------------------------------------------------

#: Intermediate sizes: tiny, odd, powers of two and not.
INTERMEDIATE = (1, 3, 16, 37, 64, 96, 128, 300, 688)


def _glu_case(rng: random.Random, dev: torch.device, op: str) -> Gen:
    """One case of ``act(gate) * up`` (``op``: the fused op's name, for its tolerances)."""
    from .cases.glu import ULPS

    dtype = rng.choices((*DTYPES, F64), (4, 4, 4, 0.3))[0]
    inner = rng.choice(INTERMEDIATE)
    rank0 = rng.random() < 0.03
    shape = () if rank0 else (*lead_shape(rng, 0, 3, 2 * inner), inner)
    relayout = rng.random() < RELAYOUT_SHARE
    how = rng.choices(("merged", "alike", "independent"), (3, 3, 4))[0] if not relayout else "relayout"
    scale = rng.choice((2.0, 2.0, 2.0, 12.0))  # 12: gates in the activations' tails
    if how == "merged" and shape:
        proj = laid_out(rng, (*shape[:-1], 2 * inner), dtype, dev,
                        pick_layout(rng, len(shape), ("column-stride", "transposed-last", "expanded")), scale)
        gate, up = proj.chunk(2, -1)
        kind = f"{short(dtype)} merged"
    else:
        ghow = "relayout" if relayout else pick_layout(rng, len(shape))
        uhow = ghow if how in ("alike", "relayout") else pick_layout(rng, len(shape))
        state = rng.getstate()
        gate = laid_out(rng, shape, dtype, dev, ghow, scale)
        if how == "alike":
            rng.setstate(state)  # the same draws: ``up`` laid out exactly as ``gate``
        up = laid_out(rng, shape, dtype, dev, uhow)
        kind = f"{short(dtype)} gate={ghow} up={uhow}"
    if gate.numel() and rng.random() < 0.1 and not _overlaps(gate):
        # special values: overflowing exp, infinities, NaN, written into the gate's own layout
        special = torch.tensor((float("inf"), float("-inf"), float("nan"), 90.0, -90.0), dtype=dtype, device=dev)
        picks = torch.randint(0, special.numel(), gate.shape, device=dev)
        mask = torch.rand(gate.shape, device=dev) < 0.2
        gate.copy_(torch.where(mask, special[picks], gate))
        kind += " special"
    odd = rng.choices(("none", "mixed", "broadcast", "mismatch"), (40, 1, 1, 0.5))[0]
    if odd == "mixed":
        up = up.to(F32 if dtype != F32 else BF16)
    elif odd == "broadcast" and shape:
        up = randn(shape[1:] if len(shape) > 1 else (1,), dtype, dev)
    elif odd == "mismatch" and shape:
        up = randn((*shape[:-1], shape[-1] + 1), dtype, dev)
    kind += f" {shape}{' ' + odd if odd != 'none' else ''}"
    gate, up = _leaf(gate), _leaf(up)
    if rng.random() < GRAD_SHARE:
        if rng.random() < 0.5:
            requires_grad(gate, up)
        else:  # only one side: the backward then computes only that gradient
            requires_grad(gate)
        kind += " grad"
    args, kwargs = _by_keyword(rng, [gate, up], ("gate", "up"), rng.randint(0, 2))
    return _gen(args, kwargs, ulps=float(ULPS[op].get(dtype, 4)), fixed=fixed_positions(tuple(args), kwargs,
                                                                                           not relayout), kind=kind)


def _overlaps(t: torch.Tensor) -> bool:
    """Whether ``t`` has a stride-0 dimension of more than one element (expanded: not writable)."""
    return any(s == 0 and n > 1 for n, s in zip(t.shape, t.stride()))


def gen_silu_mul(rng: random.Random, dev: torch.device) -> Gen:
    """``flaggems::silu_mul(gate, up)``."""
    return _glu_case(rng, dev, "flaggems::silu_mul")


def gen_gelu_tanh_mul(rng: random.Random, dev: torch.device) -> Gen:
    """``flaggems::gelu_tanh_mul(gate, up)``."""
    return _glu_case(rng, dev, "flaggems::gelu_tanh_mul")


def gen_gelu_mul(rng: random.Random, dev: torch.device) -> Gen:
    """``flaggems::gelu_mul(gate, up)``."""
    return _glu_case(rng, dev, "flaggems::gelu_mul")


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
        return _stored_in(order, dims, dtype, dev, 1.0, shift), f"permuted{tuple(order)}"
    if how == "expanded-batch" and dims[0] > 1:
        return randn((1, *dims[1:]), dtype, dev, shift=shift).expand(dims), how
    return randn(dims, dtype, dev, shift=shift), "contiguous"


def gen_group_norm_silu(rng: random.Random, dev: torch.device) -> Gen:
    """``flaggems::group_norm_silu(input, num_groups, weight=None, bias=None, eps=1e-05)``."""
    from ._generators import norm_shape
    from .cases.group_norm import FORWARD_ULPS, NATIVE_TAKES_CHANNELS_LAST

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
    x, w, b = _leaf(x), _leaf(w), _leaf(b)
    grad = rng.random() < GRAD_SHARE
    if grad:
        requires_grad(x, *(p for p in (w, b) if rng.random() < 0.7))
    args = trim_defaults(rng, [x, groups, w, b, eps], (None, None, 1e-5))
    args, kwargs = _by_keyword(rng, args, GNS_ARGS, rng.randint(2, len(args)))
    kind = (f"{short(dtype)}{'/f32-affine' if mixed else ''} {dims} groups={groups} x={how} "
            f"w={'none' if w is None else tuple(w.stride())} b={'none' if b is None else 'yes'}"
            f"{' grad' if grad else ''}")
    return _gen(args, kwargs, ulps=float(FORWARD_ULPS[dtype]), check_strides=NATIVE_TAKES_CHANNELS_LAST,
                fixed=fixed_positions(tuple(args), kwargs, not relayout), kind=kind)


#: The fused ops' generators, by op name as the kit names them (``flaggems::<op>``).
FUSED_GENERATORS: dict[str, Callable[[random.Random, torch.device], Gen]] = {
    "flaggems::rms_norm": gen_rms_norm,
    "flaggems::add_rms_norm": gen_add_rms_norm,
    "flaggems::rotary_embedding": gen_rotary_embedding,
    "flaggems::silu_mul": gen_silu_mul,
    "flaggems::gelu_tanh_mul": gen_gelu_tanh_mul,
    "flaggems::gelu_mul": gen_gelu_mul,
    "flaggems::group_norm_silu": gen_group_norm_silu,
}
