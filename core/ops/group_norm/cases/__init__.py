"""The group_norm family's contract cases: ``native_group_norm`` and its backward (:mod:`.native`, whose
shapes and tolerances the others share), ``aten::group_norm`` (:mod:`.op`) and ``flaggems::group_norm_silu``
(:mod:`.silu`)."""

from __future__ import annotations

from . import native, op, silu

CASES = {**native.CASES, **op.CASES, **silu.CASES}
GRADIENT_TERMS = dict(silu.GRADIENT_TERMS)
