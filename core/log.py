"""Log channels of flaggems, on the standard :mod:`logging` module.

``FLAGGEMS_LOG=dispatch,fallback,plugins`` switches channels on:

* ``flaggems.dispatch``: the implementation that actually ran, per call;
* ``flaggems.fallback``: every decline to the next implementation, with its reason;
* ``flaggems.plugins``: discovery, loading and backend selection.

The hot path never calls logging when a channel is off: ``enable()`` builds a
different per-op entry point when ``dispatch`` or ``fallback`` is on.
"""

from __future__ import annotations

import logging
import sys

from . import config

CHANNELS = config.LOG_CHANNELS
_HANDLER_ATTR = "_flaggems_handler"


def logger(channel: str) -> logging.Logger:
    """Return the logger of one channel (``dispatch``, ``fallback`` or ``plugins``)."""
    if channel not in CHANNELS:
        raise ValueError(f"unknown log channel {channel!r}; known: {', '.join(CHANNELS)}")
    return logging.getLogger(f"flaggems.{channel}")


def configure(channels: tuple[str, ...] | None = None) -> frozenset[str]:
    """Switch on the given channels (default: from ``FLAGGEMS_LOG``); return them."""
    wanted = config.get("FLAGGEMS_LOG") if channels is None else channels
    unknown = [c for c in wanted if c not in CHANNELS]
    if unknown:
        raise ValueError(f"FLAGGEMS_LOG: unknown channel(s) {unknown}; known: {', '.join(CHANNELS)}")
    for channel in wanted:
        log = logger(channel)
        log.setLevel(logging.INFO)
        # The application's own logging (a handler on the root logger) prints our records once; ours would
        # print them a second time.
        if not log.handlers and not getattr(log, _HANDLER_ATTR, False) and not logging.getLogger().handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
            log.addHandler(handler)
            setattr(log, _HANDLER_ATTR, True)
    return frozenset(wanted)


def is_on(channel: str) -> bool:
    """True when the channel would emit an INFO record."""
    return logger(channel).isEnabledFor(logging.INFO)
