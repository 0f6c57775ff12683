"""The index_select family's record (:class:`flaggems.ops.OpSpec`)."""

from __future__ import annotations

from .._spec import OpSpec

SPEC = OpSpec(
    name="index_select",
    ops=("index_select",),
    order=30,
    fronts=("flaggems.fronts.index_select",),
)
