"""Kernel toolkit shared by every plugin: fast launch and strided copy/cast.

* :class:`FastLauncher` (:mod:`.launch`): launch a ``@triton.jit`` kernel for
  0.43-0.45x the host time of ``kernel[grid]`` (5.5 against 12.1 µs on an
  H200 host, triton 3.6; ``benchmarks/toolkit_notes.md``).
* :func:`strided_copy` (:mod:`.strided`): rank-generic copy with a cast on
  store, for any strides; :func:`collapse_dims` (:mod:`.layout`) is its layout
  algebra.
* :func:`elementwise_policy` (:mod:`.tuning`): grid/tile policy read from
  plugin tuning (``flaggems_tuning`` key ``"elementwise"``).
* :func:`~.workspace.zeroed_scratch` (:mod:`.workspace`): per-stream zeroed
  state for kernels whose programs coordinate, which they leave zeroed (no
  memset launch per call; CUDA-graph safe); :func:`~.workspace.claim_scratch`
  adds the stream's lock, held across launches that share the state.
* :func:`~.dependent_launch.dependent_launch` (:mod:`.dependent_launch`):
  whether a kernel may start while the one before it finishes
  (programmatic dependent launch on NVIDIA sm_90+), with the in-kernel wait.

* :mod:`.context`: the kernel context the core hands down (interpreter,
  flags, device facts, native scope, tuning); kernels read it, never the
  runtime.

Importing a kernel module imports Triton; select the backend (``flaggems.backend()``)
first so that the CPU interpreter is set up before any kernel is decorated.
The names below load their modules on first use: importing this package (or
:mod:`.context`) imports no Triton.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "FastLauncher": "launch",
    "cdiv": "layout",
    "collapse_dims": "layout",
    "next_pow2": "layout",
    "strided_copy": "strided",
    "ElementwisePolicy": "tuning",
    "elementwise_policy": "tuning",
    "reset_policy": "tuning",
    "set_policy": "tuning",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
