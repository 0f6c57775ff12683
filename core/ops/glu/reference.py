"""The references of the gated MLP products: ``silu_mul(gate, up)``: ``silu(gate) * up``; ``gelu_tanh_mul``:
``gelu(gate, approximate="tanh") * up`` (Gemma); ``gelu_mul``: ``gelu(gate) * up``, the exact (erf) GELU of
diffusers' ``GEGLU``."""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling

from flaggems.families import Defined


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The reference of ``flaggems::silu_mul``: ``silu(gate) * up`` (SwiGLU's product)."""
    return F.silu(gate) * up


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The reference of ``flaggems::gelu_tanh_mul``: ``gelu(gate, approximate="tanh") * up`` (GeGLU's)."""
    return F.gelu(gate, approximate="tanh") * up


def gelu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The reference of ``flaggems::gelu_mul``: ``gelu(gate) * up`` (the exact GELU: diffusers' GEGLU)."""
    return F.gelu(gate) * up


DEFINED = (
    Defined("silu_mul(Tensor gate, Tensor up) -> Tensor", silu_mul),
    Defined("gelu_tanh_mul(Tensor gate, Tensor up) -> Tensor", gelu_tanh_mul),
    Defined("gelu_mul(Tensor gate, Tensor up) -> Tensor", gelu_mul),
)
