"""Running a workload: each side's checked step, warm-up and census, then the timed rounds, sides
interleaved round by round.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ...testing.steady import off_replay
from .. import runner
from ..runner import FLAGGEMS, TORCH, Target
from . import _deps
from ._common import (
    OFF,
    Case,
    MetricResult,
    ModelApiError,
    ModelResult,
    ModelWorkload,
    Phases,
    Settings,
    SideResult,
    Skip,
    describe_exception,
)
from .calls import Census, census
from .checks import detached_copy
from .sides import FlaggemsSide, Side, make_side, run_sides


# -- running ------------------------------------------------------------------------------
def skip_reason(workload: ModelWorkload, target: Target, smoke: bool) -> str | None:
    """Why ``workload`` cannot run here (no GPU without ``--smoke``, no transformers), or ``None``."""
    if not smoke and not target.gpu:
        return (f"no GPU (active backend {target.backend!r}: {target.reason}); "
                "timings on the Triton interpreter mean nothing (--smoke runs a tiny functional version)")
    if workload.needs_transformers and not _deps.transformers_available():
        return "transformers is not installed (pip install transformers)"
    return None


def dispatch_counts(records: Sequence[tuple[str, str]]) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """(calls served by a flaggems implementation, calls that went native, declines), counted per message."""
    served: Counter[str] = Counter()
    native: Counter[str] = Counter()
    declines: Counter[str] = Counter()
    for channel, message in records:
        if channel == "fallback":
            declines[message] += 1
        elif message.partition(" -> ")[2].startswith("native"):
            native[message] += 1
        else:
            served[message] += 1
    return dict(served.most_common()), dict(native.most_common()), dict(declines.most_common())


def counted_step(case: Case, device: torch.device, side: Side | None = None) -> tuple[Any, list[tuple[str, str]]]:
    """One untimed checked step as ``side`` (default: flaggems) with the dispatch and fallback channels on.

    Returns its output and the log records.
    """
    side = side or FlaggemsSide()
    with runner.capture_dispatch() as captured, side.active(case, log=True):
        output = case.checked_step()
        runner.synchronize(device)
    return output, captured.records


def timed_round(case: Case, device: torch.device, steps: int) -> dict[str, float]:
    """ms per step of each metric over ``steps`` back-to-back steps between two synchronisations."""
    phases = Phases(device)
    runner.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        case.step(phases)
    runner.synchronize(device)
    elapsed = time.perf_counter() - start
    return {m.name: 1e3 * (phases.totals.get(m.phase, 0.0) if m.phase else elapsed) / (steps * m.per_step)
            for m in case.metrics}


def rotation(sides: Sequence[Any], index: int) -> list[Any]:
    """The order of round ``index``: ``sides`` rotated by ``index`` (two sides: the order flips each round)."""
    shift = index % len(sides)
    return [*sides[shift:], *sides[:shift]]


def time_sides(case: Case, sides: Sequence[Side], device: torch.device, settings: Settings,
               rounds: int) -> tuple[dict[str, dict[str, list[float]]], int]:
    """Per side and metric, the ms per step of every round (sides interleaved, order rotated each round).

    Also returns the steps per round: ``settings.steps``, or fitted to a warm torch
    step (``sides[0]``). An untimed step follows each change of side (not in smoke runs).
    """
    samples: dict[str, dict[str, list[float]]] = {s.name: {m.name: [] for m in case.metrics} for s in sides}
    steps = settings.steps
    if steps is None:
        with sides[0].active(case):
            case.side = "fit"  # its own cursor where steps walk a sequence: torch's stays in step with the others
            steps = settings.steps_for(timed_round(case, device, 1)[case.metrics[0].name])
        if case.fresh_steps is not None:  # each round also takes one settling step per side
            steps = max(1, min(steps, case.fresh_steps() // rounds - 1))
    # one step a round too: after a change of side, the SD-1.5 training step ran 50-86 ms over its steady
    # 80 ms (allocator segments and plans of the other side), on torch's side as on flaggems'
    settle = not settings.smoke
    for index in range(rounds):
        for side in rotation(sides, index):
            with side.active(case), runner.gc_paused():
                if settle:
                    case.step(OFF)  # the first step after re-routing is not the steady state
                for name, value in timed_round(case, device, steps).items():
                    samples[side.name][name].append(value)
    return samples, steps


def metric_results(case: Case, samples: Mapping[str, Mapping[str, list[float]]],
                   censuses: Mapping[str, Census] | None = None) -> list[MetricResult]:
    """Per metric: medians per side, the median/lowest/highest torch/side ratio of the rounds, calls per unit."""
    out = []
    for metric in case.metrics:
        base = samples[TORCH][metric.name]
        result = MetricResult(metric.name)
        for side, per_metric in samples.items():
            values = per_metric[metric.name]
            result.ms[side], result.rounds[side] = (statistics.median(values) if values else None), values
            pairs = [t / s for t, s in zip(base, values) if t and s]
            if side != TORCH and pairs:
                result.ratios[side] = {"median": statistics.median(pairs), "low": min(pairs), "high": max(pairs)}
        for side, counted in (censuses or {}).items():
            for target, kernels in ((result.calls, False), (result.launches, True)):
                value = counted.per(metric, kernels)
                if value is not None:
                    target[side] = value
        result.torch_ms, result.flaggems_ms = result.ms.get(TORCH), result.ms.get(FLAGGEMS)
        legacy = result.ratios.get(FLAGGEMS)
        if legacy:
            result.ratio, result.ratio_low, result.ratio_high = legacy["median"], legacy["low"], legacy["high"]
        out.append(result)
    return out



def _check_side(case: Case, side: Side, entry: SideResult, reference: Any, device: torch.device) -> Any:
    """torch: run the checked step and return its output (the reference). Others: run it logged, check it."""
    if side.name == TORCH:
        with side.active(case):
            output = detached_copy(case.checked_step())
            runner.synchronize(device)
        return output
    output, records = counted_step(case, device, side)
    check = case.check(reference, output)  # outside the side: an fp32 reference is made from the original
    entry.match, entry.check, entry.max_diff = check.match, check.detail, check.max_diff
    entry.flaggems_ops, entry.native_calls, entry.declines = dispatch_counts(records)
    return reference


def prepare_side(case: Case, side: Side, entry: SideResult, reference: Any, device: torch.device,
                 warmup: int) -> tuple[Any, Census | None]:
    """Prepare, check, warm up and count one side; a skip or (but for torch) an exception goes to ``entry``."""
    try:
        side.prepare(case)
        reference = _check_side(case, side, entry, reference, device)
        with side.active(case):
            for _ in range(warmup):
                case.step(OFF)
            counts: list[Census] = []
            # the census step is a steady one: routed calls it sends to Python or the planner cost host time
            entry.off_replay = off_replay(lambda: counts.append(census(case, device)))
            counted = counts[0]
        entry.calls, entry.top_calls = counted.calls, counted.top
        entry.kernel_launches, entry.device_copies = counted.kernels, counted.copies
        entry.info["calls_counted_by"] = counted.method
        return reference, counted
    except Skip as exc:
        entry.status, entry.reason = "skipped", str(exc)
    except Exception as exc:
        if side.name == TORCH:
            raise
        entry.status, entry.error = "error", describe_exception(exc)
        traceback.print_exception(type(exc), exc, exc.__traceback__, limit=-8, file=sys.stderr)
    finally:
        entry.info = side.info()
    return reference, None


def measure(case: Case, result: ModelResult, sides: Sequence[Side], device: torch.device, settings: Settings,
            workload: ModelWorkload | None = None) -> None:
    """Per side: checked step, warm-up and census; then the timed rounds over the sides that ran, into ``result``."""
    rounds = settings.rounds_for(workload) if workload else (settings.rounds or 1)
    warmup = settings.warmup_for(workload) if workload else (settings.warmup or 0)
    reference, censuses = None, {}
    try:
        for side in sides:
            reference, counted = prepare_side(case, side, result.sides[side.name], reference, device, warmup)
            if counted is not None:
                censuses[side.name] = counted
        del reference
        timed = [s for s in sides if result.sides[s.name].ran]
        samples, result.steps_per_round = time_sides(case, timed, device, settings, rounds)
        result.rounds = rounds
        result.metrics = metric_results(case, samples, censuses)
    finally:
        for side in sides:
            side.release()
    _legacy_fields(result)


def _legacy_fields(result: ModelResult) -> None:
    """``match`` over every checked side; ``check``, ``max_diff`` and the dispatch counts of the flaggems side."""
    checked = [s.match for name, s in result.sides.items() if name != TORCH and s.ran and s.match is not None]
    result.match = all(checked) if checked else None
    ours = result.sides.get(FLAGGEMS)
    if ours is not None and ours.ran:
        result.check, result.max_diff = ours.check, ours.max_diff
        result.flaggems_ops, result.native_calls, result.declines = ours.flaggems_ops, ours.native_calls, ours.declines


def choose_sides(case: Case, names: Sequence[str], device: torch.device, result: ModelResult) -> list[Side]:
    """The sides that apply to ``case``; each of ``names`` gets an entry in ``result.sides`` (omitted: why)."""
    chosen = []
    for name in names:
        side = make_side(name, device)
        reason = side.omitted(case)
        result.sides[name] = SideResult(status="omitted", reason=reason) if reason else SideResult()
        if reason is None:
            chosen.append(side)
    return chosen


def run_model(workload: ModelWorkload, target: Target, settings: Settings,
              side_names: Sequence[str] | None = None) -> ModelResult:
    """Build, check and time one workload; a skip or an exception is recorded, not raised."""
    result = ModelResult(workload.name, workload.description)
    reason = skip_reason(workload, target, settings.smoke)
    names = list(side_names if side_names is not None else run_sides(settings)[0])
    case = None
    try:
        if reason is not None:
            raise Skip(reason)
        case = workload.build(target.device, settings.smoke)
        result.params = case.params
        sides = choose_sides(case, names, target.device, result)
        measure(case, result, sides, target.device, settings, workload)
    except Skip as exc:
        result.status, result.reason = "skipped", str(exc)
    except ModelApiError as exc:
        result.status, result.error = "error", f"transformers API mismatch: {exc}"
    except Exception as exc:  # noqa: BLE001 - report it and go on with the other workloads
        result.status, result.error = "error", describe_exception(exc)
        traceback.print_exception(type(exc), exc, exc.__traceback__, limit=-8, file=sys.stderr)
    finally:
        case = None
        _release(target.device)
    return result


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_all(workloads: Sequence[ModelWorkload], target: Target, settings: Settings,
            progress: Callable[[str], None] | None = None,
            finished: Callable[[Sequence[ModelResult]], None] | None = None) -> list[ModelResult]:
    """Every workload, flaggems disabled between sides (the previous state restored after).

    ``finished`` is called with the results so far after each workload, so a run stopped by a time limit
    keeps what it measured.
    """
    results: list[ModelResult] = []
    names, _ = run_sides(settings)
    with runner.flaggems_off():
        for workload in workloads:
            if progress is not None:
                progress(workload.name)
            results.append(run_model(workload, target, settings, names))
            if finished is not None:
                finished(results)
    return results
