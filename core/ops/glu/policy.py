"""The launch policy of the gated activations' kernel (tuning key ``glu``)."""

from __future__ import annotations

from dataclasses import dataclass

from ...toolkit.tuning import IntegerPolicy


@dataclass(frozen=True)
class GluPolicy(IntegerPolicy, key="glu", powers_of_two=("tile",), minimums={"tile": 512, "num_warps": 0}):
    """Tile and warps of the gated activations (``Tuning("glu", {...})``: ``silu_mul``, ``gelu_mul``, ...).

    Attributes:
        tile: elements a program covers on large inputs (a power of two, at least 512: the kernel halves it
            down to 512 while the grid would leave multiprocessors idle).
        num_warps: warps per program; 0 derives them from the tile (16 elements a thread, at most 8).
    """

    tile: int = 2048
    num_warps: int = 0

    def check(self) -> None:
        """Warps 0 or a power of two."""
        if self.num_warps & (self.num_warps - 1):
            raise ValueError(f"tuning glu.num_warps={self.num_warps}: expected 0 or a power of two")


POLICIES = {"glu": GluPolicy}
