"""The rotary family's record (:class:`flaggems.ops.OpSpec`)."""

from __future__ import annotations

from .._spec import OpSpec

SPEC = OpSpec(
    name="rotary",
    ops=("flaggems::rotary_embedding",),
    order=80,
    fronts=("flaggems.fronts.rotary",),
)
