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

Importing this package imports Triton; select the backend (``flaggems.backend()``)
first so that the CPU interpreter is set up before any kernel is decorated.
"""

from __future__ import annotations

from .launch import FastLauncher
from .layout import cdiv, collapse_dims, next_pow2
from .strided import strided_copy
from .tuning import ElementwisePolicy, elementwise_policy, reset_policy, set_policy

__all__ = [
    "ElementwisePolicy",
    "FastLauncher",
    "cdiv",
    "collapse_dims",
    "elementwise_policy",
    "next_pow2",
    "reset_policy",
    "set_policy",
    "strided_copy",
]
