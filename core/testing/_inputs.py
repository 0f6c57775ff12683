"""Input builders shared by the contract cases (values valid for every dtype)."""

from __future__ import annotations

import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
ALL_COPY_DTYPES = (*FLOATS, *INTS, torch.bool)
#: Share of the random kit's cases whose differentiable inputs require grad (the kit then compares gradients).
GRAD_SHARE = 0.1


def values(shape: tuple[int, ...], dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """Random values representable in ``dtype`` *and* in every copy target.

    Integers in [0, 100) (valid in uint8/int8; float->int casts of
    out-of-range values are undefined in C++ and differ between devices);
    floats in (-8, 8) with fractions; bool with both values.
    """
    if dtype == torch.bool:
        return torch.rand(shape, device=dev) > 0.5
    if dtype.is_floating_point:
        return (torch.rand(shape, device=dev, dtype=torch.float64) * 16 - 8).to(dtype)
    return torch.randint(0, 100, shape, device=dev, dtype=dtype)


def nonneg_values(shape: tuple[int, ...], dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """Like :func:`values` but non-negative (for float -> unsigned casts)."""
    return values(shape, dtype, dev).abs() if dtype.is_floating_point else values(shape, dtype, dev)


def short_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"`` style labels for case names."""
    return {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32", torch.float64: "f64",
            torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
            torch.bool: "bool"}[dtype]
