"""The launch policy of the gated activations' kernel (tuning key ``glu``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...toolkit.tuning import integer_policy


@dataclass(frozen=True)
class GluPolicy:
    """Tile and warps of the gated activations (``Tuning("glu", {...})``: ``silu_mul``, ``gelu_mul``, ...).

    Attributes:
        tile: elements a program covers on large inputs (a power of two, at least 512: the kernel halves it
            down to 512 while the grid would leave multiprocessors idle).
        num_warps: warps per program; 0 derives them from the tile (16 elements a thread, at most 8).
    """

    tile: int = 2048
    num_warps: int = 0

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> GluPolicy:
        """Build a policy from a tuning mapping; raises ``ValueError`` on unknown fields or bad values."""
        policy = integer_policy(cls, "glu", values, ("tile",), {"tile": 512, "num_warps": 0})
        if policy.num_warps & (policy.num_warps - 1):
            raise ValueError(f"tuning glu.num_warps={policy.num_warps}: expected 0 or a power of two")
        return policy


POLICIES = {"glu": GluPolicy}
