"""The index_select family's record (:class:`flaggems.families.OpSpec`)."""

from __future__ import annotations

from flaggems.families import OpSpec

SPEC = OpSpec(
    name="index_select",
    ops=("index_select",),
    order=30,
    fronts=("flaggems.fronts.index_select",),
)
