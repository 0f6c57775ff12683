"""Contract cases of ``aten::native_group_norm`` and ``aten::native_group_norm_backward``.

Arguments exactly as the aten schemas take them:
``native_group_norm(input, weight, bias, N, C, HxW, group, eps)`` and
``native_group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask)``.

Group sizes that are not powers of two (C=320/G=32: 10 channels a group;
C=48/G=16: 3) are the peer library's known failure. Channels-last inputs and
half inputs with fp32 affine parameters are registered only where torch's
native kernel accepts them (CPU: its CUDA kernel requires a contiguous input
and one dtype). A channels_last ``input`` with a contiguous ``grad_out`` is
left out of the backward cases: torch's CPU kernel returns wrong gradients
for it (the generic tests compare it with a float64 autograd reference).

Tolerances, in units of the output dtype's last place (``rtol = atol``),
with the largest error measured on the CPU interpreter against torch's CPU
kernel:

* fp32 forward, 64 (measured 26, on 3-element groups): mean and rstd come
  from reductions in another order (lane-wise Welford merged with Chan's
  formula against torch's cascade sums) and differ by a few ulps;
  ``y = x * a + b`` turns that into errors relative to ``|x * a|``, several
  times ``|y|`` where ``y`` is small. The case whose mean is 100 cancels
  terms of size ~100 and gets 256 (measured 124).
* fp32 backward, 256 (measured 143): ``dbias`` of the 9216-element case sums
  9216 terms; torch's own fp32 result is 121 ulps from the float64 one
  (flaggems' 22), and ``dx`` cancels three terms of size ``|w * rstd * dy|``.
* fp64: the same reorderings, the same budgets in fp64 ulps (measured < 2).
* fp16 / bfloat16, 4 (measured 1.4): both sides compute in fp32 and round
  once, but torch's CUDA kernel normalises with mean/rstd already rounded
  to the half type (its CPU kernel keeps fp32): up to ~|x_hat * w| * 2**-11
  (fp16) more. The CPU interpreter also truncates bfloat16 (the kit adds
  one ulp for that).
"""

from __future__ import annotations

import itertools
import math

import torch

from flaggems.testing import NATIVE_CONTIGUOUS_ON_GPU, Case, device
from flaggems.testing._inputs import short_name

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
CL, CL3D = torch.channels_last, torch.channels_last_3d
EPS = 1e-5
FORWARD_ULPS = {F32: 64, F64: 64, F16: 4, BF16: 4}
BACKWARD_ULPS = {F32: 256, F64: 256, F16: 4, BF16: 4}

#: torch's native kernel accepts channels_last input and mixed dtypes on CPU only.
NATIVE_TAKES_CHANNELS_LAST = device().type == "cpu"


def _randn(shape: tuple[int, ...], dtype: torch.dtype, dev: torch.device, fmt: torch.memory_format | None = None,
           scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    t = (torch.randn(shape, device=dev, dtype=torch.float64) * scale + shift).to(dtype)
    return t if fmt is None else t.contiguous(memory_format=fmt)


def _affine(C: int, dtype: torch.dtype, dev: torch.device, weight: bool, bias: bool):
    w = _randn((C,), dtype, dev, scale=0.5, shift=1.0) if weight else None
    b = _randn((C,), dtype, dev, scale=0.5) if bias else None
    return w, b


def _dims(shape: tuple[int, ...]) -> tuple[int, int, int]:
    return shape[0], shape[1], math.prod(shape[2:])


def forward(name: str, shape: tuple[int, ...], group: int, dtype: torch.dtype = F32,
            fmt: torch.memory_format | None = None, weight: bool = True, bias: bool = True,
            param_dtype: torch.dtype | None = None, eps: float = EPS, shift: float = 0.0, **kw) -> Case:
    """A forward case on ``randn`` input of ``shape`` (``shift`` moves the mean away from 0)."""
    N, C, HxW = _dims(shape)

    def make(dev):
        x = _randn(shape, dtype, dev, fmt, shift=shift)
        w, b = _affine(C, param_dtype or dtype, dev, weight, bias)
        return (x, w, b, N, C, HxW, group, eps), {}

    kw.setdefault("ulps", FORWARD_ULPS[dtype])
    return Case(name, make, **kw)


def _stats(x: torch.Tensor, N: int, group: int, eps: float, dtype: torch.dtype):
    """Mean and rstd of each group, computed in float64 and stored in ``dtype`` (valid backward inputs)."""
    if N == 0:
        empty = x.new_empty((0, group), dtype=dtype)
        return empty, empty.clone()
    grouped = x.double().reshape(N, group, -1)
    mean = grouped.mean(-1)
    rstd = (grouped.var(-1, unbiased=False) + eps).rsqrt()
    return mean.to(dtype), rstd.to(dtype)


def backward(name: str, shape: tuple[int, ...], group: int, dtype: torch.dtype = F32,
             fmt: torch.memory_format | None = None, weight: bool = True, mask: tuple[bool, bool, bool] = (True,) * 3,
             param_dtype: torch.dtype | None = None, dy_dtype: torch.dtype | None = None, **kw) -> Case:
    """A backward case; ``grad_out`` has ``input``'s layout; mean/rstd are exact for ``input``."""
    N, C, HxW = _dims(shape)
    stat_dtype = param_dtype or dtype

    def make(dev):
        x = _randn(shape, dtype, dev, fmt)
        dy = _randn(shape, dy_dtype or dtype, dev, fmt)
        mean, rstd = _stats(x, N, group, EPS, stat_dtype)
        w, _ = _affine(C, stat_dtype, dev, weight, False)
        return (dy, x, mean, rstd, w, N, C, HxW, group, list(mask)), {}

    kw.setdefault("ulps", BACKWARD_ULPS[dtype])
    return Case(name, make, **kw)


#: ``(name, shape, groups, options)`` of the forward cases every group_norm op shares (:mod:`.op`, :mod:`.silu`).
SHAPES = (
    ("contiguous-f32", (2, 6, 4, 4), 3, {}),
    ("c320-g32-ten-channels-a-group", (1, 320, 2, 2), 32, {}),
    ("c48-g16-three-channels-a-group", (2, 48, 3, 5), 16, {}),
    ("one-group", (2, 5, 3, 3), 1, {}),
    ("one-channel-a-group", (2, 7, 5), 7, {}),
    ("input-n-c", (4, 12), 4, {}),
    ("input-n-c-l", (3, 12, 7), 6, {}),
    ("input-5d", (2, 8, 2, 3, 4), 4, {}),
    *((f"dtype-{short_name(dtype)}", (2, 6, 4, 4), 3, {"dtype": dtype}) for dtype in (F16, BF16, F64)),
    ("no-affine", (2, 6, 4, 4), 3, {"weight": False, "bias": False}),
    ("weight-only", (2, 6, 4, 4), 3, {"bias": False}),
    ("bias-only", (2, 6, 4, 4), 3, {"weight": False}),
    ("eps-honoured", (2, 6, 2, 2), 3, {"eps": 0.5}),
    # y = x * a + b cancels terms of size |mean| * rstd ~ 100: both sides err by ulps of 100, not of y.
    ("mean-far-from-zero", (2, 6, 4, 4), 3, {"shift": 100.0, "ulps": 256}),
)


def _forward_cases():
    for name, shape, groups, options in SHAPES:
        yield forward(name, shape, groups, **options)
    yield forward("spatial-1x1", (2, 6, 1, 1), 2)
    yield forward("several-chunks-per-channel", (1, 2, 96, 96), 1)

    def flat(dev):  # torch reads any contiguous tensor of N*C*HxW elements as [N, C, HxW]
        return (_randn((192,), F32, dev), None, None, 2, 6, 16, 3, EPS), {}
    yield Case("flat-input", flat, ulps=FORWARD_ULPS[F32])
    if NATIVE_TAKES_CHANNELS_LAST:
        yield forward("channels-last", (2, 6, 4, 4), 3, fmt=CL)
        yield forward("channels-last-c48-g16", (2, 48, 3, 5), 16, fmt=CL)
        yield forward("channels-last-c320-g32", (1, 320, 2, 3), 32, fmt=CL)
        yield forward("channels-last-3d", (2, 8, 2, 3, 4), 2, fmt=CL3D)
        yield forward("channels-last-bf16", (2, 16, 3, 3), 4, BF16, fmt=CL)
        yield forward("channels-last-several-chunks", (1, 4, 64, 48), 2, fmt=CL)
        yield forward("mixed-bf16-input-f32-affine", (2, 6, 4, 4), 3, BF16, param_dtype=F32)
        yield forward("mixed-f16-input-f32-weight", (2, 6, 4, 4), 3, F16, param_dtype=F32, bias=False)


#: ``(name, groups, message)``: the group counts torch rejects (a ``RuntimeError``) for an input of
#: :data:`ERROR_SHAPE`, whichever group_norm op is called (here and :mod:`.op`).
ERROR_SHAPE = (2, 6, 4, 4)
GROUPS_ERRORS = (
    ("error-channels-not-divisible", 4, "Expected number of channels in input to be divisible by num_groups, but "
                                        "got input of shape [2, 6, 4, 4] and num_groups=4"),
    ("error-zero-groups", 0, "Expected num groups to be greater than 0, got 0"),
)


def _forward_error_cases():
    shape = ERROR_SHAPE
    for name, groups, match in GROUPS_ERRORS:
        yield forward(name, shape, groups, raises=RuntimeError, match=match)

    def bad_param(name, weight_shape, bias_shape, match):
        def make(dev):
            w = None if weight_shape is None else torch.ones(weight_shape, device=dev)
            b = None if bias_shape is None else torch.ones(bias_shape, device=dev)
            return (_randn(shape, F32, dev), w, b, 2, 6, 16, 3, EPS), {}
        return Case(name, make, raises=RuntimeError, match=match)
    yield bad_param("error-weight-size", (5,), None,
                    "Expected weight to be a vector of size equal to the number of channels in input, but got "
                    "weight of shape [5] and input of shape [2, 6, 4, 4]")
    yield bad_param("error-weight-2d", (6, 1), None, "but got weight of shape [6, 1]")
    # torch's message prints the weight's shape for a bad bias ([0] when there is no weight).
    yield bad_param("error-bias-size", (6,), (5,), "Expected bias to be a vector of size equal to the number of "
                    "channels in input, but got bias of shape [6] and input of shape [2, 6, 4, 4]")
    yield bad_param("error-bias-size-no-weight", None, (4,), "but got bias of shape [0]")


def _backward_cases():
    yield backward("contiguous-f32", (2, 6, 4, 4), 3)
    yield backward("c320-g32-ten-channels-a-group", (1, 320, 2, 2), 32)
    yield backward("c48-g16-three-channels-a-group", (2, 48, 3, 5), 16)
    yield backward("input-n-c", (4, 12), 4)
    yield backward("input-n-c-l", (3, 12, 7), 6)
    yield backward("input-5d", (2, 8, 2, 3, 4), 4)
    for dtype in (F16, BF16, F64):
        yield backward(f"dtype-{short_name(dtype)}", (2, 6, 4, 4), 3, dtype)
    for mask in itertools.product((True, False), repeat=3):
        label = "".join("x" if m else "-" for m in mask)
        yield backward(f"output-mask-{label}", (2, 6, 3, 3), 3, mask=mask)
    yield backward("no-weight-dx-only", (2, 6, 4, 4), 3, weight=False, mask=(True, False, False))
    yield backward("several-chunks-per-channel", (1, 2, 96, 96), 1)
    # torch 2.11's CUDA backward kernel misreads channels_last inputs when called directly
    # (seen on an H200: view errors and wrong values); aten::group_norm never does that.
    gpu_native = {"tags": (NATIVE_CONTIGUOUS_ON_GPU,)}
    yield backward("channels-last", (2, 6, 4, 4), 3, fmt=CL, **gpu_native)
    yield backward("channels-last-c320-g32", (1, 320, 2, 3), 32, fmt=CL, **gpu_native)
    yield backward("channels-last-3d", (2, 8, 2, 3, 4), 2, fmt=CL3D, **gpu_native)
    yield backward("channels-last-several-chunks", (1, 4, 64, 48), 2, fmt=CL, **gpu_native)
    if NATIVE_TAKES_CHANNELS_LAST:
        yield backward("mixed-bf16-input-f32-stats", (2, 6, 4, 4), 3, BF16, param_dtype=F32)
    yield backward("error-grad-dtype", (2, 6, 4, 4), 3, dy_dtype=F64, raises=RuntimeError,
                   match="Expected scalar types of X and dY are same.")


CASES = {
    "native_group_norm": list(itertools.chain(_forward_cases(), _forward_error_cases())),
    "native_group_norm_backward": list(_backward_cases()),
}
