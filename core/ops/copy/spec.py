"""The copy family's record (:class:`flaggems.families.OpSpec`)."""

from __future__ import annotations

from flaggems.families import OpSpec

SPEC = OpSpec(
    name="copy",
    ops=("copy_", "_to_copy"),
    order=10,
    fronts=("flaggems.fronts.copy",),
)
