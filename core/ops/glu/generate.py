"""The glu family's random case generators (the randomized kit): ``flaggems::silu_mul``, ``gelu_tanh_mul``
and ``gelu_mul``.

What they draw: :mod:`flaggems.testing._generators_fused`; tolerances: the registered cases'
(:mod:`flaggems.ops.glu.cases`).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from ...testing import _generators_fused as fused
from ...testing._generators import Gen, randn
from ...testing._generators_fused import BF16, DTYPES, F32, F64, RELAYOUT_SHARE
from ...testing._inputs import GRAD_SHARE

#: Intermediate sizes: tiny, odd, powers of two and not.
INTERMEDIATE = (1, 3, 16, 37, 64, 96, 128, 300, 688)


def _glu_case(rng: random.Random, dev: torch.device, op: str) -> Gen:
    """One case of ``act(gate) * up`` (``op``: the fused op's name, for its tolerances)."""
    from .cases import ULPS

    dtype = rng.choices((*DTYPES, F64), (4, 4, 4, 0.3))[0]
    inner = rng.choice(INTERMEDIATE)
    rank0 = rng.random() < 0.03
    shape = () if rank0 else (*fused.lead_shape(rng, 0, 3, 2 * inner), inner)
    relayout = rng.random() < RELAYOUT_SHARE
    how = rng.choices(("merged", "alike", "independent"), (3, 3, 4))[0] if not relayout else "relayout"
    scale = rng.choice((2.0, 2.0, 2.0, 12.0))  # 12: gates in the activations' tails
    if how == "merged" and shape:
        layout = fused.pick_layout(rng, len(shape), ("column-stride", "transposed-last", "expanded"))
        proj = fused.laid_out(rng, (*shape[:-1], 2 * inner), dtype, dev, layout, scale)
        gate, up = proj.chunk(2, -1)
        kind = f"{fused.short(dtype)} merged"
    else:
        ghow = "relayout" if relayout else fused.pick_layout(rng, len(shape))
        uhow = ghow if how in ("alike", "relayout") else fused.pick_layout(rng, len(shape))
        state = rng.getstate()
        gate = fused.laid_out(rng, shape, dtype, dev, ghow, scale)
        if how == "alike":
            rng.setstate(state)  # the same draws: ``up`` laid out exactly as ``gate``
        up = fused.laid_out(rng, shape, dtype, dev, uhow)
        kind = f"{fused.short(dtype)} gate={ghow} up={uhow}"
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
    gate, up = fused._leaf(gate), fused._leaf(up)
    if rng.random() < GRAD_SHARE:
        if rng.random() < 0.5:
            fused.requires_grad(gate, up)
        else:  # only one side: the backward then computes only that gradient
            fused.requires_grad(gate)
        kind += " grad"
    args, kwargs = fused._by_keyword(rng, [gate, up], ("gate", "up"), rng.randint(0, 2))
    return fused._gen(args, kwargs, ulps=float(ULPS[op].get(dtype, 4)),
                      fixed=fused.fixed_positions(tuple(args), kwargs, not relayout), kind=kind)


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


GENERATORS: dict[str, Callable[[random.Random, torch.device], Gen]] = {
    "flaggems::silu_mul": gen_silu_mul,
    "flaggems::gelu_tanh_mul": gen_gelu_tanh_mul,
    "flaggems::gelu_mul": gen_gelu_mul,
}
