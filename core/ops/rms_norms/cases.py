"""Contract cases of ``flaggems::rms_norm`` and ``flaggems::add_rms_norm``.

Arguments as the schemas take them: ``rms_norm(input, weight, eps, weight_offset=0.0,
cast_first=True)`` and ``add_rms_norm(input, residual, weight, eps, weight_offset=0.0,
cast_first=True)``. Inputs as transformers' decoders pass them: hidden states
``[B, S, H]`` (decode: ``S = 1``; prefill), per-head q/k norms over ``[B, S, heads, D]``
(Qwen3) and its transposed ``[B, heads, S, D]`` view, Gemma's ``weight_offset=1``
without ``cast_first``, a float32 weight with bfloat16 activations (autocast),
no weight; hidden sizes from 8 to 20000 (past the whole-row limit: the looped
path), odd ones (896 = Qwen2-0.5B, 1000), several short rows a program. Layouts:
sliced rows (not dense), padded rows (row stride not a multiple of 16),
a residual laid out unlike the input, a strided weight. Calls the kernels
decline (fp64, empty input, a hidden dimension of stride != 1, row dimensions
that do not collapse to three, a residual that broadcasts or promotes) and calls
the reference rejects (its own errors) are cases too.

Tolerances, in units of the output dtype's last place (``rtol = atol``): the
kernels make every rounding the reference makes (``round_in(n)``, the weight
plus offset in the weight's dtype, the product in the output dtype), so they
differ only where ``rstd`` does: the sum of squares in another order, about one
fp32 ulp. After rounding to a 16-bit dtype that flips an occasional last bit of
``round_in(n)``, which the weight multiplies: 2 ulps (measured on the CPU interpreter:
fp16 bit-exact, bfloat16 at most 2.0 including the interpreter's truncating
bfloat16 casts, for which the kit adds one ulp). fp32: 4 (measured 1.0).
"""

from __future__ import annotations

import torch

from flaggems.testing import Case

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
ULPS = {F32: 4, F16: 2, BF16: 2, F64: 4}
EPS = 1e-6
RMS, ADD = "flaggems::rms_norm", "flaggems::add_rms_norm"


def _randn(shape: tuple[int, ...], dtype: torch.dtype, dev: torch.device, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, dtype=torch.float64, device=dev) * scale).to(dtype)


def _weight(H: int, dtype: torch.dtype, dev: torch.device, strided: bool = False) -> torch.Tensor:
    """A trained-looking weight (around 1; Gemma's around 0, used with ``weight_offset=1``)."""
    if strided:
        return (1 + 0.5 * torch.randn(3 * H, dtype=torch.float64, device=dev)).to(dtype)[::3]
    return (1 + 0.5 * torch.randn(H, dtype=torch.float64, device=dev)).to(dtype)


def _layout(x: torch.Tensor, how: str) -> torch.Tensor:
    """``x`` re-laid out: ``heads-transposed`` views ``[B, S, h, D]`` as ``[B, h, S, D]``, ``sliced`` takes
    every other row of a buffer twice as long, ``padded`` rows of a wider buffer (row stride ``H + 3``),
    ``gapped`` every other index of every row dimension, ``hidden-strided`` every other element of each row."""
    if how == "heads-transposed":
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if how == "sliced":
        return torch.cat((x, x), dim=-2)[..., ::2, :] if x.dim() > 1 else x
    if how == "padded":
        wide = torch.nn.functional.pad(x, (0, 3))
        return wide[..., : x.shape[-1]]
    if how == "gapped":  # every row dimension strided with gaps: none merges with another
        for d in range(x.dim() - 1):
            x = torch.cat((x, x), d)
        return x[(slice(None, None, 2),) * (x.dim() - 1)]
    if how == "hidden-strided":
        return torch.stack((x, x), dim=-1)[..., 0]
    return x


def norm(name: str, shape: tuple[int, ...], dtype: torch.dtype = F32, *, weight: str = "same",
         offset: float = 0.0, cast_first: bool = True, eps: float = EPS, layout: str = "", add: bool = False,
         residual_layout: str = "", residual_shape: tuple[int, ...] | None = None,
         residual_dtype: torch.dtype | None = None, **kw) -> Case:
    """A case of either op: ``weight`` is ``"same"`` (the input's dtype), ``"none"``, ``"strided"``,
    ``"broadcast"`` (one element) or a dtype name."""
    H = shape[-1]

    def make(dev):
        x = _layout(_randn(shape, dtype, dev, 2.0), layout)
        if weight == "none":
            w = None
        elif weight == "broadcast":
            w = torch.full((1,), 1.5, dtype=dtype, device=dev)
        else:
            wdtype = dtype if weight in ("same", "strided") else getattr(torch, weight)
            w = _weight(H, wdtype, dev, strided=weight == "strided")
        options = {}
        if offset:
            options["weight_offset"] = offset
        if not cast_first:
            options["cast_first"] = False
        if not add:
            return (x, w, eps), options
        r = _randn(residual_shape or shape, residual_dtype or dtype, dev)
        return (x, _layout(r, residual_layout), w, eps), options

    kw.setdefault("ulps", ULPS[dtype])
    return Case(name, make, **kw)


def _shared(add: bool) -> list[Case]:
    """The cases both ops take (``add``: with a residual of the input's shape)."""
    cases = [
        norm("decode-hidden-1024", (1, 1, 1024), BF16, add=add),
        norm("decode-8-tokens", (8, 1, 2048), BF16, add=add),
        norm("prefill-hidden-896", (2, 5, 896), BF16, add=add),
        norm("hidden-1000-odd", (3, 1000), F32, add=add),
        norm("short-rows-packed", (64, 64), F32, add=add),
        norm("hidden-8", (5, 8), F32, add=add),
        norm("rank-1", (96,), F32, add=add),
        norm("size-1-dims", (1, 3, 1, 128), F32, add=add),
        norm("looped-hidden-20000", (2, 20000), F32, add=add),
        norm("looped-hidden-20000-bf16", (2, 20000), BF16, add=add),
        norm("no-weight", (4, 256), BF16, weight="none", add=add),
        norm("no-weight-fp32", (4, 256), F32, weight="none", add=add),
        norm("gemma-offset", (3, 4, 256), BF16, offset=1.0, cast_first=False, add=add),
        norm("gemma-offset-fp16", (3, 256), F16, offset=1.0, cast_first=False, add=add),
        norm("offset-cast-first", (3, 256), BF16, offset=1.0, add=add),
        norm("eps-honoured", (2, 64), F32, eps=0.5, add=add),
        # float32 output of ``w * round_in(n)``: a flipped last bit of ``round_in(n)`` is an ulp of the input's
        # dtype (2**16 fp32 ulps for bfloat16, 2**13 for fp16); the interpreter's truncating casts flip more.
        norm("fp32-weight-bf16-input", (2, 3, 512), BF16, weight="float32", add=add, ulps=2 * 2**16),
        norm("bf16-weight-fp16-input", (2, 512), F16, weight="bfloat16", add=add, ulps=2 * 2**13),
        norm("fp32-weight-bf16-input-gemma", (2, 512), BF16, weight="float32", cast_first=False, add=add),
        norm("bf16-weight-fp32-input", (2, 512), F32, weight="bfloat16", add=add),
        norm("strided-weight", (4, 128), F16, weight="strided", add=add),
        *(norm(f"dtype-{name}", (4, 7, 256), dtype, add=add)
          for name, dtype in (("f32", F32), ("f16", F16), ("bf16", BF16))),
        norm("qk-norm-heads", (2, 3, 4, 64), BF16, add=add),
        norm("qk-norm-heads-transposed", (2, 3, 4, 64), BF16, layout="heads-transposed", add=add),
        norm("sliced-rows", (2, 6, 128), F32, layout="sliced", add=add),
        norm("padded-rows", (3, 5, 64), F16, layout="padded", add=add),
        # declined by the kernels: the reference computes
        norm("declined-hidden-strided", (3, 64), F32, layout="hidden-strided", add=add),
        norm("declined-fp64", (3, 64), F64, add=add),
        norm("declined-empty", (0, 64), F32, add=add),
        norm("declined-rows-do-not-collapse", (2, 2, 2, 2, 16), F32, layout="gapped", add=add),
        norm("declined-broadcast-weight", (3, 64), F32, weight="broadcast", add=add),
    ]
    return cases


def _errors(add: bool) -> list[Case]:
    """Calls the reference rejects: the kernels decline, the reference raises its error."""
    def bad_weight(dev):
        x, w = _randn((3, 64), F32, dev), torch.ones(48, device=dev)
        return ((x, torch.randn_like(x), w, EPS) if add else (x, w, EPS)), {}

    cases = [Case("error-weight-size", bad_weight, raises=RuntimeError, match="must match the size")]
    if add:
        def bad_residual(dev):
            x = _randn((3, 64), F32, dev)
            return (x, torch.randn(5, 64, device=dev), None, EPS), {}
        cases.append(Case("error-residual-shape", bad_residual, raises=RuntimeError, match="must match the size"))
    return cases


def _add_only() -> list[Case]:
    """Residual layouts and mixes only ``add_rms_norm`` has."""
    return [
        norm("residual-transposed", (2, 3, 4, 64), BF16, add=True, residual_layout="heads-transposed"),
        norm("residual-padded", (3, 5, 64), F32, add=True, residual_layout="padded"),
        norm("input-sliced-residual-dense", (2, 6, 128), F16, add=True, layout="sliced"),
        norm("declined-residual-broadcasts", (2, 3, 64), F32, add=True, residual_shape=(3, 64)),
        norm("declined-residual-promotes", (2, 64), BF16, add=True, residual_dtype=F32),
    ]


def exact(input: torch.Tensor, weight: torch.Tensor | None, eps: float, weight_offset: float = 0.0,
          cast_first: bool = True) -> torch.Tensor:
    """The reference's formula in the inputs' own dtype (the kit's float64 judge: the reference itself
    casts to float32 as transformers does)."""
    normed = input * torch.rsqrt(input.pow(2).mean(-1, keepdim=True) + eps)
    return normed if weight is None else normed * (weight + weight_offset)


def exact_add(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
              weight_offset: float = 0.0, cast_first: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`exact` of the sum, and the sum."""
    total = input + residual
    return exact(total, weight, eps, weight_offset, cast_first), total


def gradient_terms(input: torch.Tensor, weight: torch.Tensor | None, eps: float, weight_offset: float = 0.0,
                   cast_first: bool = True, *, incoming: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the gradients add up (float64 magnitudes): the input's ``rstd * (gn - n * mean(gn * n))`` cancels
    ``rstd * |gn|`` against ``rstd * |n * mean(gn * n)|`` (at a hidden size of 1 the answer is
    ``eps * rstd**2`` of them); the weight's sums ``g * n`` over the rows."""
    rstd = torch.rsqrt(input.pow(2).mean(-1, keepdim=True) + eps)
    n, g = input * rstd, incoming[0]
    gn = g if weight is None else g * (weight + weight_offset)
    cancelled = rstd * (gn.abs() + (n * (gn * n).mean(-1, keepdim=True)).abs())
    terms = {"input": cancelled}
    if weight is not None:
        terms["weight"] = (g * n).abs().sum(tuple(range(input.dim() - 1)))
    return terms


def gradient_terms_add(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
                       weight_offset: float = 0.0, cast_first: bool = True, *,
                       incoming: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """:func:`gradient_terms` of the sum; the input's and the residual's gradients also add the sum's own."""
    terms = gradient_terms(input + residual, weight, eps, weight_offset, cast_first, incoming=incoming[:1])
    summed = terms["input"] + (incoming[1].abs() if len(incoming) > 1 else 0)
    return {**terms, "input": summed, "residual": summed}


CASES = {RMS: [*_shared(False), *_errors(False)], ADD: [*_shared(True), *_errors(True), *_add_only()]}
FLOAT64_REFERENCES = {RMS: exact, ADD: exact_add}
GRADIENT_TERMS = {RMS: gradient_terms, ADD: gradient_terms_add}
