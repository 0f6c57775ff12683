"""The repeat_interleave family's record (:class:`flaggems.ops.OpSpec`)."""

from __future__ import annotations

from .._spec import OpSpec

SPEC = OpSpec(
    name="repeat_interleave",
    ops=("repeat_interleave.Tensor", "repeat_interleave.self_Tensor", "repeat_interleave.self_int"),
    order=40,
    fronts=("flaggems.fronts.repeat_interleave",),
)
