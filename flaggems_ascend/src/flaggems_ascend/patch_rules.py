"""Ascend's patch rules: where diffusers takes torch_npu's own path on an NPU, :func:`flaggems.patch` leaves it."""

from __future__ import annotations

import inspect
from typing import Any


def npu_geglu(module: Any) -> str | None:
    """diffusers' ``GEGLU`` calls ``torch_npu.npu_geglu`` (a tanh GELU) on an NPU: patching it with
    ``flaggems::gelu_mul`` (the exact GELU) would change what the model computes there."""
    try:
        source = inspect.getsource(type(module).forward)
        from diffusers.utils import is_torch_npu_available
    except (ImportError, OSError, TypeError):  # no diffusers NPU branch to follow, or no source to read
        return None
    if "is_torch_npu_available()" in source and is_torch_npu_available():
        return "on an NPU diffusers calls torch_npu's npu_geglu (a tanh GELU) instead"
    return None
