"""The torch binding: the only module of flaggems that calls ``torch.library``.

For every routed op, ``enable()`` builds one Python entry point (a closure
over pre-resolved callables) and registers it on the backend's dispatch key.
Per call the entry point does no dict lookup by string, no pluggy call and no
logging call unless a log channel was on at ``enable()``.

The native kernel is captured with ``torch.library.get_kernel(op, key)``
*before* overriding and called with ``call_boxed``: it never re-enters
flaggems. An op re-entered while its own implementation runs (the Triton
interpreter calls ``copy_`` on CPU tensors, for example) goes native too.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd import forward_ad

from . import compiled, config, log
from .chain import DECLINES, Decline, declines_of, note_decline, walk  # noqa: F401 - re-exported
from .policy import Route
from .toolkit.recording import RECORDERS
from .types import resolve_callable

# Re-entry guards are sets of thread idents: set membership and add/discard are
# atomic under the GIL and cost ~0.3 µs less per call than threading.local
# attribute access (measured on this project's CI host, Python 3.11).
_NATIVE_THREADS: set[int] = set()


@contextlib.contextmanager
def native_scope() -> Iterator[None]:
    """Route every flaggems-overridden op to its native kernel inside the block, on every device.

    The kernel toolkit wraps interpreted (CPU) launches in it: the Triton
    interpreter copies arguments with torch ops that must not come back here.
    Tests compute their expected values in it. Re-entrant: an inner scope
    leaves the outer one in force. It costs a routed call nothing: the entry
    tests its thread against this scope's set as it does against its own
    re-entry set.
    """
    me = threading.get_ident()
    if me in _NATIVE_THREADS:
        yield
        return
    entry = compiled.loaded()
    _NATIVE_THREADS.add(me)
    if entry is not None:
        entry.native_enter()
    try:
        yield
    finally:
        _NATIVE_THREADS.discard(me)
        if entry is not None:
            entry.native_exit()


#: The kernel toolkit's recorders (:mod:`flaggems.toolkit.recording`): a native kernel called while a
#: thread records does device work no recording can replay.
_RECORDERS = RECORDERS

_PY_NUMBER = (bool, int, float, complex)
_PY_NUMBER_CLASSES = frozenset(_PY_NUMBER)


def _scalar_tensor_like(value: Any, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Wrap a Python number arriving in a Tensor slot as torch would type it.

    A wrapped number takes the dtype of a tensor operand of the same category;
    otherwise the default dtype of its category, which reproduces torch's
    promotion for Python scalars.
    """
    def category(dtype: torch.dtype) -> int:
        if dtype == torch.bool:
            return 0
        if dtype.is_complex:
            return 3
        return 2 if dtype.is_floating_point else 1

    probe = torch.tensor(value)
    for tensor in tensors:
        if category(tensor.dtype) == category(probe.dtype):
            return torch.tensor(value, dtype=tensor.dtype, device=tensor.device)
    device = tensors[0].device if tensors else None
    return probe.to(device) if device is not None else probe


@dataclass(frozen=True)
class NativeKernel:
    """The native kernel of one op on one dispatch key, callable like the op."""

    op: str
    kernel: Any
    keyset: Any
    tensor_positions: tuple[int, ...]
    tensor_names: tuple[str, ...]

    @classmethod
    def capture(cls, op: str, dispatch_key: str) -> NativeKernel:
        """The kernel of ``aten::op`` on ``dispatch_key`` that flaggems found there (torch's own).

        Captured the first time flaggems asks, before it registers anything for that op and key, and kept:
        flaggems' registrations stay for the process (see :class:`Binding`), so the kernel current later
        may be flaggems' own.
        """
        found = _NATIVES.get((op, dispatch_key))
        if found is None:
            found = _NATIVES[(op, dispatch_key)] = cls.current(op, dispatch_key)
        return found

    @classmethod
    def current(cls, op: str, dispatch_key: str) -> NativeKernel:
        """The kernel of ``aten::op`` on ``dispatch_key`` now (a registration of flaggems' own, if one is there)."""
        overload = _overload(op)
        kernel = torch.library.get_kernel(overload, dispatch_key)
        keyset = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, dispatch_key))
        schema = overload._schema
        positions = tuple(i for i, a in enumerate(schema.arguments)
                          if not a.kwarg_only and isinstance(a.type, torch.TensorType))
        names = tuple(a.name for a in schema.arguments if isinstance(a.type, torch.TensorType))
        return cls(op, kernel, keyset, positions, names)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the native kernel, re-wrapping Python scalars given for Tensors.

        Inside a recorded implementation this does device work no recording can replay: the recording is
        spoiled (the planner keeps the call on the Python path).
        """
        if _RECORDERS and threading.get_ident() in _RECORDERS:
            _RECORDERS[threading.get_ident()].spoil(f"native {self.op} called inside the implementation")
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the kernel as the dispatcher would have without flaggems' registration (a switched-off slot)."""
        if any(i < len(args) and isinstance(args[i], _PY_NUMBER) for i in self.tensor_positions) or any(
            isinstance(kwargs.get(n), _PY_NUMBER) for n in self.tensor_names
        ):
            args, kwargs = self._rewrap(args, kwargs)
        return self.kernel.call_boxed(self.keyset, *args, **kwargs)

    def _rewrap(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        new_args = list(args)
        for i in self.tensor_positions:
            if i < len(new_args) and isinstance(new_args[i], _PY_NUMBER):
                new_args[i] = _scalar_tensor_like(new_args[i], tensors)
        new_kwargs = {k: (_scalar_tensor_like(v, tensors) if k in self.tensor_names and isinstance(v, _PY_NUMBER)
                          else v) for k, v in kwargs.items()}
        return tuple(new_args), new_kwargs


#: torch's kernel per ``(op, dispatch key)``, as :meth:`NativeKernel.capture` first found it.
_NATIVES: dict[tuple[str, str], NativeKernel] = {}


def namespace_of(op: str) -> tuple[str, str]:
    """``("aten", "copy_")`` for ``"copy_"``; ``("flaggems", "rms_norm")`` for ``"flaggems::rms_norm"``."""
    namespace, sep, name = op.partition("::")
    return (namespace, name) if sep else ("aten", op)


def _overload(op: str) -> torch._ops.OpOverload:
    namespace, qualified = namespace_of(op)
    if namespace == "flaggems":
        from . import families

        families.define()
    name, _, overload = qualified.partition(".")
    packet = getattr(getattr(torch.ops, namespace), name)
    return getattr(packet, overload or "default")


@dataclass(frozen=True)
class ResolvedLink:
    """A chain link with its callables imported."""

    label: str
    fn: Callable[..., Any]
    supports: Callable[..., Any] | None
    replayable: bool = False


def resolve_chain(route: Route) -> tuple[ResolvedLink, ...]:
    """Import every implementation of a route (lazy references resolve here).

    Where the backend declares dtypes it does not compute, each link's
    ``supports`` is preceded by :func:`dtype_gate` (only there: other
    backends' calls pay nothing).
    """
    banned = frozenset(getattr(torch, name) for name in route.unsupported_dtypes)
    links = []
    for link in route.chain:
        supports = None if link.impl.supports is None else resolve_callable(link.impl.supports)
        if banned:
            supports = dtype_gate(banned, route.backend, supports)
        links.append(ResolvedLink(link.label, resolve_callable(link.impl.fn), supports, link.impl.replayable))
    return tuple(links)


def dtype_gate(banned: frozenset[torch.dtype], backend: str,
               supports: Callable[..., Any] | None) -> Callable[..., Any]:
    """A ``supports`` that declines a call naming a ``banned`` dtype (a tensor's, or a ``dtype`` argument)."""

    def gated(*args: Any, **kwargs: Any) -> bool | str:
        for value in (*args, *kwargs.values()):
            dtype = value.dtype if isinstance(value, torch.Tensor) else value
            if isinstance(dtype, torch.dtype) and dtype in banned:
                return f"{dtype}: the {backend} backend computes no {str(dtype).removeprefix('torch.')}"
        return True if supports is None else supports(*args, **kwargs)

    return gated


def _unservable_keys() -> dict[str, int]:
    """Dispatch keys marking a tensor no kernel of flaggems reads right, with their bits (``raw_repr``)."""
    keys = torch._C.DispatchKey
    names = ("Python", "PythonTLSSnapshot", "Negative", "Conjugate", "ZeroTensor", "FuncTorchGradWrapper",
             "FuncTorchBatched", "BatchedNestedTensor", "Functionalize", "Sparse", "SparseCsr", "NestedTensor")
    return {name: torch._C.DispatchKeySet(getattr(keys, name)).raw_repr() for name in names if hasattr(keys, name)}


_UNSERVABLE = _unservable_keys()
_UNSERVABLE_MASK = sum(_UNSERVABLE.values())


def _tensor_unservable(tensor: torch.Tensor, tangents: bool) -> str | None:
    bits = torch._C._dispatch_keys(tensor).raw_repr() & _UNSERVABLE_MASK
    if bits:
        names = [name for name, bit in _UNSERVABLE.items() if bits & bit]
        return f"a tensor with dispatch key {'/'.join(names)} (torch's kernel resolves it)"
    if tensor.layout is not torch.strided:
        return f"a {tensor.layout} tensor"
    if tangents and forward_ad._current_level >= 0 and forward_ad.unpack_dual(tensor).tangent is not None:
        return "a tensor with a forward-AD tangent (torch's kernel carries it)"
    return None


def unservable(args: Sequence[Any], kwargs: dict[str, Any] | None = None, tangents: bool = True) -> str | None:
    """Why no implementation may serve this call, or ``None``: one check for every implementation.

    A tensor argument (or one in a list) whose values are not what its memory holds, or that is not plain
    memory: the negative or conjugate bit (``torch._neg_view``, ``c.conj().imag``), a zero tensor, a Python
    subclass (the fake tensors torch.compile traces with, wrapper subclasses), a functorch wrapper (vmap,
    grad, jvp), a functionalized, sparse or nested tensor, or one carrying a forward-AD tangent; and any call
    made while a ``TorchDispatchMode`` is on the stack (a user's logging mode, torch.compile's fake and
    functional tracing modes: each must see the ops torch's kernel makes). Such calls go to torch's kernel.
    On an Autograd key (CompositeImplicitAutograd ops such as ``repeat_interleave`` and
    ``group_norm``) all of them arrive as they are; below it torch's fallbacks resolve most, but not the
    negative bit for every op (``copy_``, ``repeat_interleave.Tensor``'s ``repeats``). The compiled entry
    makes the same check in C++; the Python entry here; the conformance kit before each direct call.
    ``tangents``: look for forward-AD tangents too (on Autograd keys only: below them torch's autograd has
    carried them already, and unpacking a dual tensor there trips an internal assert of torch).
    """
    if torch._C._len_torch_dispatch_stack():
        return "a TorchDispatchMode is active (it must see the ops torch's kernel makes)"
    for value in (*args, *(kwargs or {}).values()):
        if isinstance(value, torch.Tensor):
            reason = _tensor_unservable(value, tangents)
            if reason is not None:
                return reason
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor) and (reason := _tensor_unservable(item, tangents)) is not None:
                    return reason
    return None


def _below_autograd(args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> str | None:
    """:func:`unservable` for an entry on a backend key (no forward-AD tangents to look for)."""
    return unservable(args, kwargs, tangents=False)


def build_entry(op: str, chain: Sequence[ResolvedLink], native: NativeKernel,
                channels: frozenset[str], gate: bool = False, autograd_key: bool = False) -> Callable[..., Any]:
    """Build the per-op entry point registered with the dispatcher.

    The fast variant (one implementation, no ``supports``, no logging) costs a
    thread-ident lookup, a set add/discard and a ``try`` (docs/architecture.md,
    "Measured numbers", has what the core adds per call).
    ``gate``: the entry first sends calls :func:`unservable` names to the
    native kernel (~0.8 µs a tensor on the CI host; the compiled entry makes
    the same check in C++ at no measurable cost and builds its Python entry
    without it).
    """
    busy: set[int] = set()  # threads currently inside this op's implementation
    check = None if not gate else unservable if autograd_key else _below_autograd
    if len(chain) == 1 and chain[0].supports is None and not channels:
        return _build_single_entry(op, chain[0], native, busy, check)
    return _build_chain_entry(op, tuple(chain), native, channels, busy, check)


#: The label under which :func:`unservable` calls are counted (``flaggems routes``: "declined xN").
GATE_LABEL = "flaggems"


def _number_check(native: NativeKernel) -> tuple[int, Callable[[tuple], bool] | None]:
    """Per-op test: did a Python number arrive in a Tensor slot?

    The dispatcher hands wrapped numbers (``x + 0.5``) to Python kernels as
    Python scalars; implementations never see them: such calls go native,
    where they are re-wrapped. Returns the first Tensor slot (checked inline
    by the entry: a function call costs ~0.2 µs on a slow host) and a check
    of the other slots, or ``None`` when there are none.
    """
    positions = native.tensor_positions
    if not positions:
        return 1 << 30, None
    first, rest = positions[0], positions[1:]
    if not rest:
        return first, None
    numbers = _PY_NUMBER_CLASSES
    if len(rest) == 1:  # the common case (index_select, index_copy_...): no generator (~1 µs)
        second = rest[0]
        return first, lambda args: len(args) > second and args[second].__class__ in numbers
    return first, lambda args: any(len(args) > i and args[i].__class__ in numbers for i in rest)


def goes_native_test(native: NativeKernel) -> Callable[[tuple], bool]:
    """The entry's test of Python numbers in Tensor slots, as one function (for the planner)."""
    slot, other_slots = _number_check(native)
    numbers = _PY_NUMBER_CLASSES

    def goes_native(args: tuple) -> bool:
        return (len(args) > slot and args[slot].__class__ in numbers) or (
            other_slots is not None and other_slots(args))

    return goes_native


def _build_single_entry(op: str, link: ResolvedLink, native: NativeKernel, busy: set[int],
                        gate: Callable[..., str | None] | None) -> Callable[..., Any]:
    fn, label = link.fn, link.label
    get_ident = threading.get_ident
    native_threads = _NATIVE_THREADS
    slot, other_slots = _number_check(native)
    numbers = _PY_NUMBER_CLASSES

    def entry(*args: Any, **kwargs: Any) -> Any:
        me = get_ident()
        if (me in busy or me in native_threads or (len(args) > slot and args[slot].__class__ in numbers)
                or (other_slots is not None and other_slots(args))):
            return native(*args, **kwargs)
        if gate is not None and (reason := gate(args, kwargs)) is not None:
            note_decline(op, GATE_LABEL, reason)
            return native(*args, **kwargs)
        busy.add(me)
        try:
            return fn(*args, **kwargs)
        except Decline as exc:
            note_decline(op, label, exc.reason)
        finally:
            busy.discard(me)
        return native(*args, **kwargs)

    return entry


def _build_chain_entry(op: str, chain: tuple[ResolvedLink, ...], native: NativeKernel,
                       channels: frozenset[str], busy: set[int],
                       gate: Callable[..., str | None] | None) -> Callable[..., Any]:
    get_ident = threading.get_ident
    native_threads = _NATIVE_THREADS
    dispatch_log = log.logger("dispatch") if "dispatch" in channels else None
    fallback_log = log.logger("fallback") if "fallback" in channels else None

    slot, other_slots = _number_check(native)
    numbers = _PY_NUMBER_CLASSES
    declined = None if fallback_log is None else (
        lambda label, reason: fallback_log.info("%s: %s declined: %s", op, label, reason))

    def goes_native(me: int, args: tuple) -> bool:
        """Re-entered, inside a native scope, or a Python number in a Tensor slot."""
        if me in busy or me in native_threads:
            return True
        return (len(args) > slot and args[slot].__class__ in numbers) or (
            other_slots is not None and other_slots(args))

    def entry(*args: Any, **kwargs: Any) -> Any:
        me = get_ident()
        if goes_native(me, args):
            if dispatch_log:
                dispatch_log.info("%s -> native (re-entered or Python scalar)", op)
            return native(*args, **kwargs)
        if gate is not None and (reason := gate(args, kwargs)) is not None:
            note_decline(op, GATE_LABEL, reason)
            if fallback_log:
                fallback_log.info("%s: every implementation declined: %s", op, reason)
            return native(*args, **kwargs)
        busy.add(me)
        try:
            result, served = walk(chain, args, kwargs, op, declined)
        finally:
            busy.discard(me)
        if served is not None:
            if dispatch_log:
                dispatch_log.info("%s -> %s", op, served.label)
            return result
        if dispatch_log:
            dispatch_log.info("%s -> native", op)
        return native(*args, **kwargs)

    return entry


#: Plans kept per op and dispatch key by the compiled entry (the oldest are all dropped when it is full).
PLAN_CAPACITY = 4096
#: Misses per op and key the compiled entry always plans. Past them it plans only while at least half the
#: plans made were used again, and otherwise one miss in ``PLAN_RETRY_EVERY``: a miss costs 150-230 µs on
#: the H200 (the Python entry 12-22 µs), so a shape that changes at every call must not plan every time.
PLAN_FREE_MISSES = 256
PLAN_RETRY_EVERY = 64


class _PySlot:
    """The Python registration of one op on one dispatch key, made once for the process.

    ``serve`` is the entry of the current ``enable()`` or ``None``; while it is ``None`` the kernel the
    registration covers (``below``: torch's, or the compiled entry's registration made earlier) serves.
    """

    def __init__(self, op: str, key: str, below: NativeKernel) -> None:
        self.serve: Callable[..., Any] | None = None

        def slot_entry(*args: Any, **kwargs: Any) -> Any:
            serve = self.serve
            return below.forward(*args, **kwargs) if serve is None else serve(*args, **kwargs)

        self.library = torch.library.Library(namespace_of(op)[0], "IMPL")
        with warnings.catch_warnings():
            # torch warns once when overriding a C++ kernel: that is the point here.
            warnings.simplefilter("ignore", UserWarning)
            self.library.impl(op, slot_entry, key)


_PY_SLOTS: dict[tuple[str, str], _PySlot] = {}


def release() -> None:
    """Remove every registration flaggems made with the dispatcher (``flaggems.release()``).

    ``disable()`` only switches the registrations off: registering or removing a kernel while another
    thread calls the op is unsafe in torch itself. Call this only when no other thread runs torch ops.
    """
    forget_plans()  # the kept registries point at the slots released below
    for slot in _PY_SLOTS.values():
        slot.serve = None
        slot.library._destroy()
    _PY_SLOTS.clear()
    module = compiled.loaded()
    if module is not None:
        module.release()


#: Compiled-entry registries of recent ``enable()`` calls, newest last, kept with their plans after
#: ``disable()``: an ``enable()`` with the same fingerprint (:func:`_fingerprint`) serves with them again
#: instead of planning every call anew (a server switching flaggems off for one request, a benchmark
#: alternating sides). A kernel-context reset (new tuning or flags) or :func:`forget_plans` drops them.
_KEPT: dict[tuple, Any] = {}
KEPT_REGISTRIES = 4


def forget_plans() -> None:
    """Drop the registries kept for a later ``enable()`` (their plans with them)."""
    _KEPT.clear()



def _fingerprint(dispatch_key: str, routes: dict[str, Route], compiled_entry: Any) -> tuple:
    """What a registry's plans were made under: the routes (each chain's implementations and limits), the
    compiled module and its load, the plan budget and every ``FLAGGEMS_*`` setting in the environment."""
    chains = tuple(sorted((op, repr(route.chain), route.unsupported_dtypes) for op, route in routes.items()
                          if route.chain))
    settings = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("FLAGGEMS_")))
    return (dispatch_key, chains, id(compiled_entry), compiled.generation(), settings, PLAN_CAPACITY,
            PLAN_FREE_MISSES, PLAN_RETRY_EVERY)


class Binding:
    """What one ``enable()`` routes: set up by it, switched off by ``disable()``.

    Registrations are made once per op and dispatch key for the process and
    then only pointed at the entries of the ``enable()`` in force (``None``
    after ``disable()``: the kernel they cover serves), so that enabling and
    disabling while other threads call routed ops is safe (:func:`release`
    removes them). With the compiled entry (``compiled``, the module of
    :mod:`flaggems.compiled`) each op is registered through it: its plan
    cache serves the steady state and a miss calls the op's planner
    (:mod:`flaggems.planner`). Without it, or while a log channel is on (the
    compiled entry logs nothing), the Python entry serves.
    """

    def __init__(self, dispatch_key: str) -> None:
        self.dispatch_key = dispatch_key
        self.slots: list[tuple[_PySlot, Callable[..., Any]]] = []
        self.registry: Any = None
        self.ops: dict[str, Callable[..., Any]] = {}
        self.natives: dict[str, NativeKernel] = {}

    def register(self, routes: dict[str, Route], channels: frozenset[str], compiled_entry: Any = None) -> None:
        """Point one entry per routed op at the dispatcher (ops routed to native stay untouched).

        A CompositeImplicitAutograd op (``repeat_interleave.self_int``, ...)
        is registered on the backend's Autograd key too: with only a backend
        kernel, torch would run it under its "autograd not implemented"
        fallback and gradients would be wrong. At the Autograd key the native
        kernel is the composite itself, so a call that needs autograd (the
        implementation declines it) decomposes and records the graph.
        """
        from .planner import build_planner

        DECLINES.clear()
        use_compiled = compiled_entry is not None and not channels
        prepared = []
        for op, route in routes.items():
            if not route.chain:
                continue
            chain = resolve_chain(route)
            for key in self._keys_for(op):
                native = NativeKernel.capture(op, key)
                # The compiled entry checks unservable calls in C++ before its Python entry is reached.
                entry = build_entry(op, chain, native, channels, gate=not use_compiled,
                                    autograd_key=key.startswith("Autograd"))
                prepared.append((op, key, chain, entry, native))
        if use_compiled:
            strict = bool(config.get("FLAGGEMS_STRICT"))  # a malformed plan raises instead of being counted
            fingerprint = _fingerprint(self.dispatch_key, routes, compiled_entry)
            kept = _KEPT.pop(fingerprint, None)
            if kept is not None:  # the same routes, entry, settings and kernel context: its plans still hold
                _KEPT[fingerprint] = kept
                kept.register_all()
                self.registry = kept
                self._note(prepared)
                return
            registry = compiled_entry.Registry()
            for op, key, chain, entry, native in prepared:
                namespace, qualified = namespace_of(op)
                name, _, overload = qualified.partition(".")
                registry.add(f"{namespace}::{name}", overload, key, entry,
                             build_planner(chain, native, goes_native_test(native), op,
                                           autograd_key=key.startswith("Autograd")), PLAN_CAPACITY,
                             PLAN_FREE_MISSES, PLAN_RETRY_EVERY, strict)
            registry.register_all()
            self.registry = registry
            _KEPT[fingerprint] = registry
            while len(_KEPT) > KEPT_REGISTRIES:
                _KEPT.pop(next(iter(_KEPT)))
        else:
            # Every kernel a new slot covers is captured before any of them is registered: once the backend
            # key of a CompositeImplicitAutograd op holds a registration, its Autograd key's current kernel is
            # torch's "autograd not implemented" fallback, which a switched-off slot must not forward to.
            below = {(op, key): NativeKernel.current(op, key) for op, key, *_ in prepared
                     if (op, key) not in _PY_SLOTS}
            for op, key, _, entry, _ in prepared:
                slot = _PY_SLOTS.get((op, key))
                if slot is None:
                    slot = _PY_SLOTS[(op, key)] = _PySlot(op, key, below[(op, key)])
                slot.serve = entry
                self.slots.append((slot, entry))
        self._note(prepared)

    def _note(self, prepared: list[tuple]) -> None:
        for op, key, _, entry, native in prepared:
            if key == self.dispatch_key:
                self.ops[op] = entry
                self.natives[op] = native

    def _keys_for(self, op: str) -> tuple[str, ...]:
        name = _overload(op).name()
        if torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd"):
            return (self.dispatch_key, "Autograd" + self.dispatch_key)
        return (self.dispatch_key,)

    def plan_stats(self) -> dict[str, dict[str, int]]:
        """Per op and key: plans cached and calls served by replay, native, Python, misses (compiled entry)."""
        return dict(self.registry.stats()) if self.registry is not None else {}

    def clear_plans(self) -> None:
        """Drop every cached plan (the next call of each key plans again)."""
        if self.registry is not None:
            self.registry.clear_plans()

    def unregister(self) -> None:
        """Switch every entry of this binding off: the kernels the registrations cover serve again."""
        for slot, entry in self.slots:
            if slot.serve is entry:
                slot.serve = None
        if self.registry is not None:
            self.registry.unregister_all()
        self.slots = []
        self.registry = None
        self.ops.clear()
        self.natives.clear()
