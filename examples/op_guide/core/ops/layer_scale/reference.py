"""The reference of ``flaggems::layer_scale(x, gamma)``: ``x * gamma``, as DINOv2's ``Dinov2LayerScale`` computes."""

from __future__ import annotations

import torch

from flaggems.families import Defined


def layer_scale(x: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """``x * gamma``: each channel (the last dimension) of ``x`` scaled by its ``gamma``."""
    return x * gamma


DEFINED = (Defined("layer_scale(Tensor x, Tensor gamma) -> Tensor", layer_scale),)
