"""The launch policy of the rotary embedding kernel (tuning key ``rotary_embedding``)."""

from __future__ import annotations

from dataclasses import dataclass

from ...toolkit.tuning import IntegerPolicy


@dataclass(frozen=True)
class RotaryPolicy(IntegerPolicy, key="rotary_embedding", powers_of_two=("tile", "num_warps")):
    """Tile and warps of the rotary embedding (``Tuning("rotary_embedding", {...})``).

    Attributes:
        tile: elements of the input a program rotates (rows of the head dimension padded to a power of two).
        num_warps: warps per program.
    """

    tile: int = 2048
    num_warps: int = 4


POLICIES = {"rotary_embedding": RotaryPolicy}
