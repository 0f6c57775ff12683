"""The rms_norms family's record (:class:`flaggems.ops.OpSpec`)."""

from __future__ import annotations

from .._spec import OpSpec

SPEC = OpSpec(
    name="rms_norms",
    ops=("flaggems::rms_norm", "flaggems::add_rms_norm"),
    order=70,
    fronts=("flaggems.fronts.rms_norm",),
)
