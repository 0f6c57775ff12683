"""flaggems: Triton operators for PyTorch, with vendor plugins.

Typical use::

    import flaggems
    flaggems.enable()            # route aten ops to the best installed implementation
    ...
    flaggems.disable()           # native kernels again

``import flaggems`` discovers the installed plugins (entry-point group
``flaggems.plugins``) but imports no kernel module and selects no backend;
both happen at the first ``enable()``, ``routes()`` or ``info()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from . import config as _config
from .chain import Decline
from .hookspecs import hookimpl
from .types import Backend, OpImpl, PatchRule, ProbeResult, Tuning

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "Decline",
    "OpImpl",
    "ProbeResult",
    "Tuning",
    "PatchRule",
    "backend",
    "disable",
    "enable",
    "enabled",
    "hookimpl",
    "info",
    "is_enabled",
    "patch",
    "release",
    "routes",
    "tuning",
    "unpatch",
]


def _runtime():
    from .runtime import RUNTIME

    return RUNTIME


def enable(include: Iterable[str] | str | None = None, exclude: Iterable[str] | str | None = None) -> None:
    """Route aten operators to flaggems implementations.

    Args:
        include: op names to route (``"copy_"``, ``["copy_", "repeat_interleave.Tensor"]``;
            a string is one name); ``None`` routes every op that has an implementation.
        exclude: op names to leave native (the same forms). Both take precedence over
            the environment and the routes file.

    Raises ``TypeError`` for an ``include``/``exclude`` that is neither a name nor an
    iterable of names, ``ValueError`` for an invalid ``FLAGGEMS_*`` value.

    Idempotent and thread-safe: calling it again with the same arguments does
    nothing; with other arguments it re-routes.
    """
    _runtime().enable(include, exclude)


def disable() -> None:
    """Route every op to torch's own kernel again (idempotent, thread-safe).

    flaggems' registrations stay with the dispatcher, switched off (a disabled
    call costs one forward to torch's kernel): registering or removing a kernel
    while other threads call the op is unsafe in torch itself, so ``enable()``
    and ``disable()`` only switch what the registrations serve. :func:`release`
    removes them.
    """
    _runtime().disable()


def release() -> None:
    """``disable()``, then remove every registration flaggems made with torch's dispatcher.

    Not thread-safe: call it only while no other thread runs torch operators
    (e.g. at the end of a program or a test session). A later ``enable()``
    registers again.
    """
    _runtime().release()


def is_enabled() -> bool:
    """True while flaggems overrides are registered."""
    return _runtime().enabled_with is not None


@contextlib.contextmanager
def enabled(include: Iterable[str] | str | None = None,
            exclude: Iterable[str] | str | None = None) -> Iterator[None]:
    """Context manager: ``enable(include, exclude)`` inside (the same arguments), the previous state after."""
    runtime = _runtime()
    with runtime.lock:
        previous = runtime.enabled_with
        runtime.enable(include, exclude)
    try:
        yield
    finally:
        with runtime.lock:
            if previous is None:
                runtime.disable()
            else:
                runtime.enable(previous[0], previous[1])


def patch(model: Any) -> Any:
    """Route a transformers decoder's layers through flaggems' fused operators; returns a report.

    RMSNorms, the residual add + post-attention norm of each decoder layer,
    the gated MLP's activation product and the rotary embedding of q and k
    become calls of :mod:`flaggems.ops` (Llama, Mistral, Qwen2, Qwen3, Gemma;
    see :mod:`flaggems.patching`). Idempotent; :func:`unpatch` restores.
    Call :func:`enable` for the kernels: without it the operators run their
    torch references. The active backend's plugins may decline a kind of
    module or make its forward (:class:`~flaggems.types.PatchRule`).
    """
    from .patching import patch as patch_model

    return patch_model(model, _patch_rules())


def _patch_rules() -> list:
    """The active backend's patch rules; where the backend cannot be chosen (a bad ``FLAGGEMS_*`` setting,
    which ``enable()`` reports), none, with a warning: patching never fails for it (under
    ``FLAGGEMS_STRICT`` it raises)."""
    from . import config, userwarn

    try:
        return _runtime().patch_rules()
    except Exception as exc:
        if config.get("FLAGGEMS_STRICT"):
            raise
        userwarn.warn(f"flaggems.patch: the plugins' patch rules were not read ({type(exc).__name__}: {exc}); "
                      "the model is patched by the core's rules alone")
        return []


def unpatch(model: Any) -> bool:
    """Undo :func:`patch` on ``model``; ``False`` when it was not patched."""
    from .patching import unpatch as unpatch_model

    return unpatch_model(model)


def routes(op: str | None = None) -> list[dict[str, Any]]:
    """Per op: the implementation chain, the one chosen first, and why.

    Shows the routes in force when enabled, otherwise those ``enable()`` would
    install. ``op`` narrows the answer to one operator: an aten name with or
    without ``aten::`` (``"copy_"``, ``"aten::add.Tensor"``), or one of flaggems'
    own, bare or with ``flaggems::`` (``"rms_norm"`` also means
    ``flaggems::rms_norm``). ``declined`` counts
    the declines seen since ``enable()``, by implementation and reason (calls
    on the Python entry; layouts first seen, under the compiled entry).
    """
    from .chain import declines_of
    from .policy import op_candidates

    table = _runtime().routes()
    wanted = None if op is None else op_candidates(op)
    return [{**route.as_dict(), "declined": declines_of(name)} for name, route in table.items()
            if wanted is None or name in wanted]


def info() -> dict[str, Any]:
    """Backend (and whether simulated), every probe, every plugin and its status."""
    return _runtime().info()


def backend():
    """The active :class:`~flaggems.backends.ActiveBackend` (selected on first call)."""
    return _runtime().active_backend()


def tuning(key: str) -> dict[str, Any]:
    """Merged tuning values for ``key`` (vendor values override generic ones)."""
    return _runtime().tuning().get(key, {})


def _on_import() -> None:
    from . import log

    try:
        log.configure()
    except ValueError:
        pass  # a bad FLAGGEMS_LOG must not break the import: enable() reports it (config.validate), once
    from . import families

    families.define()  # flaggems' own operators exist whether or not flaggems is enabled (patched models call them)
    families.register_policies()  # before discovery: the plugins' tuning is checked against them
    _runtime().discover()
    _config.warn_unknown()  # after discovery: the plugins' own variables are declared by then


_on_import()
