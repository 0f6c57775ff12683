"""Warnings that point at the user's line, not at flaggems internals or the import machinery.

A warning is attributed to the first frame outside flaggems, the import
system, pluggy and :mod:`contextlib` (``with flaggems.enabled(...)`` is the
user's line, not contextlib's). In the ``flaggems`` command there is no user's
line (the first frame outside is the console script, or none under
``python -m flaggems``): there a warning is printed as one line,
``flaggems: warning: ...``, with no source line under it. Warning filters
(``-W error``, ``PYTHONWARNINGS=ignore``) apply either way.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator
from types import FrameType
from typing import Any, TextIO

_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_CONTEXTLIB = os.path.abspath(contextlib.__file__)
_IGNORED_PREFIXES = (_PACKAGE + os.sep, "<frozen ", _CONTEXTLIB)
#: Names of the ``flaggems`` console script (pip writes ``flaggems``; on Windows ``flaggems-script.py``).
_LAUNCHERS = frozenset({"flaggems", "flaggems-script"})
#: Depth of :func:`command_line` blocks (the ``flaggems`` command's handlers run inside one).
_COMMAND_LINE = [0]


def _internal(filename: str) -> bool:
    return filename.startswith(_IGNORED_PREFIXES) or f"{os.sep}pluggy{os.sep}" in filename or (
        f"{os.sep}importlib{os.sep}" in filename)


def warn(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """``warnings.warn`` attributed to the first frame outside flaggems (``import flaggems``, ``enable()``...).

    In the ``flaggems`` command, one line on stderr instead (see the module docstring).
    """
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and _internal(frame.f_code.co_filename):
        if not _skipped_by_warnings(frame.f_code.co_filename):
            level += 1
        frame = frame.f_back
    if _COMMAND_LINE[0] or frame is None or _is_launcher(frame):
        with _one_line():
            warnings.warn(message, category, stacklevel=level + 1)
        return
    warnings.warn(message, category, stacklevel=level + 1)


@contextlib.contextmanager
def command_line() -> Iterator[None]:
    """Inside the block (a ``flaggems`` command running), flaggems' warnings print as one clean line."""
    _COMMAND_LINE[0] += 1
    try:
        yield
    finally:
        _COMMAND_LINE[0] -= 1


def one_line(message: Warning | str) -> str:
    """``flaggems: warning: <message>`` (the message's own ``flaggems: `` prefix dropped)."""
    text = str(message)
    return "flaggems: warning: " + (text[len("flaggems: "):] if text.startswith("flaggems: ") else text)


def _print_one_line(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                    file: TextIO | None = None, line: str | None = None) -> None:
    stream = sys.stderr if file is None else file
    if stream is None:
        return
    try:
        stream.write(one_line(message) + "\n")
    except OSError:  # as warnings does: a closed or invalid stream loses the warning
        pass


@contextlib.contextmanager
def _one_line() -> Iterator[None]:
    """Warnings shown inside the block are printed by :func:`_print_one_line` (filters still decide)."""
    saved: Any = warnings.showwarning
    warnings.showwarning = _print_one_line
    try:
        yield
    finally:
        warnings.showwarning = saved


def _is_launcher(frame: FrameType) -> bool:
    """Whether ``frame`` is the ``flaggems`` console script (its ``from flaggems.cli import main``)."""
    if frame.f_globals.get("__name__") != "__main__":
        return False
    name = os.path.splitext(os.path.basename(frame.f_code.co_filename))[0]
    return name in _LAUNCHERS


def _skipped_by_warnings(filename: str) -> bool:
    """Frames :mod:`warnings` itself leaves out of ``stacklevel`` (the import system's bootstrap)."""
    return "importlib" in filename and "_bootstrap" in filename
