"""The abs family's record (:class:`flaggems.families.OpSpec`)."""

from __future__ import annotations

from flaggems.families import OpSpec

SPEC = OpSpec(
    name="abs",
    ops=("abs",),
    order=120,
)
