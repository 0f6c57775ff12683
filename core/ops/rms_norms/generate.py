"""The rms_norms family's random case generators (the randomized kit): ``flaggems::rms_norm`` and
``flaggems::add_rms_norm``.

What they draw: :mod:`flaggems.testing._generators_fused`; tolerances: the registered cases'
(:mod:`flaggems.ops.rms_norms.cases`, see :func:`rms_ulps`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from ...testing import _generators_fused as fused
from ...testing._generators import Gen, randn
from ...testing._generators_fused import BF16, DTYPES, F16, F32, F64, RELAYOUT_SHARE
from ...testing._inputs import GRAD_SHARE

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
    """The registered cases' tolerance for this mix (:mod:`flaggems.ops.rms_norms.cases`).

    With ``cast_first`` and a weight the output has the promoted dtype; a float32 output of a half input
    multiplies ``round_in(n)``, whose flipped last bit is an ulp of the input's dtype (2**16 float32 ulps for
    bfloat16, 2**13 for float16): two of them, as the ``fp32-weight-bf16-input`` cases allow.

    Under Triton's interpreter a kernel's fp32 -> bfloat16 cast truncates (on a GPU it rounds, as torch
    does). The kit allows one more ulp of a bfloat16 *output* for that; a bfloat16 weight with an offset and
    ``cast_first`` is also rounded *inside* the kernel (``round_w(weight + offset)``), and a float32 output
    then carries that truncation: one bfloat16 ulp of the scale, 2**16 float32 ulps.
    """
    from ...testing import _interpreted
    from .cases import ULPS

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
    shape = (*fused.lead_shape(rng, 0, 3, H), H)
    relayout = rng.random() < RELAYOUT_SHARE
    # a hidden dimension of stride != 1 declines: drawn less often, so that two operands leave cases to serve
    hidden_strided = () if rng.random() < 0.4 else ("transposed-last", "column-stride")
    how = "relayout" if relayout else fused.pick_layout(rng, len(shape), hidden_strided)
    x = fused.laid_out(rng, shape, dtype, dev, how, 2.0)
    weight, wkind = rms_weight(rng, H, dtype, dev)
    offset = rng.choice((0.0, 0.0, 0.0, 1.0))
    cast_first = rng.random() < (0.5 if offset else 0.8)  # Gemma: offset 1 without cast_first
    eps = rng.choice((1e-6, 1e-6, 1e-5, 1e-3, 0.5))
    kind = f"{fused.short(dtype)} H={H} x={how} w={wkind} offset={offset:g} cast_first={cast_first}"
    if add:
        rkind = rng.choices(("layout", "same-layout", "broadcast", "promotes"), (10, 3, 0.5, 0.5))[0]
        rdtype = F32 if rkind == "promotes" and dtype != F32 else (BF16 if rkind == "promotes" else dtype)
        rshape = shape[1:] if rkind == "broadcast" and len(shape) > 1 else shape
        rhow = how if rkind == "same-layout" else (
            "relayout" if relayout else fused.pick_layout(rng, len(rshape), hidden_strided))
        residual = fused.laid_out(rng, rshape, rdtype, dev, rhow)
        kind += f" residual={rkind}:{rhow}"
        tensors = [fused._leaf(x), fused._leaf(residual), fused._leaf(weight)]
        args = [tensors[0], tensors[1], tensors[2], eps, offset, cast_first]
        names, first = ADD_ARGS, 2
    else:
        tensors = [fused._leaf(x), fused._leaf(weight)]
        args = [tensors[0], tensors[1], eps, offset, cast_first]
        names, first = RMS_ARGS, 1
    if rng.random() < GRAD_SHARE:
        fused.requires_grad(*tensors)
        kind += " grad"
    args = fused.trim_defaults(rng, args, (0.0, True))
    args, kwargs = fused._by_keyword(rng, args, names, rng.randint(first, len(args)))
    return fused._gen(args, kwargs, ulps=rms_ulps(dtype, weight, offset, cast_first),
                      fixed=fused.fixed_positions(tuple(args), kwargs, not relayout), kind=kind)


def gen_rms_norm(rng: random.Random, dev: torch.device) -> Gen:
    """``flaggems::rms_norm(input, weight, eps, weight_offset=0.0, cast_first=True)``."""
    return _rms_case(rng, dev, add=False)


def gen_add_rms_norm(rng: random.Random, dev: torch.device) -> Gen:
    """``flaggems::add_rms_norm(input, residual, weight, eps, weight_offset=0.0, cast_first=True)``."""
    return _rms_case(rng, dev, add=True)


GENERATORS: dict[str, Callable[[random.Random, torch.device], Gen]] = {
    "flaggems::rms_norm": gen_rms_norm,
    "flaggems::add_rms_norm": gen_add_rms_norm,
}
