"""The layer_scale family's record (:class:`flaggems.ops.OpSpec`)."""

from __future__ import annotations

from .._spec import OpSpec

SPEC = OpSpec(
    name="layer_scale",
    ops=("flaggems::layer_scale",),
    order=110,
)
