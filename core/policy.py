"""Dispatch policy: which implementation chain each operator gets.

Resolved once, at ``enable()``. Per op the default chain is::

    active vendor implementations (priority, then plugin name)
      -> generic implementations (same order)
      -> native torch kernel (always last, never recurses)

Overrides, highest precedence first:

1. ``enable(include=..., exclude=...)``
2. ``FLAGGEMS_OP_<op>=native|generic|vendor|<vendor or plugin name>``
3. the routes file ``FLAGGEMS_ROUTES=path.toml`` (``op = "impl"``)
4. ``FLAGGEMS_FORCE=generic|vendor|native``
5. the backend's own defaults: ``Backend.native_ops`` (ops its vendor's torch
   serves better stay native, with the backend's reason)
6. the default chain above

A backend's ``unsupported_dtypes`` (float64 on Ascend) hold under every
route: each link of the chain declines such a call to the native kernel.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from . import config, userwarn
from .backends import ActiveBackend
from .types import OpImpl


class PolicyError(ValueError):
    """A route or override that cannot be honoured (raised in strict mode)."""


def normalize_op(name: str) -> str:
    """``"aten::copy_.default"`` -> ``"copy_"``; ``"aten::add.Tensor"`` -> ``"add.Tensor"``."""
    name = name.strip()
    if name.startswith("aten::"):
        name = name[len("aten::"):]
    if name.endswith(".default"):
        name = name[: -len(".default")]
    return name


#: The namespace of flaggems' own operators (:mod:`flaggems.ops`), kept in their route names.
OWN_NAMESPACE = "flaggems::"


def op_candidates(name: str) -> tuple[str, ...]:
    """The route names a user's op name may mean, normalised.

    ``"aten::add.Tensor"`` and ``"add.Tensor"`` mean the aten op; a bare name also means flaggems' own
    operator of that name (``"rms_norm"``: ``aten::rms_norm`` or ``flaggems::rms_norm``); a name with a
    namespace means only that namespace's.
    """
    op = normalize_op(name)
    if "::" in name:
        return (op,)
    return (op, OWN_NAMESPACE + op)


@dataclass(frozen=True)
class Link:
    """One implementation in an op's chain."""

    impl: OpImpl
    plugin: str
    tier: str  # "vendor" or "generic"

    @property
    def label(self) -> str:
        """``plugin[:name]`` as shown in routes and logs."""
        name = self.impl.name
        return f"{self.plugin}:{name}" if name and name != self.plugin else self.plugin


@dataclass(frozen=True)
class Route:
    """The resolved chain of one operator and why it is so."""

    op: str
    chain: tuple[Link, ...]
    source: str
    reason: str
    candidates: tuple[Link, ...] = ()
    notes: tuple[str, ...] = field(default=())
    #: dtypes the backend does not compute (``Backend.unsupported_dtypes``): every link declines them.
    unsupported_dtypes: tuple[str, ...] = ()
    backend: str = ""

    @property
    def chosen(self) -> str:
        """Label of the implementation tried first (``native`` when none)."""
        return self.chain[0].label if self.chain else "native"

    def as_dict(self) -> dict:
        """Plain-data view for ``routes()`` and JSON output."""
        return {
            "op": self.op,
            "chain": [link.label for link in self.chain] + ["native"],
            "chosen": self.chosen,
            "source": self.source,
            "reason": self.reason,
            "declines": [link.label for link in self.chain
                         if link.impl.supports is not None or self.unsupported_dtypes],
            "candidates": [f"{link.label} ({link.tier}, priority {link.impl.priority})"
                           for link in self.candidates],
            "notes": list(self.notes),
            "unsupported_dtypes": list(self.unsupported_dtypes),
        }


def load_routes_file(path: str) -> dict[str, str]:
    """Read ``op = "impl"`` pairs from a TOML routes file (:func:`flaggems.config.read_routes_file`), the op
    names normalised; ``PolicyError`` with the file's problem."""
    try:
        routes = config.read_routes_file(path)
    except ValueError as exc:
        raise PolicyError(str(exc)) from None
    return {normalize_op(k): v.strip() for k, v in routes.items()}


def default_links(impls: Iterable[tuple[str, OpImpl]], active: ActiveBackend) -> dict[str, list[Link]]:
    """Group applicable implementations by op and order them: vendor tier, then generic."""
    by_op: dict[str, list[Link]] = {}
    for plugin, impl in impls:
        if impl.vendor is not None and impl.vendor != active.vendor:
            continue
        if impl.dispatch_keys and active.dispatch_key not in impl.dispatch_keys:
            continue
        tier = "generic" if impl.vendor is None else "vendor"
        by_op.setdefault(normalize_op(impl.op), []).append(Link(impl, plugin, tier))
    for links in by_op.values():
        links.sort(key=lambda link: (link.tier != "vendor", -link.impl.priority, link.plugin))
    return by_op


def _ties(links: Sequence[Link]) -> list[str]:
    """Describe pairs of same-tier links at equal priority from different plugins."""
    notes = []
    for first, second in zip(links, links[1:]):
        if (first.tier, first.impl.priority) == (second.tier, second.impl.priority) and first.plugin != second.plugin:
            notes.append(f"{first.label} and {second.label} have equal priority "
                         f"{first.impl.priority}: chose {first.label} (plugin name order)")
    return notes


def _select(links: Sequence[Link], choice: str, active: ActiveBackend) -> tuple[Link, ...] | None:
    """Filter a chain by a route value; ``None`` when the value matches nothing."""
    if choice == "native":
        return ()
    if choice in ("generic", "vendor"):
        picked = tuple(link for link in links if link.tier == choice)
    elif choice == active.vendor or choice == active.name:
        picked = tuple(link for link in links if link.tier == "vendor")
    else:
        picked = tuple(link for link in links if link.plugin == choice or link.label == choice)
    return picked or None


@dataclass
class Overrides:
    """Every override source, gathered once per ``enable()``."""

    include: frozenset[str] | None = None
    exclude: frozenset[str] = frozenset()
    per_op_env: Mapping[str, str] = field(default_factory=dict)
    routes_file: Mapping[str, str] = field(default_factory=dict)
    routes_path: str = ""
    force: str = ""

    @classmethod
    def gather(cls, include: Iterable[str] | None, exclude: Iterable[str] | None,
               environ: Mapping[str, str] | None = None) -> Overrides:
        """Read the environment (and routes file) once."""
        path = config.get("FLAGGEMS_ROUTES", environ)
        return cls(
            include=None if include is None else frozenset(normalize_op(o) for o in include),
            exclude=frozenset(normalize_op(o) for o in exclude or ()),
            per_op_env={normalize_op(k): v for k, v in config.op_overrides(environ).items()},
            routes_file=load_routes_file(path) if path else {},
            routes_path=path,
            force=config.get("FLAGGEMS_FORCE", environ),
        )

    def route_value(self, op: str) -> tuple[str, str] | None:
        """The (value, source) deciding ``op``, highest precedence first.

        ``include`` wins over a lower-precedence ``native``: naming an op in
        ``enable(include=...)`` routes it even if the environment would not.
        """
        if op in self.exclude:
            return "native", "enable(exclude=...)"
        if self.include is not None and op not in self.include:
            return "native", "enable(include=...) does not name it"
        lower = self._lower_value(op)
        if lower is not None and lower[0] == "native" and self.include is not None:
            return None
        return lower

    def _lower_value(self, op: str) -> tuple[str, str] | None:
        if op in self.per_op_env:
            env_name = config.op_env_name(op)
            return self.per_op_env[op], f"{env_name}={self.per_op_env[op]}"
        if op in self.routes_file:
            return self.routes_file[op], f"routes file {self.routes_path}"
        if self.force:
            return self.force, f"FLAGGEMS_FORCE={self.force}"
        return None


def resolve(impls: Iterable[tuple[str, OpImpl]], active: ActiveBackend, overrides: Overrides,
            strict: bool = False) -> dict[str, Route]:
    """Build the route of every op that has at least one implementation."""
    routes: dict[str, Route] = {}
    for op, links in sorted(default_links(impls, active).items()):
        notes = _ties(links)
        if notes and strict:
            raise PolicyError(f"{op}: " + "; ".join(notes))
        for note in notes:
            userwarn.warn(f"flaggems: {op}: {note}")
        route = _route_for(op, links, active, overrides, notes, strict)
        routes[op] = dataclasses.replace(route, unsupported_dtypes=tuple(active.backend.unsupported_dtypes),
                                         backend=active.name)
    implemented = set(routes)
    for op in sorted((overrides.include or frozenset()) - routes.keys()):
        routes[op] = Route(op, (), "enable(include=...)", "no implementation of this op is installed")
    _warn_unknown_ops(overrides, implemented)
    return routes


def _warn_unknown_ops(overrides: Overrides, implemented: set[str]) -> None:
    """One warning per override naming an op no installed plugin implements, with the closest names."""
    named = [(op, f"{config.OP_PREFIX}{op.replace('.', '__')}") for op in overrides.per_op_env]
    named += [(op, f"the routes file {overrides.routes_path}") for op in overrides.routes_file]
    named += [(op, "enable(include=...)") for op in sorted(overrides.include or ())]
    named += [(op, "enable(exclude=...)") for op in sorted(overrides.exclude)]
    for op, source in named:
        if op in implemented:
            continue
        close = difflib.get_close_matches(op, sorted(implemented), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        userwarn.warn(f"flaggems: {source} names {op!r}, which no installed plugin implements{hint}")


def _route_for(op: str, links: list[Link], active: ActiveBackend, overrides: Overrides,
               notes: list[str], strict: bool) -> Route:
    decided = overrides.route_value(op)
    if decided is None:
        why_native = active.backend.native_ops.get(op)
        if why_native is not None and not (overrides.include and op in overrides.include):
            return Route(op, (), f"backend {active.name}", f"native on {active.name}: {why_native}",
                         tuple(links), tuple(notes))
        return Route(op, tuple(links), "default", _default_reason(links), tuple(links), tuple(notes))
    value, source = decided
    picked = _select(links, value, active)
    if picked is None and source.startswith("FLAGGEMS_FORCE"):
        return Route(op, (), source, f"no {value} implementation of this op: native", tuple(links), tuple(notes))
    if picked is None:
        unmatched = (f"{op}: route {value!r} from {source} matches no installed implementation "
                     f"(have: {', '.join(link.label for link in links)})")
        if strict:
            raise PolicyError(f"{unmatched}; FLAGGEMS_STRICT refuses it: fix the route or remove it")
        message = f"{unmatched}; using the default chain"
        userwarn.warn(f"flaggems: {message}")
        return Route(op, tuple(links), "default", _default_reason(links), tuple(links), (*notes, message))
    reason = "native kernel only" if not picked else f"restricted to {value}"
    return Route(op, picked, source, reason, tuple(links), tuple(notes))


def _default_reason(links: Sequence[Link]) -> str:
    tiers = sorted({link.tier for link in links}, key=lambda t: t != "vendor")
    return "default order: " + " > ".join(tiers) + " > native"
