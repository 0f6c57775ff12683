"""Plugin discovery and isolation.

Plugins are found through the ``flaggems.plugins`` entry-point group with
stevedore. Each one is imported, registered and validated on its own: a plugin
that fails (import error, misspelled hook, a hook that raises) is recorded as
failed with its error, named in one warning, and everything else keeps working.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pluggy

from . import config, hookspecs, log, userwarn

ENTRY_POINT_GROUP = "flaggems.plugins"


class PluginError(RuntimeError):
    """A plugin could not be loaded or broke the contract (raised in strict mode)."""


@dataclass
class PluginRecord:
    """What the core knows about one plugin (shown by ``flaggems info``)."""

    name: str
    target: str
    distribution: str = ""
    version: str = ""
    status: str = "loaded"  # loaded | failed | skipped
    error: str = ""
    plugin: Any = field(default=None, repr=False)

    def as_dict(self) -> dict[str, str]:
        """Plain-data view for ``info()`` and JSON output."""
        return {
            "name": self.name,
            "entry_point": self.target,
            "distribution": self.distribution,
            "version": self.version,
            "status": self.status,
            "error": self.error,
        }


def _distribution_index() -> dict[tuple[str, str], tuple[str, str]]:
    """``(entry-point name, value) -> (distribution, version)`` for the group (scans metadata: slow)."""
    index: dict[tuple[str, str], tuple[str, str]] = {}
    for dist in importlib.metadata.distributions():
        for ep in dist.entry_points:
            if ep.group == ENTRY_POINT_GROUP:
                index[(ep.name, ep.value)] = (dist.metadata["Name"] or "", dist.version or "")
    return index


def _list_entry_points() -> list[importlib.metadata.EntryPoint]:
    """List the group's entry points without importing any of them."""
    # stevedore caches the entry-point scan on disk (import + scan ~5 ms);
    # a NamedExtensionManager with no names imports nothing.
    from stevedore import NamedExtensionManager

    scan = NamedExtensionManager(ENTRY_POINT_GROUP, names=[])
    seen: dict[str, importlib.metadata.EntryPoint] = {}
    for ep in scan.list_entry_points():
        seen.setdefault(ep.name, ep)
    return list(seen.values())


#: Entry-point name of the default plugin (the generic kernels of flaggems-core).
DEFAULT_PLUGIN = "generic"


class PluginManager:
    """Owns the pluggy manager and the records of every plugin seen."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.records: dict[str, PluginRecord] = {}
        self._lock = threading.RLock()
        self._plog = log.logger("plugins")

    # -- loading -----------------------------------------------------------
    def discover(self, environ: dict[str, str] | None = None) -> None:
        """Load every plugin of the entry-point group, honouring allow/deny lists."""
        allow = set(config.get("FLAGGEMS_PLUGINS", environ))
        deny = set(config.get("FLAGGEMS_DISABLE_PLUGINS", environ))
        if allow:
            allow.add(DEFAULT_PLUGIN)  # the generic kernels stay unless FLAGGEMS_DISABLE_PLUGINS names them
        for ep in _list_entry_points():
            if (allow and ep.name not in allow) or ep.name in deny:
                reason = "not in FLAGGEMS_PLUGINS" if allow and ep.name not in allow else "in FLAGGEMS_DISABLE_PLUGINS"
                self.records[ep.name] = PluginRecord(ep.name, ep.value, status="skipped", error=reason)
                self._plog.info("skipped plugin %s (%s)", ep.name, reason)
                continue
            self._load_entry_point(ep)
        found = {ep.name for ep in _list_entry_points()}
        for name in sorted((allow | deny) - found - {DEFAULT_PLUGIN}):
            close = difflib.get_close_matches(name, sorted(found), n=2)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; installed: {', '.join(sorted(found))}"
            userwarn.warn(f"flaggems: FLAGGEMS_PLUGINS/FLAGGEMS_DISABLE_PLUGINS name {name!r}, which is not an "
                          f"installed plugin{hint}")

    def _load_entry_point(self, ep: importlib.metadata.EntryPoint) -> None:
        try:
            plugin = ep.load()
        except Exception as exc:  # noqa: BLE001 - isolation is the point
            dist, version = _distribution_index().get((ep.name, ep.value), ("", ""))
            record = PluginRecord(ep.name, ep.value, dist, version)
            self._fail(record, f"import failed: {type(exc).__name__}: {exc}")
            return
        # Distribution and version are looked up only when shown (fill_distributions).
        self.register(plugin, ep.name, PluginRecord(ep.name, ep.value))

    def register(self, plugin: Any, name: str, record: PluginRecord | None = None) -> PluginRecord:
        """Register ``plugin`` (module or object with hookimpls) under ``name``.

        Used for entry points and directly by tests and embedding code. The
        plugin is validated on its own; an invalid one is recorded as failed.
        """
        with self._lock:
            record = record or PluginRecord(name, getattr(plugin, "__name__", type(plugin).__name__))
            if name in self.records and self.records[name].status == "loaded":
                self.unregister(name)
            try:
                self.pm.register(plugin, name=name)
                self.pm.check_pending()
            except Exception as exc:  # noqa: BLE001
                if self.pm.get_plugin(name) is not None:
                    self.pm.unregister(name=name)
                self._fail(record, f"invalid plugin: {type(exc).__name__}: {exc}")
                return record
            record.plugin = plugin
            record.status = "loaded"
            self.records[name] = record
            self._plog.info("loaded plugin %s from %s", name, record.target)
            return record

    def unregister(self, name: str) -> None:
        """Remove a plugin and its record."""
        with self._lock:
            if self.pm.get_plugin(name) is not None:
                self.pm.unregister(name=name)
            self.records.pop(name, None)

    def _fail(self, record: PluginRecord, error: str) -> None:
        record.status = "failed"
        record.error = error
        record.plugin = None
        self.records[record.name] = record
        where = f" (distribution {record.distribution} {record.version})" if record.distribution else ""
        message = f"flaggems plugin {record.name!r}{where} disabled: {error}"
        self._plog.info(message)
        if config.get("FLAGGEMS_STRICT"):
            raise PluginError(message)
        userwarn.warn(message)

    # -- calling hooks -----------------------------------------------------
    def call_each(self, hook_name: str, **kwargs: Any) -> Iterator[tuple[str, Any]]:
        """Call one hook on every loaded plugin separately.

        Yields ``(plugin_name, result)``. A plugin whose hook raises is marked
        failed (and unregistered) instead of aborting the whole hook call.
        """
        caller: pluggy.HookCaller = getattr(self.pm.hook, hook_name)
        for impl in reversed(caller.get_hookimpls()):
            name = impl.plugin_name
            args = {arg: kwargs[arg] for arg in impl.argnames}
            try:
                result = impl.function(**args)
            except Exception as exc:  # noqa: BLE001
                record = self.records.get(name) or PluginRecord(name, str(impl.plugin))
                self.pm.unregister(name=name)
                self._fail(record, f"hook {hook_name} raised {type(exc).__name__}: {exc}")
                continue
            if result is not None:
                yield name, result

    def loaded(self) -> list[str]:
        """Names of the plugins currently loaded."""
        return [name for name, rec in self.records.items() if rec.status == "loaded"]


def fill_distributions(records: dict[str, PluginRecord]) -> None:
    """Look up distribution name/version for records that lack it (slow: scans metadata)."""
    missing = [r for r in records.values() if not r.distribution]
    if not missing:
        return
    index = _distribution_index()
    for record in missing:
        record.distribution, record.version = index.get((record.name, record.target), ("", ""))

