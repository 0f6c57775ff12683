"""The abs family's record (:class:`flaggems.ops.OpSpec`)."""

from __future__ import annotations

from .._spec import OpSpec

SPEC = OpSpec(
    name="abs",
    ops=("abs",),
    order=120,
)
