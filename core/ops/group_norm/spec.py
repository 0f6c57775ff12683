"""The group_norm family's record (:class:`flaggems.families.OpSpec`)."""

from __future__ import annotations

from flaggems.families import OpSpec

SPEC = OpSpec(
    name="group_norm",
    ops=("native_group_norm", "native_group_norm_backward", "group_norm", "flaggems::group_norm_silu"),
    order=50,
    fronts=("flaggems.fronts.group_norm", "flaggems.fronts.group_norm_silu"),
)
