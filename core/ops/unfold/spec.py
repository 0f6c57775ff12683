"""The unfold family's record (:class:`flaggems.ops.OpSpec`)."""

from __future__ import annotations

from .._spec import OpSpec

SPEC = OpSpec(
    name="unfold",
    ops=("unfold", "unfold_backward"),
    order=60,
    fronts=("flaggems.fronts.unfold",),
)
