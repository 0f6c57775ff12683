"""Warnings that point at the user's line, not at flaggems internals or the import machinery."""

from __future__ import annotations

import os
import sys
import warnings

_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_IGNORED_PREFIXES = (_PACKAGE, "<frozen ")


def _internal(filename: str) -> bool:
    return filename.startswith(_IGNORED_PREFIXES) or f"{os.sep}pluggy{os.sep}" in filename or (
        f"{os.sep}importlib{os.sep}" in filename)


def warn(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """``warnings.warn`` attributed to the first frame outside flaggems (``import flaggems``, ``enable()``...)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and _internal(frame.f_code.co_filename):
        if not _skipped_by_warnings(frame.f_code.co_filename):
            level += 1
        frame = frame.f_back
    warnings.warn(message, category, stacklevel=level + 1)


def _skipped_by_warnings(filename: str) -> bool:
    """Frames :mod:`warnings` itself leaves out of ``stacklevel`` (the import system's bootstrap)."""
    return "importlib" in filename and "_bootstrap" in filename
