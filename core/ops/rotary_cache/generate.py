"""The rotary_cache family's random case generator (the randomized kit): ``flaggems::rotary_cache_append``.

What it draws: rotary's generator's (:mod:`flaggems.ops.rotary.generate`: dtypes, head dimensions, GQA head
counts, angles and their layouts) for ``q``/``k``, with ``v`` laid out as ``k`` and a cache
``keys``/``values`` of a random length (contiguous, every other position of a longer one, the first positions
of a preallocated one, DynamicLayer's 1-D empty first call, or left to the kit's relayout). Values are drawn
in float64 and angles computed in float64, then cast; no float64 reference is registered (as rotary): the
kit's float64 judge runs the op on float64 copies. Tolerances: the registered cases'
(:mod:`flaggems.ops.rotary_cache.cases`).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from ...testing import _generators_fused as fused
from ...testing import _sweep
from ...testing._generators import Gen, randn
from ...testing._generators_fused import BF16, DTYPES, F32, F64
from ...testing._inputs import GRAD_SHARE
from ..rotary.generate import angle_layout, rotary_angles, size

ARGS = ("q", "k", "v", "cos", "sin", "keys", "values", "unsqueeze_dim")
#: How ``q``/``k``/``v`` are laid out (and their weights): transposed views of separate projections, slices
#: of one fused QKV projection, contiguous ``[B, H, S, D]``, a storage offset, contiguous for the kit's relayout.
LAYOUTS = (("bhsd-view", 6), ("fused-qkv", 4), ("bhsd-contiguous", 2), ("offset", 1), ("relayout", 2))
#: How the cache is laid out (and weights): see :func:`cache`.
CACHES = (("contiguous", 8), ("strided", 2), ("preallocated", 1), ("empty-1d", 1), ("relayout", 2))


def projections(B: int, S: int, Hq: int, Hkv: int, D: int, dtype: torch.dtype, dev: torch.device,
                how: str) -> tuple[torch.Tensor, ...]:
    """``q``, ``k``, ``v`` ``[B, H, S, D]``: transposed views of ``[B, S, H*D]`` projections (``bhsd-view``),
    of slices of one fused ``[B, S, (Hq + 2 Hkv) * D]`` (``fused-qkv``), slices of a larger batch (``offset``),
    or contiguous."""
    if how == "fused-qkv":
        qkv = randn((B, S, (Hq + 2 * Hkv) * D), dtype, dev)
        bounds = (0, Hq, Hq + Hkv, Hq + 2 * Hkv)
        return tuple(qkv[..., a * D:b * D].view(B, S, b - a, D).transpose(1, 2) for a, b in zip(bounds, bounds[1:]))
    if how == "bhsd-view":
        return tuple(randn((B, S, h * D), dtype, dev).view(B, S, h, D).transpose(1, 2) for h in (Hq, Hkv, Hkv))
    if how == "offset":
        return tuple(randn((B + 1, h, S, D), dtype, dev)[1:] for h in (Hq, Hkv, Hkv))
    return tuple(randn((B, h, S, D), dtype, dev) for h in (Hq, Hkv, Hkv))


def cache(B: int, H: int, L: int, D: int, dtype: torch.dtype, dev: torch.device, how: str) -> torch.Tensor:
    """``[B, H, L, D]``: contiguous, every other position of a cache twice as long (``strided``), the first
    ``L`` positions of a longer preallocated one (``preallocated``), or DynamicLayer's first call
    (``empty-1d``: ``torch.tensor([], dtype=...)``, whatever ``L``)."""
    if how == "empty-1d":
        return torch.tensor([], dtype=dtype, device=dev)
    if how == "strided":
        return randn((B, H, 2 * L, D), dtype, dev)[:, :, ::2]
    if how == "preallocated":
        return randn((B, H, L + 3, D), dtype, dev)[:, :, :L]
    return randn((B, H, L, D), dtype, dev)


def gen_rotary_cache_append(rng: random.Random, dev: torch.device) -> Gen:
    """``flaggems::rotary_cache_append(q, k, v, cos, sin, keys, values, unsqueeze_dim=1)``."""
    from .cases import ULPS

    dtype = rng.choices((*DTYPES, F64), (4, 4, 4, 0.3))[0]
    D = rng.choices((2, 4, 8, 16, 32, 64, 128, 3, 7), (2, 3, 4, 4, 3, 2, 1, 0.3, 0.3))[0]
    layout = rng.choices([n for n, _ in LAYOUTS], [w for _, w in LAYOUTS])[0]
    how = rng.choices([n for n, _ in CACHES], [w for _, w in CACHES])[0]
    while True:
        B, S = size(rng, 1, 1, 2, 3), size(rng, 1, 1, 1, 2, 5)
        L = rng.choices((0, 1, 2, 3, 5, 7, 9, 17, 33), (0.3, 3, 2, 2, 2, 2, 1, 1, 1))[0]  # 0: declined
        Hq = rng.choice((1, 2, 4, 8))
        Hkv = rng.choice([h for h in range(1, Hq + 1) if Hq % h == 0])
        row = (S * (Hq + 2 * Hkv) + 2 * Hkv) * D  # per batch and cache position, an upper bound of the elements
        if B * max(L, 1) * row <= fused.MAX_NUMEL:
            break
    if B and S:  # a sweep's points: other cache lengths (decode's next steps); an empty call bounds nothing
        B, L = _sweep.grow((B, L, row), (0, 1))[:2]
    ab = rng.choices((B, 1, 2), (6, 3, 0.3))[0]  # angles per sequence, shared ([1, S, D]), growing the batch
    cos, sin, ahow = angle_layout(rng, *rotary_angles(rng, ab, S, D, dtype, dev, False))
    q, k, v = projections(B, S, Hq, Hkv, D, dtype, dev, layout)
    odd = rng.choices(("none", "angle-dtype", "cache-dtype", "cache-heads", "wrong-unsqueeze"), (40, 1, 1, 1, 1))[0]
    cache_dtype = (F32 if dtype != F32 else BF16) if odd == "cache-dtype" else dtype
    heads = Hkv + 1 if odd == "cache-heads" else Hkv  # the reference's cat raises (unless the cache is 1-D empty)
    keys, values = (cache(B, heads, L, D, cache_dtype, dev, how) for _ in range(2))
    if odd == "angle-dtype":
        cos, sin = cos.to(F32 if dtype != F32 else BF16), sin.to(F32 if dtype != F32 else BF16)
    unsqueeze = rng.choice((0, 2, 3, -1, 4)) if odd == "wrong-unsqueeze" else rng.choice((1, -3))
    q, k, v, cos, sin, keys, values = (fused._leaf(t) for t in (q, k, v, cos, sin, keys, values))
    grad = rng.random() < GRAD_SHARE
    if grad:
        fused.requires_grad(q, k, v)
    args = fused.trim_defaults(rng, [q, k, v, cos, sin, keys, values, unsqueeze], (1,))
    args, kwargs = fused._by_keyword(rng, args, ARGS, rng.randint(3, len(args)))
    kind = (f"{fused.short(dtype)} {layout} B={B} S={S} Hq={Hq} Hkv={Hkv} D={D} cache[{L}]:{how} "
            f"angles[{ab}]:{ahow} unsqueeze={unsqueeze}{' ' + odd if odd != 'none' else ''}{' grad' if grad else ''}")
    fixed = fused.fixed_positions(tuple(args), kwargs, True)
    if layout == "relayout":  # q, k, v only: cos and sin laid out unlike each other decline
        fixed = fixed - {0, 1, 2, "q", "k", "v"}
    if how == "relayout":
        fixed = fixed - {5, 6, "keys", "values"}
    return fused._gen(args, kwargs, ulps=float(ULPS.get(dtype, 4)), fixed=fixed, kind=kind)


GENERATORS: dict[str, Callable[[random.Random, torch.device], Gen]] = {
    "flaggems::rotary_cache_append": gen_rotary_cache_append,
}
