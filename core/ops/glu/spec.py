"""The glu family's record (:class:`flaggems.ops.OpSpec`)."""

from __future__ import annotations

from .._spec import OpSpec

SPEC = OpSpec(
    name="glu",
    ops=("flaggems::silu_mul", "flaggems::gelu_tanh_mul", "flaggems::gelu_mul"),
    order=90,
    fronts=("flaggems.fronts.glu",),
)
