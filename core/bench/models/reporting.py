"""Reporting: the environment record, the text table, the ``--json`` document and the ``--plot`` bars."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import flaggems

from .. import report, runner
from ..runner import FLAGGEMS, TORCH, Target
from . import _deps
from ._common import (
    ACCURACY_FACTOR,
    GRAD_TOLERANCE,
    LOGITS_TOLERANCE,
    PATCHED,
    SIDE_NAMES,
    SMOKE_BANNER,
    MetricResult,
    ModelResult,
    ModelWorkload,
    Settings,
)
from .sides import run_sides


# -- reporting ------------------------------------------------------------------------------
def environment(target: Target, settings: Settings) -> dict[str, Any]:
    """Where and how the numbers were taken, as ``flaggems bench`` records it, plus the model settings."""
    names, absent = run_sides(settings)
    meta = runner.environment(target, settings, names)  # type: ignore[arg-type] # Settings has smoke and describe()
    meta.update(steps=settings.steps if settings.steps is not None else f"auto (~{settings.round_ms:g} ms a round)",
                rounds=settings.rounds if settings.rounds is not None else "per workload",
                warmup=settings.warmup if settings.warmup is not None else "per workload",
                transformers=_version(), liger_kernel=_liger_version(), sides_absent=absent,
                logits_tolerance=LOGITS_TOLERANCE, grad_tolerance=GRAD_TOLERANCE,
                accuracy_factor=ACCURACY_FACTOR)
    meta["routes"] = {row["op"]: row["chosen"] for row in flaggems.routes()}
    return meta


def _version() -> str | None:
    if not _deps.transformers_available():
        return None
    try:
        import transformers
    except Exception as exc:  # noqa: BLE001 - a broken install is reported per workload
        return f"unimportable ({type(exc).__name__})"
    return transformers.__version__


def _liger_version() -> str | None:
    if _deps.liger_unavailable() is not None:
        return None
    from importlib import metadata

    try:
        return metadata.version("liger-kernel")
    except metadata.PackageNotFoundError:
        return "unknown"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}" if value < 100 else f"{value:.0f}"


def _match(result: ModelResult) -> str:
    return {True: "yes", False: "NO", None: "-"}[result.match]


def table_sides(results: Sequence[ModelResult]) -> list[str]:
    """The sides any result timed, in :data:`SIDE_NAMES` order."""
    timed = {name for r in results for name in r.timed_sides()}
    return [s for s in SIDE_NAMES if s in timed]


def _ratio(metric: MetricResult, side: str) -> str:
    r = metric.ratios.get(side)
    return "-" if r is None else f"{r['median']:.3f}x ({r['low']:.2f}-{r['high']:.2f})"


def columns(sides: Sequence[str]) -> tuple[str, ...]:
    """The table's header: a column per side's ms and per non-torch side's ratio."""
    others = [s for s in sides if s != TORCH]
    return ("workload", "metric", *[f"{s} ms" for s in sides], *[f"torch/{s}" for s in others], "steps", "match")


def rows(results: Sequence[ModelResult], sides: Sequence[str] | None = None) -> list[tuple[str, ...]]:
    """One row per metric of each workload that ran: each side's ms, each torch/side ratio [range]."""
    sides = table_sides(results) if sides is None else sides
    out = []
    for r in results:
        for i, m in enumerate(r.metrics):
            first = i == 0
            out.append((r.workload if first else "", m.name, *[_ms(m.ms.get(s)) for s in sides],
                        *[_ratio(m, s) for s in sides if s != TORCH],
                        str(r.steps_per_round) if first else "", _match(r) if first else ""))
    return out


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}" if value >= 10 or value == int(value) else f"{value:.1f}"


def call_rows(results: Sequence[ModelResult], sides: Sequence[str]) -> list[tuple[str, ...]]:
    """One row per metric: per side, operator calls per unit, with device kernels after a slash where counted."""
    out = []
    for r in results:
        for i, m in enumerate(r.metrics):
            cells = [_count(m.calls.get(s)) + (f" / {_count(m.launches[s])}" if s in m.launches else "")
                     for s in sides]
            out.append((r.workload if i == 0 else "", m.name, *cells))
    return out


def _align(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in (header, *body)) for i in range(len(header))]
    return ["  ".join(c.rjust(widths[i]) if i >= 2 else c.ljust(widths[i]) for i, c in enumerate(row)).rstrip()
            for row in (header, *body)]


def _counts(counts: Mapping[str, int], limit: int = 8) -> str:
    items = [f"{name} x{n}" for name, n in counts.items()]
    return ", ".join(items[:limit]) + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


def ops_lines(results: Sequence[ModelResult]) -> list[str]:
    """Per workload and flaggems side: what served its calls in the checked step, what went native, declines."""
    lines = ["flaggems dispatch in one untimed step (op -> implementation x calls):"]
    for r in results:
        if r.status != "ok":
            continue
        for name, side in r.sides.items():
            if name not in (FLAGGEMS, PATCHED) or not side.ran:
                continue
            served = _counts(side.flaggems_ops) or "NO call served by flaggems (all native)"
            lines.append(f"  {r.workload} [{name}]: {served}")
            if side.native_calls:
                lines.append(f"    native: {_counts(side.native_calls)}")
            if side.declines:
                lines.append(f"    declined: {_counts(side.declines, 4)}")
            patched = side.info.get("patch", {}).get("patched")
            if patched:
                lines.append(f"    flaggems.patch: {_counts(patched)}")
            if side.off_replay:  # steady-state calls that took Python or the planner (flaggems.testing.steady)
                lines.append("    off the replay path: " + "; ".join(
                    f"{op} " + ", ".join(f"{k} {v}" for k, v in counts.items() if v)
                    for op, counts in side.off_replay.items()))
    return lines


def summary(results: Sequence[ModelResult]) -> dict[str, Any]:
    """Per non-torch side, the geomean of the first metric's ratio; the flaggems one also as ``geomean_ratio``."""
    sides: dict[str, dict[str, Any]] = {}
    for side in SIDE_NAMES[1:]:
        ratios = [r.metrics[0].ratios[side]["median"] for r in results if r.metrics and side in r.metrics[0].ratios]
        if ratios:
            sides[side] = {"geomean_ratio": math.exp(sum(math.log(v) for v in ratios) / len(ratios)),
                           "workloads_timed": len(ratios)}
    ours = sides.get(FLAGGEMS, {})
    return {"geomean_ratio": ours.get("geomean_ratio"), "workloads_timed": ours.get("workloads_timed", 0),
            "sides": sides, "skipped": sum(r.status == "skipped" for r in results),
            "failed": sum(r.failed for r in results)}


def table(results: Sequence[ModelResult], meta: Mapping[str, Any]) -> str:
    """The human-readable report: banner, context, the times, calls per step, dispatch counts, problems."""
    lines = [SMOKE_BANNER] if meta["smoke"] else []
    liger = f"  liger_kernel {meta['liger_kernel']}" if meta.get("liger_kernel") else ""
    lines.append(f"{meta['device']}  torch {meta['torch']}  triton {meta['triton']}  flaggems {meta['flaggems']}"
                 f"  transformers {meta['transformers'] or '-'}{liger}  backend {meta['backend']}")
    lines.append(meta["timing"])
    lines.extend(f"side {name} absent: {why}" for name, why in meta.get("sides_absent", {}).items())
    sides = table_sides(results)
    if any(r.metrics for r in results):
        lines.extend(_align(columns(sides), rows(results, sides)))
        for side, stats in (() if meta["smoke"] else summary(results)["sides"].items()):
            lines.append(f"geomean torch/{side} (first metric of each workload; >1: {side} faster): "
                         f"{stats['geomean_ratio']:.3f}x over {stats['workloads_timed']} workloads")
        lines.append("calls per unit of each metric in one untimed step: operator calls at the dispatcher"
                     + (" / CUDA kernels" if any(m.launches for r in results for m in r.metrics) else ""))
        lines.extend(_align(("workload", "metric", *[f"{s} calls" for s in sides]), call_rows(results, sides)))
        lines.extend(ops_lines(results))
    lines.extend(problems(results))
    return "\n".join(lines)


def problems(results: Sequence[ModelResult]) -> list[str]:
    """A line per skipped workload or side, per error and per side whose output differs from torch's."""
    found = []
    for r in results:
        if r.status == "skipped":
            found.append(f"skipped {r.workload}: {r.reason}")
        elif r.error:
            found.append(f"error: {r.workload}: {r.error}")
        for name, side in r.sides.items():
            if side.status == "skipped":
                found.append(f"skipped side {name} of {r.workload}: {side.reason}")
            elif side.status == "error":
                found.append(f"error: {r.workload} [{name}]: {side.error}")
            elif side.match is False:
                found.append(f"MISMATCH: {r.workload} [{name}]: differs from torch's output: {side.check}")
    return found


def listing(workloads: Sequence[ModelWorkload]) -> str:
    """``--list``: each workload's name, what it runs, its default rounds and estimated time on an H200."""
    lines = [f"  {w.name:<24} {w.description}{' [needs transformers]' if w.needs_transformers else ''} "
             f"[{w.rounds} rounds, {w.warmup} warm-up; ~{w.estimate_s} s]" for w in workloads]
    total = sum(w.estimate_s for w in workloads)
    return "\n".join([f"{len(workloads)} model workloads (smoke: tiny sizes, see flaggems.bench.models); "
                      f"about {total // 60} min {total % 60} s on an H200 with four sides:", *lines])


def document(results: Sequence[ModelResult], meta: Mapping[str, Any]) -> dict[str, Any]:
    """The ``--json`` document."""
    return {"meta": dict(meta), "summary": summary(results), "results": [r.as_dict() for r in results]}


def write_json(path: str, results: Sequence[ModelResult], meta: Mapping[str, Any]) -> None:
    """Write :func:`document` to ``path``."""
    report.dump_json(path, document(results, meta))


def write_plot(path: str, results: Sequence[ModelResult], meta: Mapping[str, Any]) -> None:
    """Bars of torch / side per workload, metric and side from 1x, log scale, whiskers over the rounds' range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    others = [s for s in table_sides(results) if s != TORCH]
    labels = [(r, m) for r in results for m in r.metrics if m.ratios]
    height = 0.8 / max(1, len(others))
    fig, ax = plt.subplots(figsize=(11, 1.6 + 0.3 * max(1, len(labels)) * max(1, len(others)) ** 0.5))
    for k, side in enumerate(others):
        for y, (r, m) in enumerate(labels):
            ratio = m.ratios.get(side)
            if ratio is None:
                continue
            bad = r.sides[side].match is False
            at = y + k * height
            ax.barh(at, ratio["median"] - 1.0, left=1.0, height=height, color="red" if bad else f"C{k}",
                    label=side if y == next(i for i, (_, q) in enumerate(labels) if side in q.ratios) else None)
            ax.errorbar(ratio["median"], at, xerr=[[ratio["median"] - ratio["low"]], [ratio["high"] - ratio["median"]]],
                        fmt="none", ecolor="black", capsize=2, linewidth=0.7)
            ax.text(ratio["high"], at, f" {ratio['median']:.2f}x", va="center", fontsize=6)
    ax.set_yticks([y + height * (len(others) - 1) / 2 for y in range(len(labels))],
                  [f"{r.workload}: {m.name}" for r, m in labels], fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.set_xlabel("torch / side wall time per step: median of the rounds' pairs, whiskers lowest-highest\n"
                  "(right of 1x: the side is faster; red: its output differs)")
    if others:
        ax.legend(loc="lower right", fontsize=8)
    title = f"flaggems bench --models on {meta['device']} (torch {meta['torch']}, {meta['date']})"
    ax.set_title(f"{title}\n{SMOKE_BANNER}" if meta["smoke"] else title, fontsize=9,
                 color="red" if meta["smoke"] else "black")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
