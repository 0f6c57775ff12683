"""The repeat_interleave family's record (:class:`flaggems.families.OpSpec`)."""

from __future__ import annotations

from flaggems.families import OpSpec

SPEC = OpSpec(
    name="repeat_interleave",
    ops=("repeat_interleave.Tensor", "repeat_interleave.self_Tensor", "repeat_interleave.self_int"),
    order=40,
    fronts=("flaggems.fronts.repeat_interleave",),
)
