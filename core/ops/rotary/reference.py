"""The reference of ``flaggems::rotary_embedding(q, k, cos, sin, unsqueeze_dim=1, interleaved=False)``.

``x * cos + rotate(x) * sin`` for both, ``cos``/``sin`` unsqueezed at
``unsqueeze_dim``; ``rotate`` is Llama's rotate-half (``cat(-x2, x1)`` of the two
halves) or, ``interleaved``, GPT-J's rotation of each pair.
"""

from __future__ import annotations

import torch

from flaggems.families import Defined


def rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The rotation rotary embedding multiplies by ``sin``: rotate-half, or each pair (``interleaved``)."""
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1,
                     interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of ``flaggems::rotary_embedding``: ``q`` and ``k`` rotated by the angles of ``cos``/``sin``."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate(q, interleaved) * sin, k * cos + rotate(k, interleaved) * sin


DEFINED = (
    Defined("rotary_embedding(Tensor q, Tensor k, Tensor cos, Tensor sin, int unsqueeze_dim=1, "
            "bool interleaved=False) -> (Tensor, Tensor)", rotary_embedding),
)
