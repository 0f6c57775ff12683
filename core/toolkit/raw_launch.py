"""The cheapest call into one compiled Triton kernel, per Triton version.

:func:`bind_raw` turns a ``CompiledKernel`` into ``(raw, prefix)``, called as
``raw(grid_x, grid_y, grid_z, stream, *prefix, *args)``, where ``args`` are
every kernel parameter in order (constexprs included: the launcher skips
them); :func:`bind_launch` wraps that in one callable.

Two forms, fastest first:

* ``driver``: the C launch function of triton 3.6's ``CudaLauncher``, called
  directly when the kernel needs no scratch memory. It skips the launcher's
  Python ``__call__`` (two closures and allocator look-ups per call). Only the
  version whose launcher was read and run on a GPU gets this form.
* ``compiled``: ``CompiledKernel.run(grid..., stream, function, metadata,
  launch_metadata, enter_hook, exit_hook, *args)``, the call
  ``JITFunction.run`` itself makes in triton 3.6 to 3.9.

Neither passes launch metadata or hooks: callers check :func:`hooks_idle`
first and take Triton's own path while a profiler has hooks installed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import triton

_KNOBS = getattr(triton, "knobs", None)
_RUNTIME = getattr(_KNOBS, "runtime", None)
_HOOK_CHAIN = getattr(_KNOBS, "HookChain", None)

#: Triton versions whose ``CudaLauncher`` layout :func:`_driver_launch` matches (checked on an H200).
DRIVER_FORM_VERSIONS = ((3, 6),)

Launch = Callable[..., None]


def hooks_idle() -> bool:
    """True when no launch hook is installed (the fast forms pass none).

    triton >= 3.7 keeps a HookChain that is usually empty; 3.6 keeps ``None``
    or a callable. Written out flat: it runs on every launch.
    """
    runtime = _RUNTIME
    if runtime is None:
        return True
    enter, leave, chain = runtime.launch_enter_hook, runtime.launch_exit_hook, _HOOK_CHAIN
    return ((enter is None or (enter.__class__ is chain and not enter.calls))
            and (leave is None or (leave.__class__ is chain and not leave.calls)))


def compile_hooks_idle() -> bool:
    """True when no hook changes what a launch compiles (checked when binding, not per call)."""
    return getattr(_RUNTIME, "add_stages_inspection_hook", None) is None


def triton_version() -> tuple[int, int] | None:
    """``(major, minor)`` of the installed Triton, or ``None`` when unparsable."""
    try:
        major, minor = triton.__version__.split(".")[:2]
        return int(major), int(minor)
    except (AttributeError, ValueError):
        return None


#: ``raw(grid_x, grid_y, grid_z, stream, *prefix, *kernel_args)``: a raw launch split in its callable and
#: the fixed arguments between the stream and the kernel's own (see :func:`bind_raw`).
RawLaunch = tuple[Callable[..., None], tuple[Any, ...]]


def _driver_launch(kernel: Any) -> RawLaunch | None:
    """triton 3.6: ``CudaLauncher.launch(grid..., stream, function, coop, pdl, scratch, profile_scratch,
    metadata, launch_metadata, enter_hook, exit_hook, *args)``; ``None`` where that layout is not certain."""
    launcher = kernel.run
    if triton_version() not in DRIVER_FORM_VERSIONS or type(launcher).__name__ != "CudaLauncher":
        return None
    if getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1):
        return None
    return launcher.launch, (kernel.function, launcher.launch_cooperative_grid, launcher.launch_pdl, None, None,
                             kernel.packed_metadata, None, None, None)


def bind_raw(kernel: Any) -> tuple[RawLaunch, str]:
    """``((raw, prefix), form)`` for a compiled kernel that has been launched once (its handles are loaded).

    ``raw(grid_x, grid_y, grid_z, stream, *prefix, *args)`` launches it, ``args``
    being every kernel parameter in order. Kept apart so a caller can make the
    whole call in one expression (each extra layer of ``*args`` costs ~1 µs
    for a 30-argument kernel). Raises ``AttributeError`` when ``kernel`` is not
    a compiled kernel.
    """
    direct = _driver_launch(kernel)
    if direct is not None:
        return direct, "driver"
    return (kernel.run, (kernel.function, kernel.packed_metadata, None, None, None)), "compiled"


def bind_launch(kernel: Any) -> tuple[Launch, str]:
    """:func:`bind_raw` as one callable ``launch(grid_x, grid_y, grid_z, stream, *args)``."""
    (raw, prefix), form = bind_raw(kernel)

    def launch(grid_x: int, grid_y: int, grid_z: int, stream: int, *args: Any) -> None:
        raw(grid_x, grid_y, grid_z, stream, *prefix, *args)

    return launch, form
