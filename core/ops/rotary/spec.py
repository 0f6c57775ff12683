"""The rotary family's record (:class:`flaggems.families.OpSpec`)."""

from __future__ import annotations

from flaggems.families import OpSpec

SPEC = OpSpec(
    name="rotary",
    ops=("flaggems::rotary_embedding",),
    order=80,
    fronts=("flaggems.fronts.rotary",),
)
