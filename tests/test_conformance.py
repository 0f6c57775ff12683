"""Every installed implementation of every op against native torch (the kit)."""

from __future__ import annotations

import pytest

from flaggems import testing

ITEMS = testing.collect()


@pytest.mark.parametrize("item", ITEMS, ids=str)
def test_conformance(item):
    outcome = testing.check(item)
    if outcome.startswith("declined") and item.case.raises is None:
        pytest.skip(f"{item.label} {outcome}")


def test_every_routed_op_has_cases():
    from flaggems.policy import default_links
    from flaggems.runtime import RUNTIME

    ops = default_links(RUNTIME.implementations(), RUNTIME.active_backend())
    missing = [op for op in ops if not testing.cases_for(op)]
    assert not missing, f"ops without conformance cases: {missing}"
