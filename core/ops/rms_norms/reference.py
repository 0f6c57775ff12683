"""The references of ``flaggems::rms_norm`` and ``flaggems::add_rms_norm``, as transformers' modules round.

* ``rms_norm(input, weight, eps, weight_offset=0, cast_first=True)``: the mean of
  squares in float32; ``cast_first`` (Llama, Qwen2/3, Mistral) casts the
  normalised values to the input's dtype, then multiplies by the weight (the
  result in their promoted dtype); otherwise (Gemma) multiplies in float32 by
  ``weight + weight_offset`` and casts the product.
* ``add_rms_norm(input, residual, ...)``: ``(rms_norm(input + residual), input +
  residual)``: a layer's residual add and the norm after it.
"""

from __future__ import annotations

import torch

from flaggems.families import Defined


def rms_norm(input: torch.Tensor, weight: torch.Tensor | None, eps: float, weight_offset: float = 0.0,
             cast_first: bool = True) -> torch.Tensor:
    """The reference of ``flaggems::rms_norm`` (see the module docstring)."""
    x = input.float()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return normed.to(input.dtype)
    if cast_first:
        scale = weight + weight_offset if weight_offset else weight
        return scale * normed.to(input.dtype)
    return (normed * (weight.float() + weight_offset)).to(input.dtype)


def add_rms_norm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
                 weight_offset: float = 0.0, cast_first: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of ``flaggems::add_rms_norm``: ``(rms_norm(input + residual), input + residual)``."""
    total = input + residual
    return rms_norm(total, weight, eps, weight_offset, cast_first), total


DEFINED = (
    Defined("rms_norm(Tensor input, Tensor? weight, float eps, float weight_offset=0.0, "
            "bool cast_first=True) -> Tensor", rms_norm),
    Defined("add_rms_norm(Tensor input, Tensor residual, Tensor? weight, float eps, "
            "float weight_offset=0.0, bool cast_first=True) -> (Tensor, Tensor)", add_rms_norm),
)
