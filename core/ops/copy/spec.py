"""The copy family's record (:class:`flaggems.ops.OpSpec`)."""

from __future__ import annotations

from .._spec import OpSpec

SPEC = OpSpec(
    name="copy",
    ops=("copy_", "_to_copy"),
    order=10,
    fronts=("flaggems.fronts.copy",),
)
