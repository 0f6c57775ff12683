"""The copy family's contract cases: ``copy_`` (:mod:`.copy_`) and ``_to_copy`` (:mod:`.to_copy`)."""

from __future__ import annotations

from . import copy_, to_copy

CASES = {**copy_.CASES, **to_copy.CASES}
