"""Run workloads on each side (torch native, flaggems, forced routes) and time them.

Per workload and side: fresh inputs; one probe call that records which
implementation actually ran (the ``flaggems.dispatch`` log channel, on only
for that call) and checks the result against torch's; then the timed runs,
with logging off:

* kernel time: ``triton.testing.do_bench`` median (L2 flushed before each run);
* wall time: mean per call of a round of back-to-back calls between two device
  synchronisations (host overhead included), median over rounds.

A smoke run replaces both by a couple of host-timed calls on tiny shapes.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import logging
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

import flaggems
from flaggems import config, policy
from flaggems import log as fg_log
from flaggems.runtime import RUNTIME

from .workload import Inputs, Workload, dtype_name

TORCH, FLAGGEMS = "torch", "flaggems"
#: Routes ``--route`` may add: values of ``FLAGGEMS_FORCE``, and ``untuned``: the default chain with the generic
#: tuning only (what a vendor's launch policy buys over the shared kernels' defaults).
FORCED_ROUTES = ("generic", "vendor")
UNTUNED = "untuned"
ROUTE_SIDES = (*FORCED_ROUTES, UNTUNED)
LOG_CHANNELS = ("dispatch", "fallback")

#: (rtol, atol) per result dtype; integer results must match exactly.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (5e-2, 5e-2),
}


@dataclass(frozen=True)
class Target:
    """Where the benchmark runs."""

    device: torch.device
    gpu: bool
    device_name: str
    backend: str
    reason: str


@dataclass(frozen=True)
class Timing:
    """How the sides are timed (``do_bench`` budgets in ms, as triton takes them).

    Sides are interleaved: ``passes`` rounds of one ``do_bench`` per side, then
    ``wall_rounds`` rounds of one wall-clock round per side, so that a slow
    phase of the host hits every side alike.
    """

    smoke: bool
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    passes: int = 3
    wall_rounds: int = 7
    wall_round_ms: float = 20.0
    wall_max_calls: int = 200
    busy_calls: int = 20

    @classmethod
    def for_run(cls, smoke: bool) -> Timing:
        """Full timing, or a couple of host-timed calls for ``--smoke``."""
        return cls(smoke=True, passes=1, wall_rounds=1, wall_max_calls=1) if smoke else cls(smoke=False)

    def describe(self) -> str:
        """One line for reports."""
        if self.smoke:
            return "SMOKE: tiny shapes, two host-timed calls per side; timings are meaningless"
        return (f"kernel: median of {self.passes} triton.testing.do_bench medians (warmup {self.warmup_ms:g} ms, "
                f"rep {self.rep_ms:g} ms); wall: median of {self.wall_rounds} rounds of back-to-back calls "
                "between synchronisations; busy: GPU kernel time per call from torch.profiler (warm caches, "
                f"{self.busy_calls} calls); sides interleaved, GC off while timing")


@dataclass
class Measurement:
    """One side of one workload."""

    side: str
    ran: str = ""
    kernel_us: float | None = None
    wall_us: float | None = None
    busy_us: float | None = None
    gbps: float | None = None
    match: bool | None = None
    max_diff: float | None = None
    routes: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass
class Result:
    """Every side of one workload."""

    workload: Workload
    smoke: bool = False
    bytes_moved: int | None = None
    sides: dict[str, Measurement] = field(default_factory=dict)
    seconds: float | None = None

    def speedup(self, side: str, metric: str = "kernel_us") -> float | None:
        """torch time / ``side`` time for ``metric`` (``kernel_us`` or ``wall_us``)."""
        base, other = self.sides.get(TORCH), self.sides.get(side)
        if base is None or other is None:
            return None
        num, den = getattr(base, metric), getattr(other, metric)
        return num / den if num and den else None

    @property
    def label(self) -> str:
        """The workload's name with the sizes that ran (the smoke sizes in a smoke run)."""
        return self.workload.label(self.smoke)

    @property
    def failed(self) -> bool:
        """A side raised, or a flaggems side's result differs from torch's."""
        return any(m.error or m.match is False for m in self.sides.values())

    def as_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        w = self.workload
        others = [s for s in self.sides if s != TORCH]
        return {
            "op": w.op, "workload": w.name, "label": self.label, "dtype": w.dtype, "routes": list(w.routes),
            "source": w.source,
            "params": {k: _plain(v) for k, v in (w.smoke if self.smoke else w.params).items()},
            "bytes": self.bytes_moved, "seconds": self.seconds,
            "sides": {name: asdict(m) for name, m in self.sides.items()},
            "speedup": {s: self.speedup(s) for s in others},
            "wall_speedup": {s: self.speedup(s, "wall_us") for s in others},
            "busy_speedup": {s: self.speedup(s, "busy_us") for s in others},
        }


def _plain(value: Any) -> Any:
    return dtype_name(value) if isinstance(value, torch.dtype) else value


# -- target ----------------------------------------------------------------
def detect() -> Target:
    """The device of flaggems' active backend; ``gpu`` is false on the CPU interpreter."""
    active = flaggems.backend()
    device = torch.device(active.device_type)
    return Target(device, not active.interpreter, _device_name(device), active.name, active.reason)


def _device_name(device: torch.device) -> str:
    if device.type == "cpu":
        return f"CPU ({platform.machine()}, Triton interpreter)"
    try:
        return getattr(torch, device.type).get_device_name()
    except Exception:  # noqa: BLE001 - a name is only decoration
        return device.type


def synchronize(device: torch.device) -> None:
    """Wait for the device (no-op on CPU)."""
    if device.type == "cpu":
        return
    module = getattr(torch, device.type, None)
    if module is not None and hasattr(module, "synchronize"):
        module.synchronize()
    else:
        torch.accelerator.synchronize()


# -- routes ------------------------------------------------------------------
def sides(extra_routes: Sequence[str] = ()) -> list[str]:
    """``torch``, ``flaggems``, then each forced route asked for (no duplicates)."""
    return [TORCH, FLAGGEMS, *dict.fromkeys(r for r in extra_routes if r in ROUTE_SIDES)]


@contextlib.contextmanager
def environ(**values: str | None) -> Iterator[None]:
    """Set (``None``: unset) environment variables inside the block, restore them after."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            _set_env(name, value)
        yield
    finally:
        for name, value in saved.items():
            _set_env(name, value)


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _log_setting(with_dispatch: bool) -> str | None:
    """``FLAGGEMS_LOG`` without the per-call channels, plus them when asked."""
    kept = [c for c in config.get("FLAGGEMS_LOG") if c not in LOG_CHANNELS]
    wanted = kept + list(LOG_CHANNELS) if with_dispatch else kept
    return ",".join(wanted) or None


@contextlib.contextmanager
def flaggems_off() -> Iterator[None]:
    """Native kernels inside the block; the previous enable() comes back after."""
    previous = RUNTIME.enabled_with
    flaggems.disable()
    try:
        yield
    finally:
        if previous is not None:
            flaggems.enable(*previous)


def implemented(routes: Sequence[str]) -> tuple[str, ...]:
    """The ops of ``routes`` some installed plugin implements on the active backend.

    A workload names every aten op its call may reach (``unfold`` on a backend
    where only PrivateUse1 routes it, ``clone``, a plugin's op with its plugin
    absent); only those with an implementation go to ``enable(include=...)``,
    which warns about the others, as it should for a user's list.
    """
    have = policy.default_links(RUNTIME.implementations(), RUNTIME.active_backend())
    return tuple(op for op in routes if policy.normalize_op(op) in have)


@contextlib.contextmanager
def side_scope(side: str, routes: Sequence[str] | None, log: bool = False) -> Iterator[None]:
    """Run the block as ``side``: natively, or with ``routes`` sent to flaggems (``None``: every routed op).

    A forced route sets ``FLAGGEMS_FORCE`` around the enable. The per-call log
    channels are decided at enable(), so they are on only when ``log`` asks.
    Of ``routes``, only the ops an installed plugin implements are included (see :func:`implemented`).
    """
    if side == TORCH:
        with flaggems_off():
            yield
        return
    include = None if routes is None else implemented(routes)
    force = {"FLAGGEMS_FORCE": side} if side in FORCED_ROUTES else {}
    tuning = RUNTIME.without_vendor_tuning() if side == UNTUNED else contextlib.nullcontext()
    with tuning, environ(FLAGGEMS_LOG=_log_setting(log), **force), flaggems.enabled(include=include):
        yield


class _Capture(logging.Handler):
    """Collects ``(channel, message)`` of flaggems' per-call log records."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.name.rpartition(".")[2], record.getMessage()))


@contextlib.contextmanager
def capture_dispatch() -> Iterator[_Capture]:
    """Capture the dispatch and fallback channels instead of printing them."""
    handler = _Capture()
    loggers = [fg_log.logger(channel) for channel in LOG_CHANNELS]
    saved = [(lg, lg.level, lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)  # before configure(): it then adds no stderr handler
        lg.propagate = False
    fg_log.configure(LOG_CHANNELS)
    try:
        yield handler
    finally:
        for lg, level, propagate in saved:
            lg.removeHandler(handler)
            lg.setLevel(level)
            lg.propagate = propagate


def summarize_ran(records: Sequence[tuple[str, str]], chosen: dict[str, str]) -> tuple[str, list[str]]:
    """What ran (``"copy_ -> generic"``) and the declines, from captured records."""
    dispatched = [m for c, m in records if c == "dispatch"]
    # Calls made from inside an implementation (the interpreter's own copies) go native as
    # "re-entered"; they say what ran only when nothing else was logged.
    ran = list(dict.fromkeys(m for m in dispatched if "re-entered" not in m)) or list(dict.fromkeys(dispatched))
    notes = list(dict.fromkeys(m for c, m in records if c == "fallback"))
    if ran:
        return ", ".join(ran), notes
    if all(label == "native" for label in chosen.values()):
        return "native (no flaggems impl)", notes
    return "native (routed op not called)", notes


# -- correctness -------------------------------------------------------------
def tensors_of(result: Any) -> list[torch.Tensor]:
    """The tensors of a result (a tensor, or a tuple/list of them), detached."""
    items = result if isinstance(result, (tuple, list)) else (result,)
    return [t.detach() for t in items if isinstance(t, torch.Tensor)]


def compare(reference: Sequence[torch.Tensor], result: Any) -> tuple[bool, float | None]:
    """Whether ``result`` matches torch's within the dtype's tolerance, and the largest difference."""
    outputs = tensors_of(result)
    if len(outputs) != len(reference):
        return False, None
    ok, worst = True, 0.0
    for ref, out in zip(reference, outputs, strict=True):
        if ref.shape != out.shape or ref.dtype != out.dtype:
            return False, None
        rtol, atol = TOLERANCES.get(ref.dtype, (0.0, 0.0))
        if ref.numel():
            worst = max(worst, _difference(ref, out))
        ok = ok and torch.allclose(ref, out, rtol=rtol, atol=atol, equal_nan=True)
    return ok, worst


def float64_run(workload: Workload, inputs: Inputs) -> list[torch.Tensor]:
    """The torch side's call natively on ``inputs`` with every floating tensor cast to float64 (grad kept)."""
    def widen(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.detach().double().requires_grad_(value.requires_grad)
        return value

    with side_scope(TORCH, ()):
        return tensors_of(workload.call(native=True)({name: widen(value) for name, value in inputs.items()}))


def no_farther(reference: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
               exact: Sequence[torch.Tensor]) -> bool:
    """Each output no farther from the float64 result than torch's (by 1/8 of it, for rounding ties)."""
    if len(outputs) != len(reference) or len(exact) != len(reference):
        return False
    for ref, out, ex in zip(reference, outputs, exact, strict=True):
        if ref.shape != out.shape or ref.dtype != out.dtype:
            return False
        if ref.numel() and _difference(ex.to(ref.dtype).double(), out) > 1.125 * _difference(
                ex.to(ref.dtype).double(), ref) + torch.finfo(ref.dtype).tiny:
            return False
    return True


def _difference(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Largest absolute difference (fp32 arithmetic for low-precision floats, exact for integers)."""
    if ref.is_floating_point() and ref.dtype != torch.float64:
        ref, out = ref.float(), out.float()
    elif not ref.is_floating_point():
        ref, out = ref.long(), out.long()
    return float((ref - out).abs().max().item())


# -- timing ----------------------------------------------------------------
def kernel_us(fn: Callable[[], Any], target: Target, timing: Timing) -> float:
    """Median device time of one call, µs (a host-timed call in smoke runs)."""
    if timing.smoke or not target.gpu:
        return round_us(fn, target.device, 1)
    from triton.testing import do_bench

    return do_bench(fn, warmup=timing.warmup_ms, rep=timing.rep_ms, return_mode="median") * 1e3


def busy_us(fn: Callable[[], Any], target: Target, timing: Timing) -> float | None:
    """GPU busy µs per call: the durations of the device kernels (memcpy and memset included) that
    ``timing.busy_calls`` calls launch, summed from ``torch.profiler``, whatever the host spends between them.
    ``do_bench``'s kernel time of a small autograd step is its host time (the GPU waits for launches); this
    is what the kernels cost. ``None`` without a GPU or in smoke runs."""
    if timing.smoke or not target.gpu:
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    synchronize(target.device)
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(timing.busy_calls):
                fn()
            synchronize(target.device)
        events = prof.events()
    except RuntimeError:  # a profiler that cannot start (CUPTI busy or missing) costs the column, not the side
        return None
    spent = sum(e.time_range.elapsed_us() for e in events if e.device_type == DeviceType.CUDA)
    return spent / timing.busy_calls if spent else None


def round_us(fn: Callable[[], Any], device: torch.device, calls: int) -> float:
    """Mean wall-clock µs per call of ``calls`` back-to-back calls between two synchronisations."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) * 1e6 / calls


def calls_per_round(fn: Callable[[], Any], device: torch.device, timing: Timing) -> int:
    """Enough calls for a round of about ``wall_round_ms``, after as many warm-up calls."""
    if timing.smoke:
        return 1
    one = round_us(fn, device, 1)
    calls = max(1, min(timing.wall_max_calls, int(timing.wall_round_ms * 1e3 / max(one, 1e-3))))
    round_us(fn, device, calls)
    return calls


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No garbage collection inside the block (as ``timeit`` does)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# -- one workload ------------------------------------------------------------
def probe(workload: Workload, side: str, inputs: Inputs, target: Target) -> tuple[Measurement, Any]:
    """One untimed call as ``side``: its result and what ran."""
    measurement = Measurement(side)
    if side == TORCH:
        with side_scope(TORCH, ()):
            result = workload.call(native=True)(inputs)
            synchronize(target.device)
        measurement.ran = "native"
        return measurement, result
    with capture_dispatch() as captured, side_scope(side, workload.routes, log=True):
        measurement.routes = {r["op"]: r["chosen"] for r in flaggems.routes() if r["op"] in workload.routes}
        result = workload.run(inputs)
        synchronize(target.device)
    measurement.ran, measurement.notes = summarize_ran(captured.records, measurement.routes)
    return measurement, result


class _WorkloadRun:
    """One workload: a probe per side on fresh inputs, then the sides timed interleaved on shared inputs."""

    def __init__(self, workload: Workload, target: Target, timing: Timing) -> None:
        self.workload, self.target, self.timing = workload, target, timing
        self.result = Result(workload, smoke=timing.smoke)
        self.reference: list[torch.Tensor] | None = None
        self.exact: list[torch.Tensor] | None = None

    def attempt(self, side: str, action: Callable[[], Any]) -> bool:
        """Run ``action`` for ``side``; record an exception on that side instead of raising."""
        try:
            action()
            return True
        except Exception as exc:  # noqa: BLE001 - report it and go on with the other sides
            self.result.sides.setdefault(side, Measurement(side)).error = f"{type(exc).__name__}: {exc}"
            return False

    def probe(self, side: str) -> None:
        """Fresh inputs (an in-place op that does nothing must not look right), one call, the check."""
        inputs = self.workload.make(self.target.device, self.timing.smoke)
        if self.result.bytes_moved is None and self.workload.bytes_moved is not None:
            self.result.bytes_moved = self.workload.bytes_moved(inputs)
        measurement, output = probe(self.workload, side, inputs, self.target)
        self.result.sides[side] = measurement
        if side == TORCH:
            self.reference = [t.clone() for t in tensors_of(output)]
            if self.workload.float64_judge:
                self.exact = float64_run(self.workload, inputs)
        elif self.reference is not None:
            measurement.match, measurement.max_diff = compare(self.reference, output)
            if not measurement.match and self.exact is not None:
                measurement.match = no_farther(self.reference, tensors_of(output), self.exact)

    def time(self, side_names: Sequence[str]) -> None:
        """Kernel and wall time of every side that probed cleanly, sides interleaved."""
        inputs = self.workload.make(self.target.device, self.timing.smoke)
        fns = {side: functools.partial(self.workload.call(native=side == TORCH), inputs) for side in side_names}
        calls: dict[str, int] = {}
        kernel: dict[str, list[float]] = {s: [] for s in side_names}
        wall: dict[str, list[float]] = {s: [] for s in side_names}
        busy: dict[str, list[float]] = {s: [] for s in side_names}

        def count(side: str) -> None:
            calls[side] = calls_per_round(fns[side], self.target.device, self.timing)

        def kernel_pass(side: str) -> None:
            kernel[side].append(kernel_us(fns[side], self.target, self.timing))

        def wall_round(side: str) -> None:
            wall[side].append(self._wall_round(fns[side], calls[side]))

        def busy_pass(side: str) -> None:
            spent = busy_us(fns[side], self.target, self.timing)
            if spent is not None:
                busy[side].append(spent)

        self._each_side(side_names, count)
        for _ in range(self.timing.passes):
            self._each_side(calls, kernel_pass)
        for _ in range(self.timing.wall_rounds):
            self._each_side(calls, wall_round)
        for _ in range(self.timing.passes):
            self._each_side(calls, busy_pass)
        for side in calls:
            measurement = self.result.sides[side]
            measurement.kernel_us = statistics.median(kernel[side]) if kernel[side] else None
            measurement.wall_us = statistics.median(wall[side]) if wall[side] else None
            measurement.busy_us = statistics.median(busy[side]) if busy[side] else None
            if self.result.bytes_moved and measurement.kernel_us:
                measurement.gbps = self.result.bytes_moved / (measurement.kernel_us * 1e3)

    def _each_side(self, side_names: Iterable[str], action: Callable[[str], Any]) -> None:
        """``action(side)`` routed as each side without an error, GC paused; one that raises drops out."""
        for side in list(side_names):
            measurement = self.result.sides.get(side)
            if measurement is None or measurement.error:
                continue
            self.attempt(side, functools.partial(self._routed, side, action))

    def _routed(self, side: str, action: Callable[[str], Any]) -> None:
        with side_scope(side, self.workload.routes), gc_paused():
            action(side)

    def _wall_round(self, fn: Callable[[], Any], calls: int) -> float:
        if not self.timing.smoke:
            fn()  # the first call after re-routing is not the steady state
        return round_us(fn, self.target.device, calls)


def run_workload(workload: Workload, side_names: Sequence[str], target: Target, timing: Timing,
                 step: Callable[[str], None] | None = None) -> Result:
    """Every side of one workload; a side that raises is recorded, not fatal."""
    if step is not None:
        step(f"{workload.op} {workload.label(timing.smoke)} {workload.dtype}")
    start = time.perf_counter()
    run = _WorkloadRun(workload, target, timing)
    for side in side_names:
        run.attempt(side, functools.partial(run.probe, side))
    run.reference = None
    _release(target.device, timing)
    run.attempt(TORCH, lambda: run.time(side_names))
    _release(target.device, timing)
    run.result.seconds = time.perf_counter() - start
    return run.result


def _release(device: torch.device, timing: Timing) -> None:
    if timing.smoke:
        return
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_all(workloads: Sequence[Workload], side_names: Sequence[str], target: Target, timing: Timing,
            step: Callable[[str], None] | None = None,
            finished: Callable[[Result], None] | None = None) -> list[Result]:
    """Run every workload, flaggems disabled between sides (restored after); ``finished`` gets each result as it
    comes (a run stopped by a time limit keeps what it printed)."""
    results = []
    with flaggems_off():
        for w in workloads:
            results.append(run_workload(w, side_names, target, timing, step))
            if finished is not None:
                finished(results[-1])
    return results


# -- reporting helpers -----------------------------------------------------------
def geomean(values: Sequence[float | None]) -> float | None:
    """Geometric mean of the positive values; ``None`` when there are none."""
    kept = [v for v in values if v and v > 0]
    return math.exp(sum(math.log(v) for v in kept) / len(kept)) if kept else None


def environment(target: Target, timing: Timing, side_names: Sequence[str]) -> dict[str, Any]:
    """Where and how the numbers were taken (for JSON, tables and RESULTS.md)."""
    import triton

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": target.device_name, "device_type": target.device.type, "gpu": target.gpu,
        "backend": target.backend, "backend_reason": target.reason,
        "torch": torch.__version__, "triton": triton.__version__, "flaggems": flaggems.__version__,
        "python": platform.python_version(), "smoke": timing.smoke, "timings_meaningful": not timing.smoke,
        "timing": timing.describe(), "sides": list(side_names), "command": " ".join(sys.argv),
        "flaggems_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("FLAGGEMS_")},
        "peak_device_memory_gib": _peak_memory_gib(target.device),
    }


def _peak_memory_gib(device: torch.device) -> float | None:
    """Peak memory torch allocated on a CUDA device so far (``None`` elsewhere)."""
    if device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated() / 2**30, 2)
