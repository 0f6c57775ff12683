"""The unfold family's record (:class:`flaggems.families.OpSpec`)."""

from __future__ import annotations

from flaggems.families import OpSpec

SPEC = OpSpec(
    name="unfold",
    ops=("unfold", "unfold_backward"),
    order=60,
    fronts=("flaggems.fronts.unfold",),
)
