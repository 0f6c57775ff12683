"""``flaggems bench``: torch native vs flaggems on the seed workloads.

For each op and shape (declared in each op family's ``shapes`` part, gathered
by :mod:`flaggems.bench.shapes`) it measures torch native, flaggems (routing policy in force) and,
with ``--route generic|vendor``, forced routes (``--route untuned``: the
default chain without the active vendor's tuning, i.e. what its launch
policy changes):

* kernel time: ``triton.testing.do_bench`` median;
* wall time per call, host overhead included (the device synchronised
  around rounds of back-to-back calls; median over rounds);
* speedup = torch / route, and GB/s where the bytes moved are countable;
* ``ran``: the implementation that actually ran (from the
  ``flaggems.dispatch`` log channel, on for one untimed probe call only), and
  ``ok``: whether the result matches torch's.

Usage::

    flaggems bench --list                       # ops and workloads (no device needed)
    flaggems bench --op copy_ --op index_copy_  # a GPU run of two ops
    flaggems bench --route generic --json out.json --plot out.png
    flaggems bench --smoke --op copy_           # tiny shapes; also on the CPU interpreter
    flaggems bench --models                     # real model code instead: flaggems.bench.models

Without a GPU only ``--smoke`` runs (timings then are meaningless, and say so).
Exit status: 0; 1 when a side raised or a result differs from torch's;
2 for a usage problem or a refused run.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

HELP = "time torch native vs flaggems on the seed workloads"
NO_GPU = ("flaggems bench: no GPU: the active backend is {backend!r} ({reason}).\n"
          "Timings on the Triton CPU interpreter mean nothing, so nothing was measured. Run it on a GPU,\n"
          "or pass --smoke for a tiny functional run (timings labelled meaningless).")

EXAMPLES = """examples:
  flaggems bench --list                          ops and workloads (no device needed)
  flaggems bench --json out.json --plot out.png  everything, on a GPU
  flaggems bench --op index_copy_ --dtype fp16   one aten op, one dtype
  flaggems bench --op copy_ --route generic      also the generic implementations alone
  FLAGGEMS_VENDOR=kunlunxin flaggems bench --op copy_ --route untuned
                                                 a vendor's launch policy against the generic one
  flaggems bench --smoke --op copy_              tiny shapes, also without a GPU (timings meaningless)
  flaggems bench --models --json models.json     real model code (Llama/Qwen2 decoders, UNet stack), on a GPU
  flaggems bench --models --only 'unet*' --smoke a tiny model run, also without a GPU

exit status: 0; 1 when a side raised or a result differs from torch's; 2 for a usage problem
or a refused run (no GPU without --smoke). See benchmarks/README.md."""

Handler = Callable[[argparse.Namespace], int]


def register_cli(sub: Any, commands: dict[str, tuple[Handler, str]]) -> None:
    """Add the ``bench`` subcommand to the ``flaggems`` parser and its handler to ``commands``."""
    parser = sub.add_parser("bench", help=HELP)
    parser.description = "Time torch native vs flaggems (and forced routes) on the seed workloads."
    parser.epilog = EXAMPLES
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_arguments(parser)
    commands["bench"] = (cmd_bench, HELP)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``flaggems bench``."""
    parser.add_argument("--op", action="append", default=[], metavar="NAME",
                        help="a bench op (copy_, index_copy...) or an aten op it routes (index_copy_); repeatable")
    add_common_arguments(parser)
    parser.add_argument("--route", action="append", default=[], choices=("generic", "vendor", "untuned"),
                        help="also time this forced route (FLAGGEMS_FORCE), or 'untuned': the default chain "
                             "without the vendor's tuning; repeatable")
    parser.add_argument("--dtype", action="append", default=[], metavar="NAME",
                        help="only workloads with this dtype (fp16, bf16, fp32, int64...); repeatable")
    parser.add_argument("--models", action="store_true",
                        help="time real model code instead (Llama and Qwen2 decoders, a UNet-style stack: "
                             "flaggems.bench.models); takes --only, --side, --steps, --rounds, --warmup")
    add_model_arguments(parser)


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``flaggems bench`` and ``flaggems bench --models`` (``benchmarks/models.py``)."""
    parser.add_argument("--list", action="store_true", help="list the workloads, run nothing")
    parser.add_argument("--json", metavar="PATH", help="write every number and the environment as JSON")
    parser.add_argument("--plot", metavar="PNG", help="write a bar chart of speedups (needs matplotlib)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes and a couple of iterations (works without a GPU; timings meaningless)")


def add_model_arguments(parser: argparse.ArgumentParser, prefix: str = "with --models: ") -> None:
    """The options of the model benchmark (``prefix`` starts each help text)."""
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help="only this workload, a name or a glob such as 'llama*' (see --list); without --models "
                             "the seed workloads' names, e.g. '*vs F.rms_norm*'; repeatable")
    parser.add_argument("--steps", type=_count(1), metavar="N",
                        help=f"{prefix}timed steps per round (default: as many as take ~200 ms on torch; "
                             "1 with --smoke)")
    parser.add_argument("--rounds", type=_count(1), metavar="N",
                        help=f"{prefix}timed rounds per side, the sides interleaved (default: each workload's, "
                             "15, or 8 for the *_decode_b* ones, see --list; 1 with --smoke)")
    parser.add_argument("--warmup", type=_count(0), metavar="N",
                        help=f"{prefix}untimed steps per side before the rounds (default: each workload's, 3, "
                             "or 1 for the *_decode_b* ones; 0 with --smoke)")
    parser.add_argument("--side", action="append", default=[],
                        choices=("flaggems", "patched", "liger", "compiled", "patched+compiled"),
                        help=f"{prefix}time torch against this side only (repeatable; default: flaggems, "
                             "patched, and liger where liger_kernel is installed; compiled: torch.compile of "
                             "the model, patched+compiled: of a patched copy with flaggems enabled)")


def _count(least: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``least``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, not {value}")
        return value

    return parse


def _fail(message: str) -> int:
    print(f"flaggems bench: {message}", file=sys.stderr)
    return 2


def invalid_configuration() -> int:
    """2, with each reason on stderr once, when a ``FLAGGEMS_*`` value is one ``enable()`` refuses; else 0.

    Checked before anything runs: every side of every workload enables flaggems, so a bad value would
    otherwise fail each of them, once per workload.
    """
    from .. import config  # importing flaggems discovered the plugins and declared their variables

    problems = config.problems()
    for message in problems.values():
        print(f"flaggems bench: error: {message}", file=sys.stderr)
    if problems:
        print(f"flaggems bench: nothing was run: enable() refuses this configuration ({', '.join(problems)}); "
              "see flaggems env", file=sys.stderr)
    return 2 if problems else 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Handler of ``flaggems bench`` (see the module docstring)."""
    refused = invalid_configuration()
    if refused:
        return refused
    if args.models:
        from .models import cmd_models

        return cmd_models(args)
    model_only = [flag for flag, value in (("--steps", args.steps), ("--rounds", args.rounds),
                                           ("--warmup", args.warmup), ("--side", args.side))
                  if value not in (None, [])]
    if model_only:
        return _fail(f"{', '.join(model_only)} apply only with --models")
    from . import report, runner, shapes

    workloads = shapes.all_workloads()
    unknown = sorted(set(args.op) - shapes.known_ops(workloads))
    if unknown:
        return _fail(f"unknown op(s) {', '.join(unknown)}; known: {', '.join(sorted({w.op for w in workloads}))} "
                     f"(or an aten op they route; see --list){_disabled_plugins()}")
    chosen = shapes.select(workloads, args.op, args.dtype, args.only)
    if not chosen:
        return _fail("no workload matches --op/--dtype/--only (see --list)")
    if args.list:
        print(report.listing(chosen))
        return 0
    if args.plot and not report.plot_available():
        return _fail("--plot needs matplotlib (pip install 'flaggems-core[bench]')")
    target = runner.detect()
    if not target.gpu and not args.smoke:
        print(NO_GPU.format(backend=target.backend, reason=target.reason), file=sys.stderr)
        return 2
    return _run(args, chosen, target)


def _disabled_plugins() -> str:
    """Where a plugin failed (its workloads then are missing): ``"; disabled plugin(s): name (why)"``, else ``""``."""
    from ..runtime import RUNTIME

    failed = [f"{r.name} ({r.error})" for r in RUNTIME.manager.records.values() if r.status == "failed"]
    return f"; disabled plugin(s), whose workloads are missing: {'; '.join(failed)}" if failed else ""


def _run(args: argparse.Namespace, chosen: list, target: Any) -> int:
    from . import report, runner

    timing = runner.Timing.for_run(args.smoke)
    side_names = runner.sides(args.route)
    if args.smoke:
        results = _run_smoke(chosen, side_names, target, timing)
    else:
        with report.progress(len(chosen)) as step:
            results = runner.run_all(chosen, side_names, target, timing, step, report.print_rows)
    meta = runner.environment(target, timing, side_names)
    if not args.smoke:
        print(report.table(results, meta))
    if args.json:
        report.write_json(args.json, results, meta)
    if args.plot:
        report.write_plot(args.plot, results, meta)
    return 1 if any(r.failed for r in results) else 0


def _run_smoke(chosen: list, side_names: list[str], target: Any, timing: Any) -> list:
    """A smoke run, reported compactly: a line per op as its workloads finish, then the totals and problems.

    Interpreter timings say nothing of speed, so no speedup is printed (``--json`` keeps them, marked).
    """
    from . import report, runner

    start = time.perf_counter()
    with report.progress(len(chosen), quiet=True) as step:
        smoke = report.SmokeReport([w.op for w in chosen], step.write)
        for line in smoke.head(runner.environment(target, timing, side_names)):
            step.write(line)
        results = runner.run_all(chosen, side_names, target, timing, step, smoke.finished)
        smoke.flush()
    print("\n".join(smoke.tail(time.perf_counter() - start)))
    return results
