"""``flaggems.patch`` routes DINOv2's ``Dinov2LayerScale`` modules through ``flaggems::layer_scale``."""

from __future__ import annotations

import torch
from torch import nn

from flaggems.types import PatchRule


def matches(module: nn.Module) -> bool:
    """A transformers ``Dinov2LayerScale`` (its forward is ``hidden_state * self.lambda1``)."""
    return type(module).__name__ == "Dinov2LayerScale" and "transformers" in type(module).__module__


def decline(module: nn.Module) -> str | None:
    """Why a module of the kind stays as it is (a gamma that is no vector), or ``None``."""
    gamma = getattr(module, "lambda1", None)
    return None if isinstance(gamma, torch.Tensor) and gamma.dim() == 1 else "lambda1 is not a vector"


def forward(module: nn.Module):
    """The patched forward: one call of the fused op (its reference wherever no kernel serves)."""
    def layer_scale_forward(hidden_state: torch.Tensor) -> torch.Tensor:
        return torch.ops.flaggems.layer_scale(hidden_state, module.lambda1)

    return layer_scale_forward


RULES = (PatchRule("layer_scale", matches=matches, decline=decline, forward=forward, label="layer_scale"),)
