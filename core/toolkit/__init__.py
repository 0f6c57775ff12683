"""Kernel toolkit shared by every plugin: fast launch and strided copy/cast.

* :class:`FastLauncher` (:mod:`.launch`): launch a ``@triton.jit`` kernel with
  a few µs of host time instead of ``kernel[grid]``'s ~12-15 µs.
* :func:`strided_copy` (:mod:`.strided`): rank-generic copy with a cast on
  store, for any strides; :func:`collapse_dims` (:mod:`.layout`) is its layout
  algebra.
* :func:`elementwise_policy` (:mod:`.tuning`): grid/tile policy read from
  plugin tuning (``flaggems_tuning`` key ``"elementwise"``).

Importing this package imports Triton; select the backend (``flaggems.backend()``)
first so that the CPU interpreter is set up before any kernel is decorated.
"""

from __future__ import annotations

from .launch import FastLauncher
from .layout import collapse_dims
from .strided import strided_copy
from .tuning import ElementwisePolicy, elementwise_policy, reset_policy, set_policy

__all__ = [
    "ElementwisePolicy",
    "FastLauncher",
    "collapse_dims",
    "elementwise_policy",
    "reset_policy",
    "set_policy",
    "strided_copy",
]
