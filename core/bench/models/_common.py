"""Declarations every module of :mod:`flaggems.bench.models` shares: the side names, the tolerances, the
exceptions, the settings, the workload and case types and the result records.

It imports no other module of the package.
"""

from __future__ import annotations

import argparse
import contextlib
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from .. import runner
from ..runner import FLAGGEMS, TORCH

PATCHED, LIGER = "patched", "liger"
COMPILED, PATCHED_COMPILED = "compiled", "patched+compiled"
#: Every side, in the order they run (torch first: its output is the reference).
SIDE_NAMES = (TORCH, FLAGGEMS, PATCHED, LIGER, COMPILED, PATCHED_COMPILED)
#: The sides a run has unless ``--side`` chooses (the compiled ones cost a compile per workload and side).
DEFAULT_SIDES = (TORCH, FLAGGEMS, PATCHED, LIGER)
#: The sides of the UNet stack and of any workload without a transformers model.
SIDES = (TORCH, FLAGGEMS)
SMOKE_BANNER = ("SMOKE RUN: tiny models, one step per round; the timings below are meaningless "
                "(Triton interpreter or tiny sizes); only the output checks count")
#: Logits: max over the vocabulary of |side - torch|, over the row's max |torch|, per row (bf16's 8-bit
#: mantissa rounds each logit by up to 2^-9 of itself; layers of rounding differences add a few times that).
LOGITS_TOLERANCE = 2e-2
#: Gradients: ||side - torch|| / ||torch|| per tensor. bf16 rounds every stored activation and gradient by
#: up to 2^-9; a backward compounds a few such roundings per element. Measured on CPU (a 4-layer Qwen2-0.5B-
#: shaped model, 1 x 32 tokens): torch's bf16 gradients differ from fp32 ones by up to 2.4e-2 in norm
#: (median 1.5e-2), and flaggems' patched kernels' from torch's bf16 ones by up to 3.2e-2 (median 1.6e-2),
#: while being as accurate as torch (1.3x its error against fp32). 5e-2 leaves room for deeper models and
#: still catches a wrong kernel (a wrong scale or a dropped term moves a gradient by 1e-1 or more); beyond
#: it the fp32 criterion (the package docstring) still accepts a side as accurate as torch.
GRAD_TOLERANCE = 5e-2
#: The fp32 criterion: a side's error against fp32 may be this many times torch's own.
ACCURACY_FACTOR = 2.0


class ModelApiError(RuntimeError):
    """The installed transformers does not offer an API this benchmark relies on (the message says which)."""


class Skip(Exception):  # noqa: N818 - control flow, like flaggems.Decline
    """A workload that cannot run here; the message says why, in one line."""


# -- declarations -------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    """How many steps and rounds are timed, and whether this is a smoke run.

    ``steps=None``: automatic; ``rounds``/``warmup`` ``None``: each workload's own
    default (:class:`ModelWorkload`), fitted to the time budget of a full run.
    """

    smoke: bool
    steps: int | None = None
    rounds: int | None = None
    warmup: int | None = None
    round_ms: float = 200.0
    max_steps: int = 200
    sides: tuple[str, ...] = DEFAULT_SIDES

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Settings:
        """Defaults (full run, or one step and one round for ``--smoke``) overridden by the options given."""
        smoke = bool(getattr(args, "smoke", False))
        base = cls(smoke=True, steps=1, rounds=1, warmup=0) if smoke else cls(smoke=False)
        steps, rounds, warmup = (getattr(args, name, None) for name in ("steps", "rounds", "warmup"))
        chosen = tuple(getattr(args, "side", None) or ())
        sides = tuple(s for s in SIDE_NAMES if s == TORCH or s in chosen) if chosen else DEFAULT_SIDES
        return cls(smoke=smoke, steps=base.steps if steps is None else steps,
                   rounds=base.rounds if rounds is None else rounds,
                   warmup=base.warmup if warmup is None else warmup, sides=sides)

    def steps_for(self, step_ms: float) -> int:
        """Steps per round: ``steps``, or as many as take about ``round_ms`` at ``step_ms`` each."""
        if self.steps is not None:
            return self.steps
        return max(1, min(self.max_steps, round(self.round_ms / max(step_ms, 1e-3))))

    def rounds_for(self, workload: ModelWorkload) -> int:
        """``rounds``, else the workload's default."""
        return workload.rounds if self.rounds is None else self.rounds

    def warmup_for(self, workload: ModelWorkload) -> int:
        """``warmup``, else the workload's default."""
        return workload.warmup if self.warmup is None else self.warmup

    def describe(self) -> str:
        """One line for reports."""
        prefix = "SMOKE (timings meaningless): " if self.smoke else ""
        steps = (f"{self.steps} back-to-back steps" if self.steps is not None else
                 f"back-to-back steps (as many as take ~{self.round_ms:g} ms on torch, at most {self.max_steps})")
        rounds = "each workload's rounds (see --list)" if self.rounds is None else f"{self.rounds} rounds"
        warmup = "the workload's warm-up steps" if self.warmup is None else f"{self.warmup} warm-up steps"
        return (f"{prefix}wall ms per step: median over {rounds} of {steps} between device "
                f"synchronisations, after {warmup} per side; sides interleaved round by round (order rotated "
                "each round), GC paused while timing; ratio torch/side: median of the rounds' pairs "
                "[lowest-highest]")


@dataclass(frozen=True)
class Metric:
    """A reported time: the whole step (``phase=None``) or one phase of it, divided by ``per_step``."""

    name: str
    phase: str | None = None
    per_step: int = 1


@dataclass
class Check:
    """The outcome of comparing a side's output with torch's."""

    match: bool
    detail: str
    max_diff: float | None = None


class Phases:
    """Wall time of named phases inside a step; synchronises at each lap, and does nothing when off."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self.totals: dict[str, float] = {}
        self._last = 0.0

    def start(self) -> None:
        """Start the clock of the first phase (after a synchronisation)."""
        if self.device is not None:
            runner.synchronize(self.device)
            self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        """Add the time since the last start or lap to phase ``name``."""
        if self.device is None:
            return
        runner.synchronize(self.device)
        now = time.perf_counter()
        self.totals[name] = self.totals.get(name, 0.0) + now - self._last
        self._last = now


#: The no-op phase clock of untimed steps.
OFF = Phases()


class ModelSlot:
    """The model a workload's step runs: a side may put another in (Liger's copy) while it is active."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.original = model

    @contextlib.contextmanager
    def holding(self, model: nn.Module) -> Iterator[None]:
        """``model`` in the slot inside the block, the original after."""
        self.model = model
        try:
            yield
        finally:
            self.model = self.original


@dataclass
class Case:
    """A built workload: ``step(phases)`` returning outputs, how to check them, what to report.

    ``slot`` holds the transformers model (``None`` for plain torch modules: only
    the torch and flaggems sides run) and ``family`` its kind (``llama``,
    ``qwen2``). ``probe`` is the untimed step whose output is checked (default:
    ``step``). ``side`` names the side running now (set by the side). ``fresh_steps``,
    where steps walk a sequence of inputs: how many more steps every side can take
    before an input comes back (the timed rounds fit their steps within it).
    """

    step: Callable[[Phases], Any]
    check: Callable[[Any, Any], Check]
    params: dict[str, Any]
    metrics: tuple[Metric, ...] = (Metric("ms/step"),)
    slot: ModelSlot | None = None
    family: str | None = None
    probe: Callable[[Phases], Any] | None = None
    side: str = TORCH
    fresh_steps: Callable[[], int] | None = None

    def checked_step(self) -> Any:
        """One run of ``probe`` (or ``step``), untimed."""
        return (self.probe or self.step)(OFF)


@dataclass(frozen=True)
class ModelWorkload:
    """A named workload: ``build(device, smoke)`` makes its :class:`Case`; ``rounds``/``warmup``: defaults."""

    name: str
    description: str
    build: Callable[[torch.device, bool], Case]
    needs_transformers: bool = False
    rounds: int = 15
    warmup: int = 3
    estimate_s: int = 15


@dataclass
class MetricResult:
    """One reported time of one workload, every side (ms).

    ``ms``, ``rounds``: per side, the median and every round; ``ratios``: per
    non-torch side, ``{"median", "low", "high"}`` of the rounds' torch / side;
    ``calls``/``launches``: per side, operator calls and device kernels per
    unit of this metric (census step). ``torch_ms``, ``flaggems_ms``,
    ``ratio``, ``ratio_low``, ``ratio_high``: the torch and flaggems figures,
    as earlier versions of this report had them.
    """

    name: str
    torch_ms: float | None = None
    flaggems_ms: float | None = None
    ratio: float | None = None
    ratio_low: float | None = None
    ratio_high: float | None = None
    ms: dict[str, float | None] = field(default_factory=dict)
    ratios: dict[str, dict[str, float]] = field(default_factory=dict)
    rounds: dict[str, list[float]] = field(default_factory=dict)
    calls: dict[str, float] = field(default_factory=dict)
    launches: dict[str, float] = field(default_factory=dict)


@dataclass
class SideResult:
    """One side of one workload: ``status`` ok, omitted (does not apply), skipped (cannot run here) or error."""

    status: str = "ok"
    reason: str | None = None
    error: str | None = None
    match: bool | None = None
    check: str | None = None
    max_diff: float | None = None
    flaggems_ops: dict[str, int] = field(default_factory=dict)
    native_calls: dict[str, int] = field(default_factory=dict)
    declines: dict[str, int] = field(default_factory=dict)
    calls: int | None = None
    top_calls: dict[str, int] = field(default_factory=dict)
    kernel_launches: int | None = None
    device_copies: int | None = None
    off_replay: dict[str, dict[str, int]] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def ran(self) -> bool:
        """The side was checked without error (and is timed)."""
        return self.status == "ok"


@dataclass
class ModelResult:
    """Everything measured for one workload (``status``: ok, skipped or error).

    ``sides``: per side, its check, dispatch counts and calls per step. ``match``
    is every checked side's; ``check``, ``max_diff``, ``flaggems_ops``,
    ``native_calls`` and ``declines`` are the flaggems side's (as before).
    """

    workload: str
    description: str
    status: str = "ok"
    reason: str | None = None
    error: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    steps_per_round: int | None = None
    rounds: int | None = None
    match: bool | None = None
    check: str | None = None
    max_diff: float | None = None
    metrics: list[MetricResult] = field(default_factory=list)
    flaggems_ops: dict[str, int] = field(default_factory=dict)
    native_calls: dict[str, int] = field(default_factory=dict)
    declines: dict[str, int] = field(default_factory=dict)
    sides: dict[str, SideResult] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        """The workload or a side raised, or a side's output differs from torch's."""
        return (self.status == "error" or self.match is False
                or any(s.status == "error" for s in self.sides.values()))

    def timed_sides(self) -> list[str]:
        """The sides that ran, in order."""
        return [name for name, side in self.sides.items() if side.ran]

    def as_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        return asdict(self)



def describe_exception(exc: BaseException) -> str:
    """``Type: message (at file:line in function)``, the innermost frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"
