"""Contract cases of ``flaggems::group_norm_silu`` (``silu(group_norm(x))``, diffusers' ResnetBlock2D).

Arguments as the schema takes them: ``group_norm_silu(input, num_groups,
weight, bias, eps)``. The group norm's shapes (:data:`.native.SHAPES`:
group sizes that are not powers of two, one group, one channel a group,
``[N, C]``, ``[N, C, L]`` and 5-D inputs, every dtype, with and without
weight and bias), the UNet's own (320 channels in 32 groups, fp16,
channels_last), channels_last and channels_last_3d inputs, strided and
offset inputs (read in place), size-1 dimensions, a strided weight, biases
that push the SiLU into its tails, inputs that require grad (the forward of
the autograd path), and calls the kernels decline (fp64; on CPU, where the
reference takes it, a half input with fp32 affine parameters is served) or
the reference rejects (its errors).

Strides are compared on CPU only: there the reference returns the input's
suggested memory format, as flaggems does on every device; torch's composite
elsewhere copies a channels_last input and returns a contiguous output
(:mod:`flaggems.fronts.group_norm_silu`). The randomized kit re-lays the
inputs out, so this holds for every case.

Tolerances, in units of the output dtype's last place (``rtol = atol``):
the group norm's (:mod:`.native`: fp32 64, 256 where the mean is 100),
the SiLU adding less than one ulp of its input (``|silu'| <= 1.1``); fp16 and
bfloat16 4: the reference rounds the normalised value to the half type
before the SiLU and again after it, the kernel rounds once (measured on the
CPU interpreter: fp16 1.5, bfloat16 2 including its truncating store, for
which the kit adds one ulp).
"""

from __future__ import annotations

import torch

from flaggems.testing import Case

from .native import BF16, CL, CL3D, EPS, F16, F32, FORWARD_ULPS, NATIVE_TAKES_CHANNELS_LAST, SHAPES, _randn

OP = "flaggems::group_norm_silu"


def _params(C: int, dtype: torch.dtype, dev: torch.device, weight: bool, bias: bool, bias_shift: float = 0.0,
            strided: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    w = b = None
    if weight:
        w = _randn((3 * C,) if strided else (C,), dtype, dev, scale=0.5, shift=1.0)
        w = w[::3] if strided else w
    if bias:
        b = _randn((C,), dtype, dev, scale=0.5, shift=bias_shift)
    return w, b


def case(name: str, shape: tuple[int, ...], groups: int, dtype: torch.dtype = F32,
         fmt: torch.memory_format | None = None, weight: bool = True, bias: bool = True,
         param_dtype: torch.dtype | None = None, eps: float = EPS, shift: float = 0.0, bias_shift: float = 0.0,
         strided_weight: bool = False, grad: bool = False, **kw) -> Case:
    """A case on ``randn`` input of ``shape`` (``shift`` moves the mean away from 0, ``bias_shift`` the SiLU's
    input; ``grad``: every tensor requires grad)."""

    def make(dev):
        x = _randn(shape, dtype, dev, fmt, shift=shift)
        w, b = _params(shape[1], param_dtype or dtype, dev, weight, bias, bias_shift, strided_weight)
        if grad:
            for t in (x, w, b):
                if t is not None:
                    t.requires_grad_()
        return (x, groups, w, b, eps), {}

    kw.setdefault("ulps", FORWARD_ULPS[dtype])
    kw.setdefault("check_strides", NATIVE_TAKES_CHANNELS_LAST)
    return Case(name, make, **kw)


def _strided(dev):
    """Every other column of a wider input: not dense, read in place."""
    x = _randn((2, 6, 4, 10), F32, dev)[..., ::2]
    return (x, 3, *_params(6, F32, dev, True, True), EPS), {}


def _offset(dev):
    """A sample of a larger batch: a storage offset, channels_last."""
    x = _randn((3, 16, 3, 5), F16, dev, CL)[1:]
    return (x, 4, *_params(16, F16, dev, True, True), EPS), {}


def _cases():
    for name, shape, groups, options in SHAPES:
        yield case(name, shape, groups, **options)
    yield case("unet-c320-g32-f16", (1, 320, 2, 3), 32, F16)
    yield case("channels-last", (2, 6, 4, 4), 3, fmt=CL)
    yield case("channels-last-unet-c320-g32-f16", (1, 320, 2, 3), 32, F16, fmt=CL)
    yield case("channels-last-c48-g16-bf16", (2, 48, 3, 5), 16, BF16, fmt=CL)
    yield case("channels-last-no-affine", (2, 12, 3, 3), 4, fmt=CL, weight=False, bias=False)
    yield case("channels-last-3d", (2, 8, 2, 3, 4), 2, fmt=CL3D)
    yield case("channels-last-several-chunks", (1, 4, 64, 48), 2, fmt=CL)
    yield case("several-chunks-per-channel", (1, 2, 96, 96), 1)
    yield case("spatial-1x1", (2, 6, 1, 1), 2)
    yield case("size-1-dims", (1, 6, 1, 5), 3, fmt=CL)
    yield case("batch-1-height-1-f16", (1, 8, 1, 7), 2, F16)
    yield case("strided-weight", (2, 6, 3, 3), 3, F16, strided_weight=True)
    yield case("tails-bias-plus-20", (2, 6, 3, 3), 3, bias_shift=20.0)
    yield case("tails-bias-minus-20", (2, 6, 3, 3), 3, bias_shift=-20.0)
    yield case("tails-bias-minus-90-f16", (2, 6, 3, 3), 3, F16, bias_shift=-90.0)
    yield case("requires-grad", (2, 6, 3, 4), 3, grad=True)
    yield case("requires-grad-channels-last-f16", (2, 8, 3, 3), 4, F16, fmt=CL, grad=True)
    yield case("requires-grad-no-affine", (2, 6, 3, 4), 2, weight=False, bias=False, grad=True)
    yield Case("strided-input", _strided, ulps=FORWARD_ULPS[F32], check_strides=NATIVE_TAKES_CHANNELS_LAST)
    yield Case("offset-input", _offset, ulps=FORWARD_ULPS[F16], check_strides=NATIVE_TAKES_CHANNELS_LAST)
    if NATIVE_TAKES_CHANNELS_LAST:  # mixed dtypes: torch's CPU group norm only (elsewhere it raises)
        yield case("mixed-bf16-input-f32-affine", (2, 6, 4, 4), 3, BF16, param_dtype=F32)
        yield case("mixed-f16-input-f32-weight", (2, 6, 4, 4), 3, F16, param_dtype=F32, bias=False)


def _error_cases():
    shape = (2, 6, 4, 4)
    yield case("error-channels-not-divisible", shape, 4, raises=RuntimeError,
               match="Expected number of channels in input to be divisible by num_groups")
    yield case("error-negative-groups", shape, -1, raises=RuntimeError,
               match="Expected num groups to be greater than 0, got -1")
    # F.group_norm divides C by num_groups first (a Python error): the reference's, through the decline
    yield case("error-zero-groups", shape, 0, raises=ZeroDivisionError)

    def bad(name, make_args, raises, match):
        def make(dev):
            return make_args(dev), {}
        return Case(name, make, raises=raises, match=match)

    def params(weight_shape, bias_shape):
        def args(dev):
            w = None if weight_shape is None else torch.ones(weight_shape, device=dev)
            b = None if bias_shape is None else torch.ones(bias_shape, device=dev)
            return _randn(shape, F32, dev), 3, w, b, EPS
        return args

    yield bad("error-weight-size", params((5,), None), RuntimeError,
              "Expected weight to be a vector of size equal to the number of channels in input")
    yield bad("error-bias-size", params((6,), (5,)), RuntimeError,
              "Expected bias to be a vector of size equal to the number of channels in input")
    yield bad("error-rank-1", lambda dev: (_randn((6,), F32, dev), 3, None, None, EPS), RuntimeError,
              "Expected at least 2 dimensions for input tensor")


def gradient_terms(input: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, eps: float = 1e-5, *,
                   incoming: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the gradients add up (float64 magnitudes). The input's ``rstd * (gz - mean(gz) - n * mean(gz * n))``
    per group (``gz`` the gradient reaching the normalised ``n``: the incoming one through SiLU's derivative
    and the weight) cancels terms far larger than itself where a group's gradient is nearly uniform; the
    weight's and the bias's sum ``dz * n`` and ``dz`` over the batch and the spatial positions."""
    N, C = input.shape[0], input.shape[1]
    x = input.reshape(N, num_groups, -1)
    mean = x.mean(-1, keepdim=True)
    rstd = torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + eps)
    n = ((x - mean) * rstd).reshape(input.shape)
    shape = (1, C) + (1,) * (input.dim() - 2)
    z = n if weight is None else n * weight.reshape(shape)
    if bias is not None:
        z = z + bias.reshape(shape)
    sig = torch.sigmoid(z)
    dz = incoming[0] * sig * (1 + z * (1 - sig))
    gz = dz if weight is None else dz * weight.reshape(shape)
    g, ng = gz.reshape(N, num_groups, -1), n.reshape(N, num_groups, -1)
    cancelled = rstd * (g.abs() + g.mean(-1, keepdim=True).abs() + ng.abs() * (g * ng).mean(-1, keepdim=True).abs())
    terms = {"input": cancelled.reshape(input.shape)}
    spread = (0, *range(2, input.dim()))
    if weight is not None:
        terms["weight"] = (dz * n).abs().sum(spread)
    if bias is not None:
        terms["bias"] = dz.abs().sum(spread)
    return terms


CASES = {OP: list(_cases()) + list(_error_cases())}
GRADIENT_TERMS = {OP: gradient_terms}
