"""The reference of ``flaggems::group_norm_silu(input, num_groups, weight=None, bias=None, eps=1e-5)``:
``silu(group_norm(input, num_groups, weight, bias, eps))``, the GroupNorm then SiLU of diffusers'
``ResnetBlock2D`` (twice a block in a UNet)."""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling

from flaggems.families import Defined


def group_norm_silu(input: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """The reference of ``flaggems::group_norm_silu``: ``silu(group_norm(input))`` (a UNet block's norm, activation)."""
    return F.silu(F.group_norm(input, num_groups, weight, bias, eps))


DEFINED = (
    Defined("group_norm_silu(Tensor input, int num_groups, Tensor? weight=None, Tensor? bias=None, "
            "float eps=1e-05) -> Tensor", group_norm_silu),
)
