"""Command line: ``flaggems info | routes | env | kit | build`` (also ``python -m flaggems``)."""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

#: The compiled entry's reason on a machine without the CUDA driver (its launches then go through Python).
_NO_DRIVER = re.compile(r"no CUDA driver \((?P<detail>[^)]*)\)")


def entry_line(entry: dict[str, str], backend: dict[str, Any]) -> str:
    """``entry: ...`` of ``flaggems info``; without a CUDA driver on a CPU backend, said as the normal state it is."""
    reason = entry["reason"]
    if backend["device_type"] == "cpu" and backend["interpreter"]:
        reason = _NO_DRIVER.sub("CPU only: this machine has no CUDA driver, as expected without a GPU", reason)
    return f"entry: {entry['active']}  ({reason})"


def _print_info(data: dict[str, Any]) -> None:
    backend = data["backend"]
    simulated = " (simulated)" if backend["simulated"] else ""
    print(f"flaggems {data['flaggems']}  torch {data['torch']}  triton {data['triton']}")
    print(f"backend: {backend['name']}{simulated}  vendor={backend['vendor']}  device={backend['device_type']}"
          f"  dispatch_key={backend['dispatch_key']}  interpreter={backend['interpreter']}")
    print(f"  why: {backend['reason']}")
    print("probes:")
    for probe in data["probes"]:
        mark = "yes" if probe["available"] else "no "
        print(f"  {mark} {probe['backend']:<12} {probe['reason']}")
    print("plugins:")
    for plugin in data["plugins"]:
        dist = f"{plugin['distribution']} {plugin['version']}".strip() or "-"
        label = "reason" if plugin["status"] == "skipped" else "error"
        error = f"  {label}: {plugin['error']}" if plugin["error"] else ""
        print(f"  {plugin['status']:<7} {plugin['name']:<12} {plugin['entry_point']:<36} {dist}{error}")
    print(entry_line(data["entry"], backend))
    if data["tuning"]:
        print("tuning (plugins' launch policies in force):")
        for key, values in data["tuning"].items():
            print(f"  {key}: {values}")
    print(f"enabled: {data['enabled']}")


def _print_routes(rows: list[dict[str, Any]]) -> None:
    if not rows:
        print("no routed operators (no implementation installed for this backend)")
        return
    for row in rows:
        print(f"{row['op']}: {' -> '.join(row['chain'])}")
        print(f"  chosen: {row['chosen']}  source: {row['source']}  ({row['reason']})")
        if row["declines"]:
            print(f"  may decline per call: {', '.join(row['declines'])}")
        if row["unsupported_dtypes"] and row["chain"] != ["native"]:
            print(f"  to native: {', '.join(row['unsupported_dtypes'])} (not computed on this backend)")
        for seen in row.get("declined", []):
            print(f"  declined x{seen['count']}: {seen['impl']}: {seen['reason']}")
        for note in row["notes"]:
            print(f"  note: {note}")


def _report_invalid(problems: dict[str, str], command: str | None = None) -> int:
    """Each variable ``enable()`` would refuse, on stderr; 2 when there is one, else 0.

    ``command``: the command that refuses to run because of them (``None``: one that reports them).
    """
    for message in problems.values():
        print(f"flaggems: error: {message}", file=sys.stderr)
    if problems:
        names = ", ".join(problems)
        said = (f"{command} refuses this configuration, as enable() does ({names})" if command
                else f"enable() would refuse this configuration ({names})")
        print(f"flaggems: {said}; see flaggems env", file=sys.stderr)
    return 2 if problems else 0


def cmd_info(args: argparse.Namespace) -> int:
    """Show the backend, why each probe said yes or no, and every plugin (exit 2 on an invalid variable)."""
    import flaggems

    from . import config

    data = flaggems.info()
    problems = config.problems()
    if args.json:
        print(json.dumps({**data, "invalid_variables": problems}, indent=2))
    else:
        _print_info(data)
    return _report_invalid(problems)


def close_ops(name: str, known: Sequence[str], n: int = 3) -> list[str]:
    """The routed op names closest to ``name``, flaggems' own compared without their ``flaggems::``."""
    from .policy import OWN_NAMESPACE, normalize_op

    full = {}
    for op in known:
        full.setdefault(op.removeprefix(OWN_NAMESPACE), op)
    wanted = normalize_op(name).removeprefix(OWN_NAMESPACE)
    return [full[op] for op in difflib.get_close_matches(wanted, list(full), n=n)]


def cmd_routes(args: argparse.Namespace) -> int:
    """Show op -> implementation chain -> chosen, and why (``--op``: an aten name, or one of flaggems' own)."""
    import flaggems

    rows = flaggems.routes(args.op)
    if args.op and not rows:
        known = [row["op"] for row in flaggems.routes()]
        close = close_ops(args.op, known)
        hint = f"; did you mean {' or '.join(close)}?" if close else f"; routed ops: {', '.join(known) or 'none'}"
        print(f"no implementation routes {args.op!r}: it runs natively{hint}", file=sys.stderr)
        return 1
    print(json.dumps(rows, indent=2)) if args.json else _print_routes(rows)
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    """List every FLAGGEMS_* variable (Markdown table with --markdown); exit 2 when a value is invalid."""
    from . import config

    if args.markdown:
        print(config.markdown_table())
        return 0
    problems = config.problems()
    for var in config.REGISTRY.values():
        mark = "  INVALID: enable() refuses it" if var.name in problems else ""
        print(f"{var.name} ({var.kind}, default {var.default!r}) = {config.current(var.name)}{mark}: {var.doc}")
    for name in config.unknown_names():
        print(f"warning: unknown variable {name} is set", file=sys.stderr)
    return _report_invalid(problems)


KIT_ENTRIES = {"both": ("compiled", "python"), "compiled": ("compiled",), "python": ("python",)}


def _print_tally(tally: Any) -> None:
    notes = "".join(f"\n    note: {note}" for note in tally.notes)
    generic = f", {tally.generic} calls from generic plans" if tally.generic else ""
    generic += f", {tally.gradients} with gradients" if tally.gradients else ""
    print(f"  {tally.op:<30} {tally.impl:<12} {tally.mode:<9} passed {tally.passed:>5}  declined "
          f"{tally.declined:>5}  failed {tally.failed:>5}  ({tally.cpu_s:.1f} s CPU{generic}){notes}", flush=True)
    for text in tally.failures[:1]:  # printed as they come: a run stopped by a time limit keeps them
        print("    FAILED " + text.replace("\n", "\n    "), flush=True)


def other_backends_implementing(ops: Sequence[str]) -> dict[str, list[str]]:
    """``{op: [backend, ...]}``: the installed vendor backends, other than the active one, implementing ``op``."""
    from .policy import normalize_op
    from .runtime import RUNTIME
    from .types import OpImpl

    wanted = {normalize_op(op) for op in ops}
    active = RUNTIME.active_backend().name
    found: dict[str, list[str]] = {}
    for backend in RUNTIME.vendor_backends():
        if backend.name == active:
            continue
        for _, result in RUNTIME.manager.call_each("flaggems_operators", backend=backend):
            for impl in result if isinstance(result, (list, tuple)) else [result]:
                op = normalize_op(impl.op) if isinstance(impl, OpImpl) else None
                if op in wanted and impl.vendor == backend.vendor and backend.name not in found.get(op, []):
                    found.setdefault(op, []).append(backend.name)
    return found


def _no_target_hint(args: argparse.Namespace) -> str:
    """Why ``flaggems kit`` found nothing to run, and the command that would run it."""
    import flaggems

    backend = flaggems.backend().name
    lines = [f"flaggems kit: no implementation {'of ' + ', '.join(args.op) + ' ' if args.op else ''}"
             f"{'labelled ' + repr(args.impl) + ' ' if args.impl else ''}is installed for the {backend} backend "
             "(see flaggems routes)"]
    for op, names in sorted(other_backends_implementing(args.op or []).items()):
        lines.append(f"  {op} is implemented for {', '.join(names)}: run it with FLAGGEMS_VENDOR={names[0]} "
                     f"flaggems kit --op {op}")
    return "\n".join(lines)


def cmd_kit(args: argparse.Namespace) -> int:
    """Run the randomized conformance kit: every implementation against native torch.

    Exit 1 on a failure, and when it ran no case at all (nothing installed for the op on this
    backend, or every case declined): a kit that tested nothing must not pass.
    """
    from .testing import random_cases

    modes = (*(() if args.entries_only else ("direct",)), *KIT_ENTRIES[args.entry])
    print(f"flaggems kit: seed {args.seed}, device {random_cases.device()}, modes {', '.join(modes)}")
    tallies = random_cases.run_kit(args.cases, args.op, args.seed, modes, args.impl, progress=_print_tally,
                                   seconds=args.seconds)
    if not tallies:
        print(_no_target_hint(args), file=sys.stderr)
        return 1
    for op in random_cases.idle_ops(tallies):
        print(f"warning: {op}: no implementation ran any case (all declined or none built)")
    failures = [text for tally in tallies for text in tally.failures]
    for text in failures[: args.show]:
        print("FAILED " + text)
    failed, ran = sum(t.failed for t in tallies), sum(t.passed + t.failed for t in tallies)
    print(f"{sum(t.passed for t in tallies)} passed, {sum(t.declined for t in tallies)} declined, {failed} failed")
    tested = sorted({f"{t.op} [{t.impl}]" for t in tallies if t.passed + t.failed})
    if not ran:
        print("flaggems kit: no case ran: nothing was tested", file=sys.stderr)
        return 1
    print(f"implementations tested: {', '.join(tested)}")
    return 1 if failed else 0


def cmd_build(args: argparse.Namespace) -> int:
    """Build the compiled entry now (what the first ``enable()`` would do); exit 1 when it cannot be built.

    A failure says why on stderr: the missing tool, or the first lines of the compiler's or ninja's output.
    """
    import time

    from . import compiled, config

    cached = compiled.is_built()
    start = time.perf_counter()
    ok, folder, reason = compiled.build()
    took = time.perf_counter() - start
    if not ok:
        then = ("enable() will raise (FLAGGEMS_ENTRY=compiled)" if config.get("FLAGGEMS_ENTRY") == "compiled"
                else "enable() will use the Python entry (FLAGGEMS_ENTRY=python says so without trying)")
        print(f"flaggems build: {reason}\n  in {folder}; {then}", file=sys.stderr)
        return 1
    if cached:
        print(f"flaggems build: already built ({reason}) in {folder}")
    else:
        print(f"flaggems build: {reason} in {took:.0f} s, cached in {folder}")
    return 0


COMMANDS: dict[str, tuple[Callable[[argparse.Namespace], int], str]] = {
    "info": (cmd_info, "backend, probes and plugins"),
    "routes": (cmd_routes, "operator routes and why"),
    "env": (cmd_env, "environment variables flaggems reads"),
    "kit": (cmd_kit, "randomized conformance kit: every implementation against native torch"),
    "build": (cmd_build, "build the compiled entry now (the first enable() does otherwise, ~40-80 s)"),
}


#: Commands defined here; optional modules add theirs to COMMANDS (see _add_extra_commands).
BUILTIN = tuple(COMMANDS)

#: Commands that show the configuration, invalid values included, then exit 2 on one; every other command
#: refuses an invalid configuration before doing any work, as ``enable()`` does.
SHOWS_CONFIGURATION = ("info", "env")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``flaggems`` command."""
    from . import __version__

    parser = argparse.ArgumentParser(prog="flaggems", description="Triton operators for PyTorch, with vendor plugins")
    parser.add_argument("--version", action="version", version=f"flaggems {__version__}")
    sub = parser.add_subparsers(dest="command")
    for name in BUILTIN:
        help_text = COMMANDS[name][1]
        cmd = sub.add_parser(name, help=help_text)
        if name in ("info", "routes"):
            cmd.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "routes":
            cmd.add_argument("--op", help="only this operator (e.g. copy_ or repeat_interleave.Tensor)")
        if name == "env":
            cmd.add_argument("--markdown", action="store_true", help="print the README table")
        if name == "kit":
            _add_kit_arguments(cmd)
    _add_extra_commands(sub)
    return parser


def _positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: expected a positive integer")
    return value


def _add_kit_arguments(cmd: argparse.ArgumentParser) -> None:
    """Options of ``flaggems kit``."""
    cmd.add_argument("--cases", type=_positive, default=None,
                     help="random cases per op and implementation (default: FLAGGEMS_KIT_CASES)")
    cmd.add_argument("--op", action="extend", nargs="+", default=None, help="only these ops")
    cmd.add_argument("--seed", type=int, default=0, help="seed of the run (each case's seed derives from it)")
    cmd.add_argument("--entry", choices=tuple(KIT_ENTRIES), default="both",
                     help="dispatcher entries to run the cases through, besides calling each implementation")
    cmd.add_argument("--entries-only", action="store_true",
                     help="skip calling each implementation directly (a long run through the dispatcher only)")
    cmd.add_argument("--impl", default=None, help="only this implementation label (e.g. generic, ascend)")
    cmd.add_argument("--show", type=int, default=10, help="failures to print in full")
    cmd.add_argument("--seconds", type=float, default=None,
                     help="wall-time budget per op, implementation and mode (a long run reports what it reached)")


def _add_extra_commands(sub: Any) -> None:
    """Commands whose modules are optional (e.g. ``bench``) register themselves here."""
    try:
        from .bench import register_cli
    except ImportError:
        return
    register_cli(sub, COMMANDS)


def refuse_invalid(command: str) -> int:
    """2 (with each reason on stderr) when ``command`` must not run under this configuration, else 0.

    The rules are ``enable()``'s (:func:`flaggems.config.problems`); ``info`` and ``env`` report them
    themselves, after showing what they show.
    """
    from . import config

    if command in SHOWS_CONFIGURATION:
        return 0
    return _report_invalid(config.problems(), command)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``flaggems`` console script."""
    from . import userwarn
    from .manager import PluginError

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    handler = COMMANDS[args.command][0]
    try:
        with userwarn.command_line():  # flaggems' warnings as one line each, no source line under them
            return refuse_invalid(args.command) or handler(args)
    except BrokenPipeError:  # `flaggems info | head`: the reader left; say nothing more
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - Python flushes stdout at exit
        return 0
    except (ValueError, PluginError) as exc:  # configuration mistakes: one line that names the fix
        print(f"flaggems: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
