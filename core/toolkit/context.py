"""The kernel context: what kernels may know about the process, handed down by the core.

The toolkit sits under the binding and the runtime and never imports them.
When the backend is selected, the runtime builds one :class:`KernelContext`
(interpreter or not, the checking and launch flags, the device facts its
``Backend`` record supplies, the native scope of interpreted launches, the
plugins' tuning) and hands it down through a provider it installs here at
import (:func:`set_provider`). Kernels read :func:`current`; tests and
benchmarks that change a flag call :func:`reset`, the one reset there is.

Without a provider (the toolkit used on its own) the context comes from the
environment: the interpreter if ``TRITON_INTERPRET=1``, no checks, no tuning.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import weakref
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class DeviceFacts:
    """What kernels size grids and tiles by, for one device (``None``: not known).

    Attributes:
        multiprocessors: streaming multiprocessors, AI cores or compute units.
        l2_bytes: last-level cache size.
        warp_size: threads of a warp or wavefront (32 on NVIDIA, 64 on many AMD-like devices).
        max_grid: largest grid per axis.
        fp64: whether the device computes float64.
        bf16: whether the device computes bfloat16.
        threads_per_multiprocessor: threads one multiprocessor keeps resident (2048 on an H200);
            ``None`` where a core runs one program at a time (Ascend AI cores) or it is not known.
    """

    multiprocessors: int | None = None
    l2_bytes: int | None = None
    warp_size: int = 32
    max_grid: tuple[int, int, int] = (2**31 - 1, 65535, 65535)
    fp64: bool = True
    bf16: bool = True
    threads_per_multiprocessor: int | None = None

    def resident_programs(self, threads_per_program: int) -> int | None:
        """Programs of ``threads_per_program`` threads the whole device runs at once (``None``: not known).

        One per multiprocessor where the facts give no thread capacity (a core runs one program).
        """
        if self.multiprocessors is None:
            return None
        per_unit = 1
        if self.threads_per_multiprocessor:
            per_unit = max(self.threads_per_multiprocessor // max(threads_per_program, 1), 1)
        return self.multiprocessors * per_unit


@functools.lru_cache(maxsize=64)
def cuda_facts(index: int) -> DeviceFacts:
    """Facts of CUDA (or HIP) device ``index``, read once from torch's device properties."""
    import torch

    props = torch.cuda.get_device_properties(index)
    warp = int(getattr(props, "warp_size", 32) or 32)
    return DeviceFacts(multiprocessors=int(props.multi_processor_count),
                       l2_bytes=int(getattr(props, "L2_cache_size", 0)), warp_size=warp,
                       threads_per_multiprocessor=int(getattr(props, "max_threads_per_multi_processor", 0)) or None)


def _no_tuning(key: str) -> Mapping[str, Any]:
    return {}


@dataclass(frozen=True)
class KernelContext:
    """The process's kernel context (see the module docstring).

    Attributes:
        device_type: torch device type kernels run on.
        interpreter: kernels run in Triton's interpreter.
        checks: index-like arguments are validated synchronously (``FLAGGEMS_CHECK_INDICES``, and
            always in the interpreter).
        dependent_launch: ``FLAGGEMS_DEPENDENT_LAUNCH``: programmatic dependent launch allowed.
        grouped_scatter: ``FLAGGEMS_GROUPED_SCATTER``: the grouped scatter of index_copy allowed.
        facts_source: device index -> :class:`DeviceFacts` (``None``: nothing known).
        native_scope: context manager that sends re-entered torch ops to their native kernels
            (the interpreter's own copies run in it).
        tuning: tuning key -> merged plugin values (``flaggems_tuning``).
    """

    device_type: str = "cpu"
    interpreter: bool = True
    checks: bool = True
    dependent_launch: bool = True
    grouped_scatter: bool = True
    facts_source: Callable[[int], DeviceFacts] | None = None
    native_scope: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext
    tuning: Callable[[str], Mapping[str, Any]] = _no_tuning
    _facts: dict[int, DeviceFacts] = field(default_factory=dict, compare=False, repr=False)

    def facts(self, index: int) -> DeviceFacts:
        """Device ``index``'s facts (read once per index), or empty facts when none are supplied."""
        found = self._facts.get(index)
        if found is None:
            found = self.facts_source(index) if self.facts_source is not None else DeviceFacts()
            self._facts[index] = found
        return found


_LOCK = threading.Lock()
_CURRENT: KernelContext | None = None
_PROVIDER: Callable[[], KernelContext] | None = None
_LISTENERS: list[Callable[[], None]] = []


def _from_environment() -> KernelContext:
    interpreter = os.environ.get("TRITON_INTERPRET") == "1"
    return KernelContext(interpreter=interpreter, checks=interpreter)


def current() -> KernelContext:
    """The context in force (built by the provider on first use after :func:`reset`)."""
    ctx = _CURRENT
    if ctx is None:
        ctx = _build()
    return ctx


def _build() -> KernelContext:
    global _CURRENT
    provider = _PROVIDER or _from_environment
    ctx = provider()  # outside the lock: a provider may select the backend, which may reset
    with _LOCK:
        if _CURRENT is None:
            _CURRENT = ctx
        return _CURRENT


def set_provider(provider: Callable[[], KernelContext] | None) -> None:
    """Install the function that builds the context (the runtime does, at import)."""
    global _PROVIDER
    _PROVIDER = provider
    reset()


def install(ctx: KernelContext) -> None:
    """Put ``ctx`` in force now (tests, benchmarks): caches derived from the context are dropped."""
    global _CURRENT
    with _LOCK:
        _CURRENT = ctx
    _drop_derived()


class ContextCache(dict):
    """A dict :func:`reset` and :func:`install` empty: what a front or a module derives from the context
    (plans whose launch reads tuning or device facts). Weakly held: a cache its owner dropped is not kept."""


_CACHES: weakref.WeakValueDictionary[int, ContextCache] = weakref.WeakValueDictionary()  # by identity


def cache() -> ContextCache:
    """A new :class:`ContextCache`, emptied at every :func:`reset` with the context it was derived from."""
    found = ContextCache()
    _CACHES[id(found)] = found
    return found


def cached(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` memoised by its (hashable) positional arguments in a :class:`ContextCache`: the answers
    derive from the context (device facts, tuning), so every reset forgets them."""
    answers = cache()

    @functools.wraps(function)
    def lookup(*args: Any) -> Any:
        found = answers.get(args, _MISSING)
        if found is _MISSING:
            found = answers[args] = function(*args)
        return found

    lookup.answers = answers  # type: ignore[attr-defined]  # held here: the registry holds caches weakly
    lookup.cache_clear = answers.clear  # type: ignore[attr-defined]  # as functools.lru_cache spells it
    return lookup


_MISSING = object()


def on_reset(listener: Callable[[], None]) -> None:
    """Call ``listener`` at every :func:`reset` (modules that derive caches from the context)."""
    _LISTENERS.append(listener)


def reset() -> None:
    """Forget the context: the next :func:`current` builds it again (after a flag or the backend changed)."""
    global _CURRENT
    with _LOCK:
        _CURRENT = None
    _drop_derived()


def _drop_derived() -> None:
    """Empty every :class:`ContextCache` and tell every listener: what they hold came from the old context."""
    for derived in list(_CACHES.values()):
        derived.clear()
    for listener in _LISTENERS:
        listener()
