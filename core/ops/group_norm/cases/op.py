"""Contract cases of ``aten::group_norm`` (``F.group_norm`` / ``nn.GroupNorm``).

Arguments exactly as the aten schema takes them:
``group_norm(input, num_groups, weight, bias, eps, cudnn_enabled)``. The kit
compares the forward output (gradients are tested in
``tests/test_generic_group_norm_op.py``); inputs, tolerances and group sizes
as for ``native_group_norm`` (see :mod:`.native`).

Channels_last inputs are valid everywhere (torch's composite copies them
before its kernel). flaggems returns them channels_last; torch does on CPU
but returns a contiguous output on CUDA, so their strides are compared only
where torch keeps the format. Empty inputs go to torch's composite (the
kernels decline them); invalid arguments too, so the errors are torch's.
"""

from __future__ import annotations

import torch

from flaggems.testing import Case

from .native import (
    BF16,
    CL,
    CL3D,
    EPS,
    ERROR_SHAPE,
    F16,
    F32,
    F64,
    FORWARD_ULPS,
    GROUPS_ERRORS,
    NATIVE_TAKES_CHANNELS_LAST,
    SHAPES,
    _affine,
    _randn,
)


def case(name: str, shape: tuple[int, ...], groups: int, dtype: torch.dtype = F32,
         fmt: torch.memory_format | None = None, weight: bool = True, bias: bool = True,
         param_dtype: torch.dtype | None = None, eps: float = EPS, shift: float = 0.0, **kw) -> Case:
    """A case on ``randn`` input of ``shape`` (``shift`` moves the mean away from 0)."""

    def make(dev):
        x = _randn(shape, dtype, dev, fmt, shift=shift)
        w, b = _affine(shape[1], param_dtype or dtype, dev, weight, bias)
        return (x, groups, w, b, eps, True), {}

    kw.setdefault("ulps", FORWARD_ULPS[dtype])
    if fmt is not None:
        kw.setdefault("check_strides", NATIVE_TAKES_CHANNELS_LAST)
    return Case(name, make, **kw)


def _cases():
    for name, shape, groups, options in SHAPES:
        yield case(name, shape, groups, **options)
    yield case("channels-last", (2, 6, 4, 4), 3, fmt=CL)
    yield case("channels-last-c48-g16", (2, 48, 3, 5), 16, fmt=CL)
    yield case("channels-last-unet-c320-g32-f16", (1, 320, 2, 3), 32, F16, fmt=CL)
    yield case("channels-last-bf16", (2, 16, 3, 3), 4, BF16, fmt=CL)
    yield case("channels-last-3d", (2, 8, 2, 3, 4), 2, fmt=CL3D)
    yield case("channels-last-one-group-f64", (2, 6, 3, 3), 1, F64, fmt=CL)
    if NATIVE_TAKES_CHANNELS_LAST:  # mixed dtypes: torch's CPU kernel only
        yield case("mixed-bf16-input-f32-affine", (2, 6, 4, 4), 3, BF16, param_dtype=F32)

    def sliced(dev):  # not dense: torch's composite copies it; flaggems reads it in place
        x = _randn((2, 6, 4, 10), F32, dev)[..., ::2]
        return (x, 3, *_affine(6, F32, dev, True, True), EPS, True), {}
    yield Case("strided-input", sliced, ulps=FORWARD_ULPS[F32])


def _error_cases():
    shape = ERROR_SHAPE
    for name, groups, match in GROUPS_ERRORS:
        yield case(name, shape, groups, raises=RuntimeError, match=match)
    yield case("error-negative-groups", shape, -1, raises=RuntimeError,
               match="Expected num groups to be greater than 0, got -1")

    def bad(name, make_args, raises, match):
        def make(dev):
            return make_args(dev), {}
        return Case(name, make, raises=raises, match=match)

    def params(weight_shape, bias_shape, dtype=F32):
        def args(dev):
            w = None if weight_shape is None else torch.ones(weight_shape, device=dev, dtype=dtype)
            b = None if bias_shape is None else torch.ones(bias_shape, device=dev, dtype=dtype)
            return _randn(shape, F32, dev), 3, w, b, EPS, True
        return args

    yield bad("error-weight-size", params((5,), None), RuntimeError,
              "Expected weight to be a vector of size equal to the number of channels in input, but got "
              "weight of shape [5] and input of shape [2, 6, 4, 4]")
    yield bad("error-weight-2d", params((6, 1), None), RuntimeError, "but got weight of shape [6, 1]")
    yield bad("error-bias-size", params((6,), (5,)), RuntimeError,
              "Expected bias to be a vector of size equal to the number of channels in input")
    yield bad("error-bias-size-no-weight", params(None, (4,)), RuntimeError, "but got bias of shape [0]")
    yield bad("error-rank-1", lambda dev: (_randn((6,), F32, dev), 3, None, None, EPS, True), IndexError,
              "Dimension out of range")
    yield bad("error-integer-input", lambda dev: (torch.ones(shape, device=dev, dtype=torch.int32), 3, None, None,
                                                  EPS, True), (RuntimeError, NotImplementedError), None)


CASES = {"group_norm": list(_cases()) + list(_error_cases())}
