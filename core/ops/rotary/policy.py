"""The launch policy of the rotary embedding kernel (tuning key ``rotary_embedding``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...toolkit.tuning import integer_policy


@dataclass(frozen=True)
class RotaryPolicy:
    """Tile and warps of the rotary embedding (``Tuning("rotary_embedding", {...})``).

    Attributes:
        tile: elements of the input a program rotates (rows of the head dimension padded to a power of two).
        num_warps: warps per program.
    """

    tile: int = 2048
    num_warps: int = 4

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> RotaryPolicy:
        """Build a policy from a tuning mapping; raises ``ValueError`` on unknown fields or bad values."""
        return integer_policy(cls, "rotary_embedding", values, ("tile", "num_warps"), {})


POLICIES = {"rotary_embedding": RotaryPolicy}
