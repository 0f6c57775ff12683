"""Whether a model's steady state stays off Python: the compiled entry's counters around one step.

Host time is what a routed call costs in a real model (a decode step is mostly
host time), so a step that already ran twice should reach neither Python nor
the planner: every routed call replays a plan, or goes native, from C++. Use
from a test::

    from flaggems.testing.steady import off_replay
    for _ in range(2):
        step()
    assert off_replay(step) == {}
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: Plan counters that mean Python (the entry's Python path or the planner) ran for a call.
OFF_REPLAY = ("miss", "python", "uncached", "unplanned")
#: Ops whose calls read the host when the kernel context checks indices (``FLAGGEMS_CHECK_INDICES``, and
#: always on the interpreter): there they take the Python path by design.
INDEX_CHECKED = ("aten::index_select@", "aten::index_copy")


def off_replay(step: Callable[[], Any]) -> dict[str, dict[str, int]]:
    """Runs ``step()`` and returns, per op and dispatch key, the calls it made that the compiled entry did
    not serve from C++ (:data:`OFF_REPLAY` counts); empty where every routed call replayed or went native.
    Empty too where the compiled entry is not active (no counters)."""
    from ..runtime import RUNTIME
    from ..toolkit import checks

    before = RUNTIME.plan_stats()
    step()
    found = {}
    for key, row in RUNTIME.plan_stats().items():
        moved = {name: row[name] - before.get(key, {}).get(name, 0) for name in OFF_REPLAY}
        if checks.enabled() and key.startswith(INDEX_CHECKED):
            moved["python"] = 0
        if any(moved.values()):
            found[key] = moved
    return found
