"""The layer_scale family's record (:class:`flaggems.families.OpSpec`)."""

from __future__ import annotations

from flaggems.families import OpSpec

SPEC = OpSpec(
    name="layer_scale",
    ops=("flaggems::layer_scale",),
    order=110,
)
