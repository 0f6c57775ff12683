"""The rms_norms family's record (:class:`flaggems.families.OpSpec`)."""

from __future__ import annotations

from flaggems.families import OpSpec

SPEC = OpSpec(
    name="rms_norms",
    ops=("flaggems::rms_norm", "flaggems::add_rms_norm"),
    order=70,
    fronts=("flaggems.fronts.rms_norm",),
)
