"""The index_copy family's record (:class:`flaggems.families.OpSpec`)."""

from __future__ import annotations

from flaggems.families import OpSpec

SPEC = OpSpec(
    name="index_copy",
    ops=("index_copy_", "index_copy"),
    order=20,
    fronts=("flaggems.fronts.index_copy",),
)
