"""Calls per step: the untimed census step's operator calls (and, on CUDA, device kernels), per phase."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import runner
from ._common import Case, Metric, Phases, describe_exception


# -- calls per step -------------------------------------------------------------------------
class CallCounter(TorchDispatchMode):
    """Counts every operator call reaching the dispatcher's Python key, per op (the census' fallback).

    That sees aten ops after autograd and composite decompositions, but not ops
    with a Python kernel above that key (flaggems' fused operators), and it sees
    the calls such kernels make.
    """

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types_: Any, args: Any = (), kwargs: Any = None) -> Any:
        """Count the call, then make it."""
        self.total += 1
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


#: Name prefix of the profiler ranges marking phase boundaries in a census step.
MARKER = "flaggems_bench_phase:"


class CountingPhases(Phases):
    """The phase clock of a census step: a profiler marker at each boundary, or a :class:`CallCounter`'s deltas."""

    def __init__(self, device: torch.device, counter: CallCounter | None = None) -> None:
        super().__init__(None)
        self.marker_device, self.counter = device, counter
        self._mark = 0

    def start(self) -> None:
        """Begin the first phase."""
        self._boundary("start")

    def lap(self, name: str) -> None:
        """End phase ``name``."""
        self._boundary(name)

    def _boundary(self, name: str) -> None:
        if self.counter is not None:
            if name != "start":
                self.totals[name] = self.totals.get(name, 0) + self.counter.total - self._mark
            self._mark = self.counter.total
            return
        runner.synchronize(self.marker_device)  # every kernel of the phase has run before the marker
        with torch.profiler.record_function(f"{MARKER}{name}"):
            pass


@dataclass
class Census:
    """Calls one step made: operator calls (whole step, per phase, the most frequent ops) and device kernels."""

    calls: int
    phase_calls: dict[str, int]
    top: dict[str, int]
    kernels: int | None = None
    copies: int | None = None
    phase_kernels: dict[str, int] = field(default_factory=dict)
    method: str = "torch.profiler"

    def per(self, metric: Metric, kernels: bool = False) -> float | None:
        """Calls (or kernels) per unit of ``metric``: the whole step's, or its phase's / ``per_step``."""
        whole, phases = (self.kernels, self.phase_kernels) if kernels else (self.calls, self.phase_calls)
        value = whole if metric.phase is None else phases.get(metric.phase)
        return None if value is None else value / metric.per_step


def is_op(name: str) -> bool:
    """A dispatcher operator's profiler event (``aten::mm``, ``flaggems::rms_norm``), not autograd's ranges."""
    namespace, sep, rest = name.partition("::")
    return bool(sep and rest) and namespace.isidentifier() and namespace != "autograd"


def _outermost(event: Any) -> bool:
    """No operator encloses ``event`` (calls made inside an op's implementation are not the step's)."""
    parent = event.cpu_parent
    while parent is not None:
        if is_op(parent.name):
            return False
        parent = parent.cpu_parent
    return True


def _phase(start: float, marks: Sequence[tuple[float, str]]) -> str | None:
    """The phase ending at the first boundary at or after ``start`` (``None`` before ``start`` or after the last)."""
    name = next((name for at, name in marks if at >= start), None)
    return None if name == "start" else name


def call_activity(events: Sequence[Any]) -> tuple[int, dict[str, int], dict[str, int]]:
    """(outermost operator calls, per phase, the 12 most frequent) among profiler events."""
    from torch.autograd import DeviceType

    marks = sorted((e.time_range.start, e.name[len(MARKER):]) for e in events if e.name.startswith(MARKER))
    calls = [e for e in events if e.device_type == DeviceType.CPU and is_op(e.name) and _outermost(e)]
    phases = Counter(p for p in (_phase(e.time_range.start, marks) for e in calls) if p is not None)
    return len(calls), dict(phases), dict(Counter(e.name for e in calls).most_common(12))


def device_activity(events: Sequence[Any]) -> tuple[int, int, dict[str, int]]:
    """(kernels, memcpy/memset, kernels per phase) among profiler events; phases from :data:`MARKER` ranges.

    A kernel belongs to the first phase boundary at or after its start (the census
    synchronises before each marker, so a phase's kernels all start before it).
    """
    from torch.autograd import DeviceType

    marks = sorted((e.time_range.start, e.name[len(MARKER):]) for e in events if e.name.startswith(MARKER))
    kernels = copies = 0
    phases: Counter[str] = Counter()
    for event in events:
        if event.device_type != DeviceType.CUDA:
            continue
        if event.name.lower().startswith(("memcpy", "memset")):
            copies += 1
            continue
        kernels += 1
        phase = _phase(event.time_range.start, marks)
        if phase is not None:
            phases[phase] += 1
    return kernels, copies, dict(phases)


def census(case: Case, device: torch.device) -> Census:
    """One untimed step under ``torch.profiler`` (call it inside a side): calls and, on CUDA, kernels.

    Calls: the outermost operator calls (``aten::``, ``flaggems::``... events that
    no other operator encloses, on every thread: autograd's too). Should the
    profiler fail, the step is counted again by a :class:`CallCounter` (no kernels).
    """
    try:
        return _profiled_census(case, device)
    except Exception as exc:  # noqa: BLE001 - the fallback counts calls without the profiler
        print(f"flaggems bench --models: torch.profiler failed ({describe_exception(exc)}); "
              "counting calls with a TorchDispatchMode", file=sys.stderr)
    counter = CallCounter()
    phases = CountingPhases(device, counter)
    with counter:
        case.step(phases)
    runner.synchronize(device)
    return Census(counter.total, dict(phases.totals), dict(counter.ops.most_common(12)),
                  method="TorchDispatchMode")


def _profiled_census(case: Case, device: torch.device) -> Census:
    from torch.profiler import ProfilerActivity

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with torch.profiler.profile(activities=activities) as prof:
        case.step(CountingPhases(device))
        runner.synchronize(device)
    events = prof.events()
    result = Census(*call_activity(events))
    if cuda:
        result.kernels, result.copies, result.phase_kernels = device_activity(events)
    return result
