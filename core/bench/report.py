"""Reports of ``flaggems bench``: the table, ``--list``, ``--json``, ``--plot`` and the progress bar."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from .runner import TORCH, Result, geomean
from .workload import Workload, dims

SMOKE_BANNER = "SMOKE RUN: tiny shapes, a couple of iterations; the timings below are meaningless"
COLUMNS = ("op", "workload", "dtype", "route", "torch us", "route us", "speedup", "torch wall", "route wall",
           "wall x", "torch busy us", "route busy us", "busy x", "torch GB/s", "route GB/s", "ok", "ran")


def _num(value: float | None, suffix: str = "") -> str:
    if value is None:
        return "-"
    text = f"{value:.0f}" if value >= 1000 else f"{value:.3g}" if value < 10 else f"{value:.1f}"
    return text + suffix


def _ok(result: Result, side: str) -> str:
    m = result.sides[side]
    if m.error or result.sides[TORCH].error:
        return "ERROR"
    return {True: "yes", False: "NO", None: "-"}[m.match]


def rows(results: Sequence[Result]) -> list[tuple[str, ...]]:
    """One row per workload and non-torch route, torch's figures beside it."""
    out = []
    for r in results:
        base = r.sides[TORCH]
        for side, m in r.sides.items():
            if side == TORCH:
                continue
            w = r.workload
            out.append((w.op, r.label, w.dtype, side, _num(base.kernel_us), _num(m.kernel_us),
                        _num(r.speedup(side), "x"), _num(base.wall_us), _num(m.wall_us),
                        _num(r.speedup(side, "wall_us"), "x"), _num(base.busy_us), _num(m.busy_us),
                        _num(r.speedup(side, "busy_us"), "x"), _num(base.gbps), _num(m.gbps), _ok(r, side),
                        m.ran or "-"))
    return out


def print_rows(result: Result) -> None:
    """One finished workload's rows on stderr, tab-separated (the aligned table on stdout comes at the end)."""
    for row in rows([result]):
        print("\nrow\t" + "\t".join(row), file=sys.stderr, flush=True)


def _align(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in (header, *body)) for i in range(len(header))]
    numeric = {i for i, name in enumerate(header) if name.endswith(("us", "wall", "x", "GB/s", "speedup"))}
    return ["  ".join(cell.rjust(widths[i]) if i in numeric else cell.ljust(widths[i])
                      for i, cell in enumerate(row)).rstrip() for row in (header, *body)]


def summary(results: Sequence[Result], side_names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per route: geomean kernel and wall speedups, and how many workloads count."""
    return {side: {"geomean_speedup": geomean([r.speedup(side) for r in results]),
                   "geomean_wall_speedup": geomean([r.speedup(side, "wall_us") for r in results]),
                   "geomean_busy_speedup": geomean([r.speedup(side, "busy_us") for r in results]),
                   "workloads": sum(1 for r in results if r.speedup(side))}
            for side in side_names if side != TORCH}


def table(results: Sequence[Result], meta: dict[str, Any]) -> str:
    """The human-readable report: banner, one line of context, the rows, geomeans and problems."""
    lines = [SMOKE_BANNER] if meta["smoke"] else []
    lines.append(_context(meta))
    lines.append(meta["timing"])
    lines.extend(_align(COLUMNS, rows(results)))
    for side, stats in summary(results, meta["sides"]).items():
        lines.append(f"geomean speedup {side}: {_num(stats['geomean_speedup'], 'x')} kernel, "
                     f"{_num(stats['geomean_wall_speedup'], 'x')} wall, {_num(stats['geomean_busy_speedup'], 'x')} "
                     f"GPU busy ({stats['workloads']} workloads)")
    lines.extend(problems(results))
    return "\n".join(lines)


def _context(meta: dict[str, Any]) -> str:
    """One line: the device, the versions and the backend."""
    return (f"{meta['device']}  torch {meta['torch']}  triton {meta['triton']}  flaggems {meta['flaggems']}"
            f"  backend {meta['backend']}")


def problems(results: Sequence[Result]) -> list[str]:
    """A line per error and per result that differs from torch's."""
    found = []
    for r in results:
        for side, m in r.sides.items():
            where = f"{r.workload.op} {r.label} {r.workload.dtype} [{side}]"
            if m.error:
                found.append(f"error: {where}: {m.error}")
            elif m.match is False:
                found.append(f"MISMATCH: {where}: differs from torch (max abs diff {m.max_diff})")
    return found


def listing(workloads: Sequence[Workload]) -> str:
    """``--list``: every op, then its workloads with dtype, routed ops and smoke size."""
    lines: list[str] = []
    for op in dict.fromkeys(w.op for w in workloads):
        mine = [w for w in workloads if w.op == op]
        lines.append(f"{op} ({len(mine)} workloads)")
        for w in mine:
            smoke = ", ".join(f"{k}={_brief(v)}" for k, v in w.smoke.items() if not _is_constant(w, k))
            lines.append(f"  {w.name:<52} {w.dtype:<11} routes {','.join(w.routes):<40} smoke: {smoke}"
                         f"  [{w.source}]")
    lines.append(f"{len(workloads)} workloads")
    return "\n".join(lines)


def _is_constant(w: Workload, key: str) -> bool:
    return w.params.get(key) == w.smoke.get(key)


def _brief(value: Any) -> str:
    return dims(value) if isinstance(value, tuple) else str(value)


def document(results: Sequence[Result], meta: dict[str, Any]) -> dict[str, Any]:
    """The ``--json`` document."""
    return {"meta": meta, "summary": summary(results, meta["sides"]), "results": [r.as_dict() for r in results]}


def write_json(path: str, results: Sequence[Result], meta: dict[str, Any]) -> None:
    """Write :func:`document` to ``path``."""
    dump_json(path, document(results, meta))


def dump_json(path: str, doc: Mapping[str, Any]) -> None:
    """Write one JSON document, indented, with a final newline (every bench's ``--json``)."""
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(doc, handle, indent=2)
        handle.write("\n")


def plot_available() -> bool:
    """True when matplotlib can be imported."""
    return importlib.util.find_spec("matplotlib") is not None


def write_plot(path: str, results: Sequence[Result], meta: dict[str, Any]) -> None:
    """Bars of kernel speedup (torch / route) per workload, from 1x on a log scale.

    A hatched bar is a route where flaggems ran nothing (the native kernel ran).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    routes = [s for s in meta["sides"] if s != TORCH]
    height = 0.8 / max(1, len(routes))
    fig, ax = plt.subplots(figsize=(12, 1.8 + 0.22 * len(results) * len(routes) ** 0.5))
    for i, side in enumerate(routes):
        _bars(ax, results, side, i * height, height, f"C{i}")
    ax.set_yticks([y + height * (len(routes) - 1) / 2 for y in range(len(results))],
                  [f"{r.workload.op}: {r.label} {r.workload.dtype}" for r in results], fontsize=7)
    ax.set_ylim(len(results) - 0.5 + height * (len(routes) - 1), -0.5)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.set_xlabel("speedup = torch kernel time / route kernel time (right of 1x: faster than torch; "
                  "hatched: native ran)")
    title = f"flaggems bench on {meta['device']} (torch {meta['torch']}, triton {meta['triton']}, {meta['date']})"
    ax.set_title(f"{title}\n{SMOKE_BANNER}" if meta["smoke"] else title, fontsize=9,
                 color="red" if meta["smoke"] else "black")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _bars(ax: Any, results: Sequence[Result], side: str, offset: float, height: float, color: str) -> None:
    """One route's bars, drawn from 1x to its speedup."""
    for y, r in enumerate(results):
        value = r.speedup(side)
        if value is None:
            continue
        native = r.sides[side].ran.startswith("native")
        ax.barh(y + offset, value - 1.0, left=1.0, height=height, color=color, hatch="///" if native else None,
                alpha=0.45 if native else 1.0, edgecolor="white" if native else color,
                label=side if y == next(i for i, q in enumerate(results) if q.speedup(side)) else None)


class Progress:
    """``step(description)`` per workload, and ``write(line)`` for report lines printed while it runs.

    With tqdm installed, a bar on stderr (lines are written above it); else a counter line per workload on
    stderr, or nothing per workload when ``quiet`` (a smoke run's per-op lines are its progress).
    """

    def __init__(self, total: int, quiet: bool = False) -> None:
        self.total, self.quiet, self.count = total, quiet, 0
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
        else:
            self.bar = tqdm(total=total, file=sys.stderr, unit="workload", dynamic_ncols=True)

    def __call__(self, description: str) -> None:
        """One more workload starts."""
        self.count += 1
        if self.bar is not None:
            self.bar.set_description(description[:60], refresh=False)
            self.bar.update(1)
        elif not self.quiet:
            print(f"[{self.count}/{self.total}] {description}", file=sys.stderr, flush=True)

    def write(self, line: str) -> None:
        """``line`` on stdout, now (above the bar, which tqdm then redraws)."""
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
            sys.stdout.flush()
        else:
            print(line, flush=True)

    def close(self) -> None:
        """Take the bar off the terminal."""
        if self.bar is not None:
            self.bar.close()


@contextlib.contextmanager
def progress(total: int, quiet: bool = False) -> Iterator[Progress]:
    """A :class:`Progress` of ``total`` workloads, closed after the block."""
    shown = Progress(total, quiet)
    try:
        yield shown
    finally:
        shown.close()


# -- the smoke report ------------------------------------------------------------
SMOKE_CHECK = ("a functional check: every workload once per side at its smoke size, each flaggems result against "
               "torch's; no speedup is reported (the interpreter's times are in --json, marked meaningless)")
SMOKE_COLUMNS = ("op", "workloads", "checks", "passed", "failed", "seconds", "ran")


def check_outcome(result: Result, side: str) -> str:
    """``passed``, ``failed`` (a side raised, or the result differs) or ``unchecked``: one side against torch."""
    m = result.sides[side]
    if m.error or result.sides[TORCH].error or m.match is False:
        return "failed"
    return "passed" if m.match else "unchecked"


def smoke_counts(results: Sequence[Result]) -> dict[str, int]:
    """Workloads, checks (one per workload and flaggems side), and how many checks passed and failed."""
    outcomes = [check_outcome(r, side) for r in results for side in r.sides if side != TORCH]
    return {"workloads": len(results), "checks": len(outcomes), "passed": outcomes.count("passed"),
            "failed": outcomes.count("failed")}


def _ran_summary(results: Sequence[Result], limit: int = 3) -> str:
    """The distinct implementations that ran on the flaggems sides (``; ``-separated: one may list several ops)."""
    ran = list(dict.fromkeys(m.ran for r in results for side, m in r.sides.items() if side != TORCH and m.ran))
    more = f" (+{len(ran) - limit} more)" if len(ran) > limit else ""
    return "; ".join(ran[:limit]) + more if ran else "-"


def smoke_row(op: str, results: Sequence[Result]) -> tuple[str, ...]:
    """One op's line of a smoke run: its counts, the seconds its workloads took, what ran."""
    counts = smoke_counts(results)
    seconds = sum(r.seconds or 0.0 for r in results)
    return (op, *(str(counts[k]) for k in SMOKE_COLUMNS[1:5]), f"{seconds:.1f}", _ran_summary(results))


class SmokeReport:
    """A smoke run's report: the context, then a line per op once its workloads ran, then the totals.

    Workloads come grouped by op (op families in order, then plugins'), so an op's line is due when the next
    op's first workload finishes; :meth:`flush` writes the last one.
    """

    def __init__(self, ops: Sequence[str], write: Callable[[str], None]) -> None:
        self.widths = [max(len(SMOKE_COLUMNS[0]), *map(len, ops)), *map(len, SMOKE_COLUMNS[1:-1])]
        self.write = write
        self.pending: list[Result] = []
        self.results: list[Result] = []

    def _line(self, cells: Sequence[str]) -> str:
        first, *numbers, ran = cells
        aligned = [first.ljust(self.widths[0]), *(c.rjust(w) for c, w in zip(numbers, self.widths[1:], strict=True))]
        return "  ".join([*aligned, ran]).rstrip()

    def head(self, meta: dict[str, Any]) -> list[str]:
        """The banner, where it runs, what a smoke run checks, and the column names."""
        return [SMOKE_BANNER, _context(meta), SMOKE_CHECK, self._line(SMOKE_COLUMNS)]

    def finished(self, result: Result) -> None:
        """Take one workload's result; write the previous op's line when this one starts another op."""
        if self.pending and self.pending[0].workload.op != result.workload.op:
            self.flush()
        self.pending.append(result)

    def flush(self) -> None:
        """Write the line of the op whose results are pending."""
        if self.pending:
            self.write(self._line(smoke_row(self.pending[0].workload.op, self.pending)))
            self.results.extend(self.pending)
            self.pending = []

    def tail(self, seconds: float) -> list[str]:
        """The totals of the whole run, then a line per error and per result that differs from torch's."""
        c = smoke_counts(self.results)
        unchecked = c["checks"] - c["passed"] - c["failed"]
        also = f", {unchecked} unchecked" if unchecked else ""
        return [f"smoke: {c['workloads']} workloads, {c['checks']} checks against torch: {c['passed']} passed, "
                f"{c['failed']} failed{also}; {seconds:.0f} s", *problems(self.results)]
