"""The rotary_cache family's record (:class:`flaggems.families.OpSpec`)."""

from __future__ import annotations

from flaggems.families import OpSpec

SPEC = OpSpec(
    name="rotary_cache",
    ops=("flaggems::rotary_cache_append",),
    order=85,
    fronts=("flaggems.fronts.rotary_cache",),
)
