"""The glu family's record (:class:`flaggems.families.OpSpec`)."""

from __future__ import annotations

from flaggems.families import OpSpec

SPEC = OpSpec(
    name="glu",
    ops=("flaggems::silu_mul", "flaggems::gelu_tanh_mul", "flaggems::gelu_mul"),
    order=90,
    fronts=("flaggems.fronts.glu",),
)
