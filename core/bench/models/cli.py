"""``flaggems bench --models``: real model code, torch eager against flaggems (and fused rivals), side by side.

The command line of :mod:`flaggems.bench.models` (its docstring describes the run); the first paragraph
above is ``benchmarks/models.py``'s ``--help`` description.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .. import runner
from ..report import plot_available
from ._common import ModelResult, ModelWorkload, Settings
from .reporting import _align, columns, environment, listing, problems, rows, table, table_sides, write_json, write_plot
from .running import run_all
from .workloads import WORKLOADS, select


# -- command line ---------------------------------------------------------------------------
def _usage(message: str) -> int:
    print(f"flaggems bench --models: {message}", file=sys.stderr)
    return 2


def _misplaced_options(args: argparse.Namespace) -> list[str]:
    """Options of the seed-workload bench given with ``--models``, where they mean nothing."""
    return [flag for flag, name in (("--op", "op"), ("--route", "route"), ("--dtype", "dtype"))
            if getattr(args, name, None)]


def cmd_models(args: argparse.Namespace) -> int:
    """Handler of ``flaggems bench --models`` and ``benchmarks/models.py`` (see the package docstring)."""
    misplaced = _misplaced_options(args)
    if misplaced:
        return _usage(f"{', '.join(misplaced)} apply to the seed workloads, not to --models (use --only)")
    chosen = select(args.only)
    if not chosen:
        return _usage(f"no workload matches --only {' '.join(args.only)}; known: "
                      f"{', '.join(w.name for w in WORKLOADS)}")
    if args.list:
        print(listing(chosen))
        return 0
    if args.plot and not plot_available():
        print("flaggems bench --models: --plot: matplotlib is not importable, so no plot is written "
              "(pip install 'flaggems-core[bench]')", file=sys.stderr)
    return _run(args, chosen, Settings.from_args(args))


def _run(args: argparse.Namespace, chosen: Sequence[ModelWorkload], settings: Settings) -> int:
    target = runner.detect()
    total = len(chosen)
    counter = iter(range(1, total + 1))

    def progress(name: str) -> None:
        print(f"[{next(counter)}/{total}] {name}", file=sys.stderr, flush=True)

    def finished(results: Sequence[ModelResult]) -> None:
        if not settings.smoke:  # a long GPU run keeps each workload's rows; a smoke run prints its table once
            _print_partial(results[-1])
        if args.json:
            write_json(args.json, results, environment(target, settings))

    results = run_all(chosen, target, settings, progress, finished)
    meta = environment(target, settings)
    print(table(results, meta))
    if args.json:
        write_json(args.json, results, meta)
    if args.plot and plot_available():
        write_plot(args.plot, results, meta)
    if all(r.status == "skipped" for r in results):
        return 2
    return 1 if any(r.failed for r in results) else 0


def _print_partial(result: ModelResult) -> None:
    """The finished workload's rows on stderr at once (the table on stdout comes after the last one)."""
    sides = table_sides([result])
    body = rows([result], sides)
    lines = _align(columns(sides), body) if body else []
    lines.extend(problems([result]))
    if lines:
        print("\n".join(lines), file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``benchmarks/models.py`` (the options of ``flaggems bench --models``)."""
    from .. import add_common_arguments, add_model_arguments

    parser = argparse.ArgumentParser(prog="benchmarks/models.py", description=__doc__.split("\n\n")[0],
                                     epilog="See benchmarks/README.md.")
    add_common_arguments(parser)
    add_model_arguments(parser, prefix="")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``benchmarks/models.py``."""
    from .. import invalid_configuration

    args = build_parser().parse_args(argv)
    return invalid_configuration() or cmd_models(args)
