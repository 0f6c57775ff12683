"""The contract between an op's chain of implementations and the core: declining, and walking the chain.

An implementation that cannot serve a call raises :class:`Decline` (before any
side effect) or has its ``supports`` say so; the next link is tried, and the
native kernel serves when every link declined. :func:`walk` is that walk, the
one both the Python entry (:mod:`flaggems.binding`) and the planner behind the
compiled entry (:mod:`flaggems.planner`) run; every decline is counted in
:data:`DECLINES` (``flaggems routes`` shows them). This module sits below both
and below the fronts, which raise :class:`Decline`: it imports nothing of
flaggems.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any


class Decline(Exception):
    """Raise from an implementation, before any side effect, to pass the call on.

    The core moves to the next implementation in the op's chain (ultimately
    the native kernel) and logs ``reason`` on the ``fallback`` channel.
    """

    def __init__(self, reason: str = "declined") -> None:
        super().__init__(reason)
        self.reason = reason


def decline_reason(verdict: Any) -> str:
    """The reason a ``supports`` verdict gives: its text, or that it returned False."""
    return verdict if isinstance(verdict, str) else "supports() returned False"


#: Declines seen since the last ``enable()``: ``(op, implementation, reason) -> count``. The Python entry
#: counts calls; under the compiled entry a key planned native is counted once (its later calls replay
#: the native plan in C++, counted per op in ``plan_stats()``).
DECLINES: collections.Counter[tuple[str, str, str]] = collections.Counter()


def note_decline(op: str, label: str, reason: str) -> None:
    """Count one decline (decline paths only: the served path never calls it)."""
    DECLINES[(op, label, reason)] += 1


def declines_of(op: str) -> list[dict[str, Any]]:
    """``op``'s declines so far, most frequent first: ``{"impl", "reason", "count"}``."""
    rows = [{"impl": label, "reason": reason, "count": count}
            for (name, label, reason), count in DECLINES.items() if name == op]
    return sorted(rows, key=lambda row: -row["count"])


def walk(chain: Sequence[Any], args: tuple, kwargs: dict, op: str = "",
         declined: Callable[[str, str], None] | None = None) -> tuple[Any, Any]:
    """``(result, the link that served)``, or ``(None, None)`` when every link declined.

    Each link has ``label``, ``fn`` and ``supports``; a decline is counted under ``op`` (when given) and
    reported to ``declined(label, reason)`` (the Python entry's fallback log).
    """
    for link in chain:
        if link.supports is not None:
            verdict = link.supports(*args, **kwargs)
            if verdict is not True:
                _declined(op, link.label, decline_reason(verdict), declined)
                continue
        try:
            return link.fn(*args, **kwargs), link
        except Decline as exc:
            _declined(op, link.label, exc.reason, declined)
    return None, None


def _declined(op: str, label: str, reason: str, declined: Callable[[str, str], None] | None) -> None:
    if op:
        note_decline(op, label, reason)
    if declined is not None:
        declined(label, reason)
