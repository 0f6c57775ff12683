"""The one registry of every ``FLAGGEMS_*`` environment variable.

Every variable the library reads is declared here with its type, default and
documentation; the README's table is checked against this registry by a test.
Booleans share one truth table (:func:`parse_bool`). Unknown ``FLAGGEMS_*``
names get a warning, so a typo never silently does nothing.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from . import userwarn

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off", ""})

#: Prefix of the per-op override variables (``FLAGGEMS_OP_copy_=native``).
OP_PREFIX = "FLAGGEMS_OP_"


def parse_bool(name: str, text: str) -> bool:
    """Parse a boolean the same way for every variable (case-insensitive)."""
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(
        f"{name}={text!r} is not a boolean; use one of "
        f"{sorted(TRUE_WORDS)} or {sorted(FALSE_WORDS - {''})}"
    )


def parse_list(name: str, text: str) -> tuple[str, ...]:
    """Parse a comma-separated list, dropping blanks."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _parse_str(name: str, text: str) -> str:
    return text.strip()


def _choice_parser(choices: tuple[str, ...]) -> Callable[[str, str], str]:
    def parse(name: str, text: str) -> str:
        value = text.strip().lower()
        if value not in choices:
            raise ValueError(f"{name}={text!r}: expected one of {', '.join(choices)}")
        return value

    return parse


@dataclass(frozen=True)
class EnvVar:
    """Declaration of one environment variable."""

    name: str
    kind: str
    default: Any
    doc: str
    parse: Callable[[str, str], Any]

    def read(self, environ: Mapping[str, str] | None = None) -> Any:
        """Return the parsed value from ``environ`` (default: ``os.environ``)."""
        env = os.environ if environ is None else environ
        text = env.get(self.name)
        if text is None:
            return self.default
        return self.parse(self.name, text)


def _parse_positive_int(name: str, text: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name}={text!r}: expected a positive integer")
    return value


LOG_CHANNELS = ("dispatch", "fallback", "plugins")
FORCE_CHOICES = ("generic", "vendor", "native")
ENTRY_CHOICES = ("auto", "compiled", "python")

REGISTRY: dict[str, EnvVar] = {
    var.name: var
    for var in (
        EnvVar("FLAGGEMS_VENDOR", "str", "",
               "Select the backend by name (validated; unknown names are an error listing "
               "the valid ones). Without the hardware the vendor's implementations run "
               "simulated on the device that exists.", _parse_str),
        EnvVar("FLAGGEMS_PLUGINS", "list", (),
               "Allowlist of plugin entry-point names to load; empty loads all. The default plugin (generic) "
               "is always loaded unless FLAGGEMS_DISABLE_PLUGINS names it.", parse_list),
        EnvVar("FLAGGEMS_DISABLE_PLUGINS", "list", (),
               "Plugin entry-point names not to load (applied before import).", parse_list),
        EnvVar("FLAGGEMS_FORCE", "choice", "",
               "Route every op to one tier: generic, vendor or native.",
               _choice_parser(FORCE_CHOICES)),
        EnvVar("FLAGGEMS_ROUTES", "path", "",
               "TOML file of per-op routes, e.g. copy_ = \"native\" (values as for FLAGGEMS_OP_<op>).",
               _parse_str),
        EnvVar(OP_PREFIX + "<op>", "pattern", "",
               "Per-op route: native, generic, vendor, or a vendor or plugin name; dots in the op name as __, "
               "e.g. FLAGGEMS_OP_repeat_interleave__Tensor=native.", _parse_str),
        EnvVar("FLAGGEMS_STRICT", "bool", False,
               "Turn ambiguities (two implementations at equal priority, a broken or "
               "invalid plugin) into errors instead of warnings.", parse_bool),
        EnvVar("FLAGGEMS_LOG", "list", (),
               "Comma-separated log channels: dispatch, fallback, plugins.", parse_list),
        EnvVar("FLAGGEMS_CHECK_INDICES", "bool", False,
               "Validate index arguments with a host synchronisation on GPU "
               "(always done on the CPU interpreter).", parse_bool),
        EnvVar("FLAGGEMS_GROUPED_SCATTER", "bool", True,
               "Group a large random 1-D scatter (1-, 2- or 4-byte elements, 4+ stores per "
               "32-byte sector) by destination region before writing it (index_copy; two n-pair "
               "workspaces). 0: the plain scatter.", parse_bool),
        EnvVar("FLAGGEMS_ENTRY", "choice", "auto",
               "Dispatcher entry: auto (the compiled C++ entry with its plan cache where it builds, else Python), "
               "compiled (a build failure is an error) or python.", _choice_parser(ENTRY_CHOICES)),
        EnvVar("FLAGGEMS_DEPENDENT_LAUNCH", "bool", True,
               "Let a kernel that reads the previous kernel's output start while that one finishes "
               "(programmatic dependent launch: NVIDIA compute capability 9.0+, e.g. repeat_interleave's "
               "expand after its scan). 0: plain stream order.", parse_bool),
        EnvVar("FLAGGEMS_KIT_CASES", "int", 60,
               "Random cases per op and implementation of the randomized conformance kit (flaggems kit, "
               "tests/test_conformance_random.py).", _parse_positive_int),
    )
}


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """Read a registered variable; raises ``KeyError`` for an undeclared name."""
    return REGISTRY[name].read(environ)


def current(name: str, environ: Mapping[str, str] | None = None) -> str:
    """What ``name`` is set to now, as ``flaggems env`` shows it (``<op>`` variables listed together)."""
    env = os.environ if environ is None else environ
    if name == OP_PREFIX + "<op>":
        found = [f"{k}={v}" for k, v in sorted(env.items()) if k.startswith(OP_PREFIX)]
        return ", ".join(found) if found else "(none set)"
    return repr(env[name]) if name in env else "(not set)"


def problems(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``{name: error}`` of every set variable whose value ``enable()`` would refuse (empty: all valid).

    The one set of rules: :func:`validate` raises the first of them, ``flaggems env``
    marks each and ``flaggems info`` reports them.
    """
    env = os.environ if environ is None else environ
    found: dict[str, str] = {}
    for var in REGISTRY.values():
        if var.name in env:
            try:
                var.read(env)
            except ValueError as exc:
                found[var.name] = str(exc)
    if "FLAGGEMS_LOG" not in found:
        unknown = [c for c in REGISTRY["FLAGGEMS_LOG"].read(env) if c not in LOG_CHANNELS]
        if unknown:
            found["FLAGGEMS_LOG"] = f"FLAGGEMS_LOG: unknown channel(s) {unknown}; known: {', '.join(LOG_CHANNELS)}"
    path = env.get("FLAGGEMS_ROUTES", "").strip()
    if path:
        try:
            read_routes_file(path)
        except ValueError as exc:
            found["FLAGGEMS_ROUTES"] = str(exc)
    return found


def read_routes_file(path: str) -> dict[str, str]:
    """The ``{op: route}`` pairs of the TOML routes file ``path`` (``FLAGGEMS_ROUTES``), as written.

    ``op = "route"`` lines, at the top or under ``[routes]``. Raises ``ValueError`` naming the variable
    and the file when it is missing, unreadable, not TOML, or holds a value that is no route.
    """
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    where = f"FLAGGEMS_ROUTES={path}"
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except OSError as exc:
        raise ValueError(f"{where}: cannot read the routes file ({exc.strerror or exc}); fix the path or "
                         f"unset FLAGGEMS_ROUTES") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f'{where}: not valid TOML ({exc}); expected lines like copy_ = "native"') from None
    routes = data.get("routes", data)
    if not isinstance(routes, dict):
        raise ValueError(f'{where}: "routes" must be a table of lines like copy_ = "native", '
                         f"not {type(routes).__name__}")
    bad = {op: value for op, value in routes.items() if not isinstance(value, str) or not value.strip()}
    if bad:
        raise ValueError(f"{where}: route values must be non-empty strings (native, generic, vendor, or a vendor "
                         f"or plugin name), got {bad}")
    return dict(routes)


def validate(environ: Mapping[str, str] | None = None) -> None:
    """Parse every set variable now, so a bad value fails ``enable()`` with its name, not a later op call."""
    for message in problems(environ).values():
        raise ValueError(message)


#: ``FLAGGEMS_OP_flaggems__rms_norm`` names flaggems' own ``flaggems::rms_norm`` (``::`` spelled ``__`` too).
OWN_OPS_PREFIX = "flaggems__"


def op_env_name(op: str) -> str:
    """The ``FLAGGEMS_OP_<op>`` variable of ``op`` (``.`` and ``::`` spelled ``__``)."""
    return OP_PREFIX + op.replace("::", "__").replace(".", "__")


def _op_of(suffix: str) -> str:
    if suffix.startswith(OWN_OPS_PREFIX):
        return "flaggems::" + suffix[len(OWN_OPS_PREFIX):].replace("__", ".")
    return suffix.replace("__", ".")


def op_overrides(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Return ``{op: route}`` from ``FLAGGEMS_OP_<op>`` variables (``__`` means ``.``, or ``::`` after ``flaggems``)."""
    env = os.environ if environ is None else environ
    return {
        _op_of(key[len(OP_PREFIX):]): value.strip()
        for key, value in env.items()
        if key.startswith(OP_PREFIX) and len(key) > len(OP_PREFIX)
    }


def unknown_names(environ: Mapping[str, str] | None = None) -> list[str]:
    """Return ``FLAGGEMS_*`` names in the environment that are not declared."""
    env = os.environ if environ is None else environ
    return sorted(
        key for key in env
        if key.startswith("FLAGGEMS_") and key not in REGISTRY and not key.startswith(OP_PREFIX)
    )


#: Names FlagGems users set out of habit, and the variable that does it here.
HABITS = {"GEMS_VENDOR": "FLAGGEMS_VENDOR", "FLAGGEMS_BACKEND": "FLAGGEMS_VENDOR", "FLAGGEMS_DEVICE": "FLAGGEMS_VENDOR"}


def warn_unknown(environ: Mapping[str, str] | None = None) -> None:
    """Warn once about every unknown ``FLAGGEMS_*`` variable (with the closest known names) and FlagGems habits."""
    env = os.environ if environ is None else environ
    for habit, ours in HABITS.items():
        if habit in env:
            userwarn.warn(f"{habit}={env[habit]} is FlagGems' variable and is ignored here; "
                          f"set {ours}={env[habit]} instead")
    for name in unknown_names(environ):
        if name in HABITS:
            continue
        close = difflib.get_close_matches(name, sorted(REGISTRY), n=2)
        hint = f"did you mean {', '.join(close)}?" if close else f"known: {', '.join(sorted(REGISTRY))}"
        userwarn.warn(f"unknown environment variable {name} is ignored; {hint}")


def markdown_table() -> str:
    """Render the registry as the README's Markdown table."""
    rows = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    for var in REGISTRY.values():
        default = ",".join(var.default) if isinstance(var.default, tuple) else var.default
        rows.append(f"| `{var.name}` | {var.kind} | `{default}` | {var.doc} |")
    return "\n".join(rows)
