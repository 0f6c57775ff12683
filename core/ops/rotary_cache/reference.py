"""The reference of ``flaggems::rotary_cache_append(q, k, v, cos, sin, keys, values, unsqueeze_dim=1)``.

What a transformers attention does between its projections and its attention
function on a ``DynamicCache``: ``q`` and ``k`` rotated (Llama's rotate-half,
``flaggems::rotary_embedding``), then the cache layer's ``update``, which
appends the rotated ``k`` to ``keys`` and ``v`` to ``values`` along the
sequence dimension (``torch.cat(..., dim=-2)``). Returns ``(q_rot, keys',
values')``; the caller stores ``keys'``/``values'`` back in its cache layer.
"""

from __future__ import annotations

import torch

from flaggems.families import Defined


def rotary_cache_append(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        keys: torch.Tensor, values: torch.Tensor,
                        unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference of ``flaggems::rotary_cache_append``: ``(q_rot, cat(keys, k_rot), cat(values, v))``."""
    q_rot, k_rot = torch.ops.flaggems.rotary_embedding(q, k, cos, sin, unsqueeze_dim, False)
    return q_rot, torch.cat([keys, k_rot], dim=-2), torch.cat([values, v], dim=-2)


DEFINED = (
    Defined("rotary_cache_append(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor keys, "
            "Tensor values, int unsqueeze_dim=1) -> (Tensor, Tensor, Tensor)", rotary_cache_append),
)
