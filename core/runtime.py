"""Process-wide state: discovered plugins, the active backend, the binding.

Everything here runs at import, selection or ``enable()`` time. The public
functions of :mod:`flaggems` are thin wrappers around :data:`RUNTIME`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from . import backends, compiled, config, log, policy, userwarn
from .backends import ActiveBackend
from .binding import Binding
from .manager import PluginError, PluginManager, fill_distributions
from .toolkit import context as kernel_context
from .toolkit import tuning as launch_tuning
from .types import Backend, OpImpl, PatchRule, Tuning, resolve_callable


def _as_records(result: Any, kind: type, plugin: str, hook: str) -> list:
    """Validate a hook's return value: a sequence of ``kind`` records."""
    items = [result] if isinstance(result, kind) else list(result)
    bad = [item for item in items if not isinstance(item, kind)]
    if bad:
        raise TypeError(f"plugin {plugin!r}: {hook} returned {type(bad[0]).__name__}, expected {kind.__name__}")
    return items


def _importable(routes: dict[str, policy.Route]) -> dict[str, policy.Route]:
    """Routes without the implementations whose lazy ``"module:attr"`` fails to import.

    A broken implementation is disabled with one warning naming its plugin and
    op (an error under ``FLAGGEMS_STRICT``); every other link and op still routes.
    """
    out = {}
    for op, route in routes.items():
        kept, notes = [], list(route.notes)
        for link in route.chain:
            try:
                resolve_callable(link.impl.fn)
                if link.impl.supports is not None:
                    resolve_callable(link.impl.supports)
            except Exception as exc:  # noqa: BLE001 - any import or attribute error disables this link only
                message = (f"flaggems: plugin {link.plugin!r}: the {op} implementation failed to import "
                           f"({type(exc).__name__}: {exc}); it is disabled, the rest of the chain serves {op}")
                if config.get("FLAGGEMS_STRICT"):
                    raise RuntimeError(message) from exc
                userwarn.warn(message)
                notes.append(f"{link.label} disabled: {type(exc).__name__}: {exc}")
                continue
            kept.append(link)
        out[op] = route if len(kept) == len(route.chain) else dataclasses.replace(
            route, chain=tuple(kept), notes=tuple(notes))
    return out


def op_names(value: Iterable[str] | str | None, argument: str) -> tuple[str, ...] | None:
    """``enable()``'s ``include``/``exclude`` as a tuple of op names (``None`` stays ``None``).

    A bare string is one op name, not its characters; any other iterable holds names. Raises ``TypeError``
    naming ``argument`` for a value that is neither, or an element that is not a string.
    """
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    try:
        names = tuple(value)
    except TypeError:
        raise TypeError(f"{argument} must be an op name or an iterable of op names, "
                        f"not {type(value).__name__}") from None
    bad = [name for name in names if not isinstance(name, str)]
    if bad:
        raise TypeError(f"{argument} must hold op names (str), got {bad[0]!r} ({type(bad[0]).__name__})")
    return names


def _is_dtype_name(name: Any) -> bool:
    import torch

    return isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype)


#: Names of the backends built into the core (a plugin may not declare one of them again).
BUILTIN_NAMES = frozenset(b.name for b in backends.BUILTIN)


class FrozenTuning:
    """The merged tuning of one kernel context: the plugins' hooks run once, at the first read, and the answer
    holds until the context is reset (each kernel family's read ran every plugin's hook before); a key no
    plugin tunes reads empty. A plugin's bad tuning raises at that read, as ``enable()`` does."""

    def __init__(self, merge: Callable[[], dict[str, dict[str, Any]]]) -> None:
        self._merge = merge
        self._merged: dict[str, dict[str, Any]] | None = None

    def __call__(self, key: str) -> dict[str, Any]:
        """A copy of ``key``'s values (the caller may keep or change it)."""
        if self._merged is None:
            self._merged = self._merge()
        return dict(self._merged.get(key, {}))


class Runtime:
    """Owns discovery, backend selection, routing and the torch binding."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.manager = PluginManager()
        self._active: ActiveBackend | None = None
        self._binding: Binding | None = None
        self._enabled_with: tuple | None = None
        self._routes: dict[str, policy.Route] = {}
        self._backend_owner: dict[str, str] = {}
        self._vendor_tuning = True
        self.discovered = False

    # -- discovery and selection -------------------------------------------
    def discover(self) -> None:
        """Load the entry-point plugins once (called on ``import flaggems``)."""
        with self.lock:
            if not self.discovered:
                self.discovered = True
                self.manager.discover()
                self.declare_env_vars()

    def declare_env_vars(self) -> None:
        """Add each plugin's ``FLAGGEMS_<PLUGIN>_*`` variables (``flaggems_env_vars``) to the registry.

        Called at discovery; again after registering a plugin by hand (tests, notebooks).
        """
        for plugin, result in self.manager.call_each("flaggems_env_vars"):
            prefix = "FLAGGEMS_" + plugin.upper().replace("-", "_").replace(".", "_") + "_"
            for var in [result] if isinstance(result, config.EnvVar) else list(result):
                problem = None
                if not isinstance(var, config.EnvVar):
                    problem = f"returned {type(var).__name__}, expected flaggems.config.EnvVar"
                elif not var.name.startswith(prefix) or len(var.name) == len(prefix):
                    problem = f"declares {var.name}, but its variables must be named {prefix}<NAME>"
                elif var.name in config.REGISTRY and config.REGISTRY[var.name] is not var:
                    problem = f"declares {var.name} again"
                if problem is None:
                    config.REGISTRY[var.name] = var
                    continue
                message = f"flaggems: {self._who(plugin)}: flaggems_env_vars {problem}; it is ignored"
                if config.get("FLAGGEMS_STRICT"):
                    raise PluginError(message)
                userwarn.warn(message)

    def vendor_backends(self) -> list[Backend]:
        """Backends declared by the loaded plugins (two with one name are an error naming both plugins)."""
        found: list[Backend] = []
        self._backend_owner = {}
        for plugin, backend in self._records("flaggems_backends", Backend):
            if backend.name in self._backend_owner or backend.name in BUILTIN_NAMES:
                first = self._backend_owner.get(backend.name)
                first_text = self._who(first) if first else "flaggems-core (built in)"
                raise PluginError(f"backend {backend.name!r} is declared twice: by {first_text} "
                                  f"and by {self._who(plugin)}; uninstall one of them")
            bad = [name for name in backend.unsupported_dtypes if not _is_dtype_name(name)]
            if bad:
                raise PluginError(f"backend {backend.name!r} of {self._who(plugin)}: unsupported_dtypes "
                                  f"names {', '.join(map(repr, bad))}, not torch dtypes (e.g. 'float64')")
            self._backend_owner[backend.name] = plugin
            found.append(backend)
        return found

    def _records(self, hook: str, kind: type, **kwargs: Any) -> Iterator[tuple[str, Any]]:
        """``(plugin, record)`` for each ``kind`` record the plugins' ``hook`` returns (``kwargs``: the hook's
        arguments); the records of a plugin whose answer holds anything else are skipped with a warning."""
        for plugin, result in self.manager.call_each(hook, **kwargs):
            try:
                records = _as_records(result, kind, plugin, hook)
            except TypeError as exc:
                userwarn.warn(f"flaggems: {exc}")
                continue
            for record in records:
                yield plugin, record

    def _who(self, plugin: str) -> str:
        """``plugin 'x' (distribution d v)`` for messages."""
        record = self.manager.records.get(plugin)
        if record is not None and not record.distribution:
            fill_distributions({plugin: record})
        dist = f" (distribution {record.distribution} {record.version})" if record and record.distribution else ""
        return f"plugin {plugin!r}{dist}"

    def active_backend(self) -> ActiveBackend:
        """Select the backend on first use and cache the answer."""
        with self.lock:
            if self._active is None:
                requested = config.get("FLAGGEMS_VENDOR")
                declared = self.vendor_backends()
                try:
                    self._active = backends.select(declared, requested, self._backend_owner)
                except backends.BackendConflict as conflict:
                    names = " and ".join(f"{b.name!r} of {self._who(self._backend_owner[b.name])}"
                                         for b in conflict.claims)
                    raise PluginError(f"two vendor plugins claim this machine's device: {names}; set "
                                      f"FLAGGEMS_VENDOR to one of {', '.join(repr(b.name) for b in conflict.claims)}"
                                      ) from None
                backends.prepare_interpreter(self._active)
                log.logger("plugins").info("backend %s (%s)", self._active.name, self._active.reason)
                kernel_context.reset()  # a new backend: kernels read a new context
            return self._active

    def reset(self) -> None:
        """Forget the backend choice (tests change the environment between calls)."""
        with self.lock:
            self.disable()
            self._active = None
        kernel_context.reset()

    def kernel_context(self) -> kernel_context.KernelContext:
        """The context kernels read (:mod:`flaggems.toolkit.context`), built from the active backend."""
        active = self.active_backend()
        facts = active.backend.facts
        if active.simulated or facts is None:
            facts = kernel_context.cuda_facts if active.device_type == "cuda" else None
        from .binding import native_scope

        return kernel_context.KernelContext(
            device_type=active.device_type, interpreter=active.interpreter,
            checks=bool(config.get("FLAGGEMS_CHECK_INDICES")) or active.interpreter,
            dependent_launch=bool(config.get("FLAGGEMS_DEPENDENT_LAUNCH")),
            grouped_scatter=bool(config.get("FLAGGEMS_GROUPED_SCATTER")),
            facts_source=None if facts is None else resolve_callable(facts),
            native_scope=native_scope, tuning=FrozenTuning(self.tuning))

    # -- implementations ---------------------------------------------------
    def implementations(self) -> list[tuple[str, OpImpl]]:
        """Every ``(plugin, OpImpl)`` offered for the active backend."""
        active = self.active_backend().backend
        impls: list[tuple[str, OpImpl]] = []
        vendor_plugins = set(self._backend_owner.values())
        for plugin, impl in self._records("flaggems_operators", OpImpl, backend=active):
            if plugin in vendor_plugins and impl.vendor is None:
                message = (f"flaggems: {self._who(plugin)} declares a backend, so its {impl.op} "
                           f"implementation must name its vendor (OpImpl(..., vendor=...)); it is ignored")
                if config.get("FLAGGEMS_STRICT"):
                    raise PluginError(message)
                userwarn.warn(message)
                continue
            impls.append((plugin, impl))
        return impls

    def patch_rules(self) -> list[tuple[str, PatchRule]]:
        """Every ``(plugin, PatchRule)`` for the active backend, their lazy references resolved: the op families'
        own (``flaggems/ops/<family>/patch.py``, named ``flaggems.ops.<family>``) first, then the plugins' (a
        vendor's only when its backend is active). A rule that does not resolve is left out with one warning
        naming its plugin (a :class:`PluginError` under ``FLAGGEMS_STRICT``)."""
        from . import families

        active = self.active_backend()
        rules: list[tuple[str, PatchRule]] = []
        offered = [(record.package, record.read("patch", "RULES", ())) for record in families.specs()]
        offered += self.manager.call_each("flaggems_patch_rules", backend=active.backend)
        for plugin, result in offered:
            for rule in _as_records(result, PatchRule, plugin, "flaggems_patch_rules"):
                if rule.vendor is not None and rule.vendor != active.vendor:
                    continue
                try:
                    resolved = dataclasses.replace(rule, **{
                        name: resolve_callable(getattr(rule, name)) for name in ("decline", "forward", "matches")
                        if getattr(rule, name) is not None})
                except (ImportError, AttributeError, TypeError) as exc:
                    message = f"flaggems: {self._who(plugin)}: flaggems_patch_rules: {rule.kind}: {exc}; left out"
                    if config.get("FLAGGEMS_STRICT"):
                        raise PluginError(message) from None
                    userwarn.warn(message)
                    continue
                rules.append((plugin, resolved))
        return rules

    def tuning(self) -> dict[str, dict[str, Any]]:
        """Merged tuning values per key: generic first, the active vendor's on top."""
        active = self.active_backend()
        generic: list[Tuning] = []
        vendor: list[Tuning] = []
        for plugin, result in self.manager.call_each("flaggems_tuning", backend=active.backend):
            for item in _as_records(result, Tuning, plugin, "flaggems_tuning"):
                try:
                    launch_tuning.check_tuning(item.key, item.values)
                except ValueError as exc:
                    raise PluginError(f"{self._who(plugin)}: flaggems_tuning: {exc}") from None
                if item.vendor is None:
                    generic.append(item)
                elif item.vendor == active.vendor and self._vendor_tuning:
                    vendor.append(item)
        merged: dict[str, dict[str, Any]] = {}
        for item in (*generic, *vendor):
            merged.setdefault(item.key, {}).update(item.values)
        return merged

    @contextlib.contextmanager
    def without_vendor_tuning(self) -> Iterator[None]:
        """Inside the block the shared kernels run with the generic tuning only (the bench's ``untuned`` side).

        Kernels read a new context (the compiled entry's plans dropped with the old) on the way in and out.
        """
        with self.lock:
            saved, self._vendor_tuning = self._vendor_tuning, False
        kernel_context.reset()  # a new context, and the compiled plans made under the old one dropped
        try:
            yield
        finally:
            with self.lock:
                self._vendor_tuning = saved
            kernel_context.reset()

    def compute_routes(self, include: Iterable[str] | str | None = None,
                       exclude: Iterable[str] | str | None = None) -> dict[str, policy.Route]:
        """Resolve every op's chain under the current overrides (no registration)."""
        overrides = policy.Overrides.gather(op_names(include, "include"), op_names(exclude, "exclude"))
        return policy.resolve(self.implementations(), self.active_backend(), overrides,
                              strict=config.get("FLAGGEMS_STRICT"))

    # -- enable / disable --------------------------------------------------
    def enable(self, include: Iterable[str] | str | None = None, exclude: Iterable[str] | str | None = None) -> None:
        """Register the routed ops on the backend's dispatch key (idempotent).

        ``include``/``exclude``: an op name or an iterable of them (:func:`op_names`).
        """
        include, exclude = op_names(include, "include"), op_names(exclude, "exclude")
        key = (None if include is None else tuple(sorted(include)), tuple(sorted(exclude or ())))
        config.validate()
        with self.lock:
            if self._binding is not None and self._enabled_with == key:
                return
            self.disable()
            active = self.active_backend()
            self.tuning()  # a plugin's bad tuning fails here, naming the plugin, not at a kernel's first call
            routes = _importable(self.compute_routes(include, exclude))
            binding = Binding(active.dispatch_key)
            log.configure()  # FLAGGEMS_LOG; channels switched on in code count too
            channels = frozenset(c for c in log.CHANNELS if log.is_on(c))
            module, _ = compiled.load()
            binding.register(routes, channels, module)
            self._binding, self._enabled_with, self._routes = binding, key, routes

    def disable(self) -> None:
        """Remove every registration; native kernels run again (idempotent)."""
        with self.lock:
            if self._binding is not None:
                self._binding.unregister()
            self._binding, self._enabled_with, self._routes = None, None, {}

    def release(self) -> None:
        """``disable()``, then remove flaggems' registrations from the dispatcher (see :func:`flaggems.release`)."""
        from .binding import release

        with self.lock:
            self.disable()
            release()

    @property
    def enabled_with(self) -> tuple | None:
        """The ``(include, exclude)`` of the current enable, or ``None``."""
        return self._enabled_with

    def routes(self) -> dict[str, policy.Route]:
        """The routes in force, or those ``enable()`` would install."""
        with self.lock:
            return dict(self._routes) if self._binding is not None else self.compute_routes()

    def entry(self) -> dict[str, Any]:
        """Which dispatcher entry serves the routed ops, and why."""
        active, reason = compiled.status()
        if self._binding is not None and active == "compiled" and self._binding.registry is None:
            return {"active": "python", "reason": "a log channel is on (the compiled entry does not log)"}
        return {"active": active, "reason": reason}

    def plan_stats(self) -> dict[str, dict[str, int]]:
        """The compiled entry's plan counters per op and key (empty with the Python entry)."""
        return self._binding.plan_stats() if self._binding is not None else {}

    def clear_plans(self) -> None:
        """Drop every plan the compiled entry cached (tests that change planner constants call it), those
        kept for a later ``enable()`` included."""
        from .binding import forget_plans

        forget_plans()
        if self._binding is not None:
            self._binding.clear_plans()

    def registered_ops(self) -> list[str]:
        """Ops currently overridden on the dispatcher."""
        return sorted(self._binding.ops) if self._binding else []

    # -- reporting ---------------------------------------------------------
    def _tuning_report(self) -> dict[str, Any]:
        """The merged tuning in force, or the plugin's error (``info`` reports, it never raises)."""
        try:
            return self.tuning()
        except PluginError as exc:
            return {"error": str(exc)}

    def info(self) -> dict[str, Any]:
        """Backend, probes and plugins as plain data."""
        import torch

        active = self.active_backend()
        fill_distributions(self.manager.records)
        try:
            import triton

            triton_version = triton.__version__
        except Exception as exc:  # noqa: BLE001
            triton_version = f"unavailable ({type(exc).__name__}: {exc})"
        from . import __version__

        return {
            "flaggems": __version__,
            "torch": torch.__version__,
            "triton": triton_version,
            "backend": {
                "name": active.name,
                "vendor": active.vendor,
                "device_type": active.device_type,
                "dispatch_key": active.dispatch_key,
                "simulated": active.simulated,
                "interpreter": active.interpreter,
                "reason": active.reason,
            },
            "probes": [{"backend": name, "available": p.available, "reason": p.reason}
                       for name, p in active.probes],
            "plugins": [rec.as_dict() for rec in self.manager.records.values()],
            "entry": self.entry(),
            "tuning": self._tuning_report(),
            "enabled": self._binding is not None,
            "registered_ops": self.registered_ops(),
        }


RUNTIME = Runtime()
kernel_context.set_provider(RUNTIME.kernel_context)


def _forget_compiled_plans() -> None:
    """Compiled plans hold launch parameters derived from the context (tuned tiles, device facts): one reset."""
    RUNTIME.clear_plans()


kernel_context.on_reset(_forget_compiled_plans)
