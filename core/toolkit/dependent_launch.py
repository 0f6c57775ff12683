"""Programmatic dependent launch: let a kernel start while the one before it finishes.

Two kernels on one stream normally run strictly in order: the second is
launched only once the first has completed and its writes are flushed, and
that hand-over costs GPU time between them. On NVIDIA sm_90 and later a
kernel launched with Triton's ``launch_pdl=True`` may start early; it calls
:func:`gdc_wait` before touching anything the previous kernel writes, and
that wait returns once the previous kernel has completed with its writes
visible. The previous kernel may call :func:`gdc_launch_dependents` to let
the next one start even earlier (its programs then wait, resident, at
``gdc_wait``).

Only the launch right after the primary is relaxed: the primary itself was
launched in plain stream order, so everything before it has completed when
the dependent kernel starts. A kernel written this way must call
``gdc_wait`` before its first load or store of memory any earlier kernel
may touch (its output included: it may be memory freed by a kernel just
before).

Use it in a kernel behind a constexpr, so that other backends and the
interpreter never see the instruction::

    if DEPENDENT:
        gdc_wait()

and pass ``launch_pdl=True`` with ``DEPENDENT=True`` only where
:func:`dependent_launch` says so. ``FLAGGEMS_DEPENDENT_LAUNCH=0`` turns it off.
"""

from __future__ import annotations

import torch
import triton

from . import context

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: kernels keep their constexpr off

    @triton.jit
    def gdc_wait() -> None:
        """Stand-in: never traced, since :func:`dependent_launch` is False without the real one."""

    @triton.jit
    def gdc_launch_dependents() -> None:
        """Stand-in: never traced, since :func:`dependent_launch` is False without the real one."""

    _GDC = False
else:
    _GDC = True

_BY_DEVICE: dict[int, bool] = context.cache()  # the answers derive from the context's flags


def _triton_has_pdl_option() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def _available(device: int) -> bool:
    ctx = context.current()
    if not _GDC or torch.version.hip is not None or ctx.interpreter:
        return False
    if not ctx.dependent_launch or not _triton_has_pdl_option():
        return False
    try:
        return torch.cuda.get_device_capability(device)[0] >= 9
    except Exception:  # noqa: BLE001 - a driver that cannot answer: plain stream order still works
        return False


def dependent_launch(like: torch.Tensor) -> bool:
    """True when kernels working on ``like``'s device may be launched with ``launch_pdl=True``.

    Always False off CUDA (CPU, NPU, XPU and ROCm tensors). Decided once
    per CUDA device: compute capability 9.0 or more, a Triton with grid
    dependency control, and ``FLAGGEMS_DEPENDENT_LAUNCH`` not turned off.
    After that, a dict lookup per call.
    """
    if not like.is_cuda:
        return False
    device = like.get_device()
    ok = _BY_DEVICE.get(device)
    if ok is None:
        ok = _BY_DEVICE[device] = _available(device)
    return ok


