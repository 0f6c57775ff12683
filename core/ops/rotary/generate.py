"""The rotary family's random case generator (the randomized kit): ``flaggems::rotary_embedding``.

What it draws: :mod:`flaggems.testing._generators_fused`; tolerances: the registered cases'
(:mod:`flaggems.ops.rotary.cases`).
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


def size(rng: random.Random, *choices: int) -> int:
    """One of ``choices`` (a size), or 0 now and then (an empty input: declined)."""
    return 0 if rng.random() < 0.04 else rng.choice(choices)


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
    from .cases import ULPS

    dtype = rng.choices((*DTYPES, F64), (4, 4, 4, 0.3))[0]
    interleaved = rng.random() < 0.35
    D = rng.choices((2, 4, 6, 8, 16, 32, 64, 128, 3, 7), (2, 3, 1, 4, 4, 3, 2, 1, 0.3, 0.3))[0]
    layout = rng.choices([n for n, _ in ROTARY_LAYOUTS], [w for _, w in ROTARY_LAYOUTS])[0]
    while True:
        B, S = size(rng, 1, 1, 2, 3), size(rng, 1, 1, 2, 3, 5)
        Hq = rng.choice((1, 2, 3, 4))
        Hkv = rng.choice([h for h in range(1, Hq + 1) if Hq % h == 0])
        if B * S * (Hq + 2 * Hkv) * D <= fused.MAX_NUMEL:
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
    q, k, cos, sin = fused._leaf(q), fused._leaf(k), fused._leaf(cos), fused._leaf(sin)
    grad = rng.random() < GRAD_SHARE
    if grad:
        fused.requires_grad(q, k)
    if odd == "angles-grad":
        fused.requires_grad(cos, sin)
    args = fused.trim_defaults(rng, [q, k, cos, sin, unsqueeze, interleaved], (1, False))
    args, kwargs = fused._by_keyword(rng, args, ROTARY_ARGS, rng.randint(2, len(args)))
    kind = (f"{fused.short(dtype)} {layout} B={B} S={S} Hq={Hq} Hkv={Hkv} D={D} angles[{ab}]:{ahow} "
            f"unsqueeze={unsqueeze} interleaved={interleaved}{' ' + odd if odd != 'none' else ''}"
            f"{' grad' if grad else ''}")
    fixed = fused.fixed_positions(tuple(args), kwargs, True)
    if layout == "relayout":  # q and k only: cos and sin laid out unlike each other decline
        fixed = fixed - {0, 1, "q", "k"}
    return fused._gen(args, kwargs, ulps=float(ULPS.get(dtype, 4)), fixed=fixed, kind=kind)


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


GENERATORS: dict[str, Callable[[random.Random, torch.device], Gen]] = {
    "flaggems::rotary_embedding": gen_rotary_embedding,
}
