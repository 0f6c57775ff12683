"""The sides a workload runs on: torch eager, flaggems, patched, Liger-Kernel, compiled and
patched+compiled, each entered and left around the block it runs.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
import time
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import flaggems

from .. import runner
from ..runner import FLAGGEMS, TORCH
from . import _deps
from ._common import COMPILED, LIGER, OFF, PATCHED, PATCHED_COMPILED, Case, Settings, Skip
from ._deps import LIGER_FUNCTIONS, LIGER_OPTIONS


# -- sides ----------------------------------------------------------------------------------
@contextlib.contextmanager
def as_side(side: str, log: bool = False) -> Iterator[None]:
    """Run the block natively (``torch``) or with every routed op on flaggems."""
    with runner.side_scope(side, None, log=log):
        yield


class Side:
    """One way of running a workload's step: torch eager (this class), or a subclass's change on top."""

    name = TORCH
    uses_flaggems = False

    def omitted(self, case: Case) -> str | None:
        """Why this side does not apply to ``case`` (``None``: it does)."""
        return None

    def prepare(self, case: Case) -> None:
        """Once per workload, before the side first runs; :class:`Skip` when it cannot run here."""

    @contextlib.contextmanager
    def active(self, case: Case, log: bool = False) -> Iterator[None]:
        """The block runs as this side (``log``: flaggems' per-call log channels on); all is put back after."""
        case.side = self.name
        try:
            with as_side(FLAGGEMS if self.uses_flaggems else TORCH, log=log), self.scope(case):
                yield
        finally:
            case.side = TORCH

    @contextlib.contextmanager
    def scope(self, case: Case) -> Iterator[None]:
        """What this side changes around the block, besides flaggems' state (nothing here)."""
        yield

    def info(self) -> dict[str, Any]:
        """What the side did, for the report (a patch report, the names Liger rebound)."""
        return {}

    def release(self) -> None:
        """Drop what :meth:`prepare` made."""


class FlaggemsSide(Side):
    """``flaggems.enable()`` alone."""

    name = FLAGGEMS
    uses_flaggems = True


class PatchedSide(Side):
    """``flaggems.enable()`` and ``flaggems.patch(model)``; ``flaggems.unpatch(model)`` on leaving."""

    name = PATCHED
    uses_flaggems = True

    def __init__(self) -> None:
        self.report: dict[str, Any] = {}

    def omitted(self, case: Case) -> str | None:
        """Only a transformers model can be patched."""
        return None if case.slot is not None else "no transformers model to patch"

    def prepare(self, case: Case) -> None:
        """Patch once to read the report; :class:`Skip` when nothing was patched."""
        report_ = flaggems.patch(case.slot.model)
        flaggems.unpatch(case.slot.model)
        self.report = report_.as_dict()
        if not report_.patched:
            raise Skip(f"flaggems.patch patched nothing: {report_}".replace("\n", "; "))

    @contextlib.contextmanager
    def scope(self, case: Case) -> Iterator[None]:
        """The model patched inside the block."""
        flaggems.patch(case.slot.model)
        try:
            yield
        finally:
            flaggems.unpatch(case.slot.model)

    def info(self) -> dict[str, Any]:
        """The patch report."""
        return {"patch": self.report} if self.report else {}


_MISSING: Any = object()


@dataclass
class Swap:
    """A name Liger rebound: ``owner.name`` is ``original`` off the liger side and ``value`` on it."""

    owner: Any
    name: str
    original: Any
    value: Any

    def put(self, liger: bool) -> None:
        """Set the liger value (``liger``) or the original; a missing one is deleted."""
        value = self.value if liger else self.original
        if value is _MISSING:
            with contextlib.suppress(AttributeError):
                delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, value)

    def describe(self) -> str:
        """``module.name`` or ``module.Class.name``."""
        owner = self.owner
        prefix = owner.__name__ if isinstance(owner, types.ModuleType) else f"{owner.__module__}.{owner.__qualname__}"
        return f"{prefix}.{self.name}"


def watched_namespaces(model: nn.Module) -> list[Any]:
    """Where Liger rebinds names: ``model``'s modeling module, every class defined there, ``torch.nn.functional``."""
    module = sys.modules[type(model).__module__]
    classes = [v for v in vars(module).values() if isinstance(v, type) and v.__module__ == module.__name__]
    return [module, *classes, torch.nn.functional]


def swapped_by(apply: Callable[[], Any], owners: Sequence[Any]) -> list[Swap]:
    """Run ``apply``; every name it rebound in ``owners`` is put back and returned as a :class:`Swap`."""
    before = [dict(vars(owner)) for owner in owners]
    swaps: list[Swap] = []
    try:
        apply()
    finally:
        for owner, old in zip(owners, before):
            now = dict(vars(owner))
            for name in dict.fromkeys([*old, *now]):
                if old.get(name, _MISSING) is not now.get(name, _MISSING):
                    swaps.append(Swap(owner, name, old.get(name, _MISSING), now.get(name, _MISSING)))
        for swap in swaps:
            swap.put(liger=False)
    return swaps




class LigerSide(Side):
    """Liger-Kernel on a deep copy of the model, flaggems off; the names it rebinds swapped in only here."""

    name = LIGER

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.model: nn.Module | None = None
        self.swaps: list[Swap] = []

    def omitted(self, case: Case) -> str | None:
        """Liger patches the families of :data:`LIGER_FUNCTIONS` only."""
        if case.slot is None:
            return "no transformers model"
        return None if case.family in LIGER_FUNCTIONS else f"Liger-Kernel is not applied to {case.family}"

    def prepare(self, case: Case) -> None:
        """Copy the model, apply Liger to the copy, and take back every name it rebound (until :meth:`scope`)."""
        apply = _deps.liger_apply(case.family, self.device)
        model = copy.deepcopy(case.slot.original)
        self.swaps = swapped_by(lambda: apply(model=model), watched_namespaces(model))
        self.model = model

    @contextlib.contextmanager
    def scope(self, case: Case) -> Iterator[None]:
        """Liger's names and its model copy inside the block; the originals after."""
        for swap in self.swaps:
            swap.put(liger=True)
        try:
            with case.slot.holding(self.model):
                yield
        finally:
            for swap in self.swaps:
                swap.put(liger=False)

    def info(self) -> dict[str, Any]:
        """The names Liger rebound (swapped in on this side only)."""
        return {"options": LIGER_OPTIONS, "swapped": [s.describe() for s in self.swaps]} if self.model else {}

    def release(self) -> None:
        """Drop the copy."""
        self.model, self.swaps = None, []


class CompiledSide(Side):
    """``torch.compile`` (inductor, default mode) of the model, flaggems off: the compiler's own speed.

    The compile happens in :meth:`prepare` (its seconds go to the report); ``generate()`` workloads omit
    the side (``generate`` calls the module's own forward; transformers compiles it through ``compile_config``).
    """

    name = COMPILED
    uses_flaggems = False
    patched = False

    def __init__(self) -> None:
        self.model: Any = None
        self.compile_s: float | None = None

    def omitted(self, case: Case) -> str | None:
        """A transformers model whose step calls the module (not ``generate``)."""
        if case.slot is None:
            return "no transformers model"
        return "generate() runs the module's own forward" if "generate" in case.params else None

    def prepare(self, case: Case) -> None:
        """Compile (a patched deep copy on the patched side) and run one step: the compile's seconds."""
        model = case.slot.original
        if self.patched:
            model = copy.deepcopy(model)
            flaggems.patch(model)
        torch._dynamo.reset()
        self.model = torch.compile(model)
        start = time.perf_counter()
        with self.active(case):
            case.step(OFF)
            runner.synchronize(next(model.parameters()).device)
        self.compile_s = round(time.perf_counter() - start, 2)

    @contextlib.contextmanager
    def scope(self, case: Case) -> Iterator[None]:
        """The compiled model in the slot inside the block."""
        with case.slot.holding(self.model):
            yield

    def info(self) -> dict[str, Any]:
        """The first step's seconds (the compile)."""
        return {"compile_s": self.compile_s} if self.compile_s is not None else {}

    def release(self) -> None:
        """Drop the compiled model."""
        self.model = None


class PatchedCompiledSide(CompiledSide):
    """``torch.compile`` of a patched deep copy, flaggems enabled: flaggems with the compiler."""

    name = PATCHED_COMPILED
    uses_flaggems = True
    patched = True


def run_sides(settings: Settings) -> tuple[list[str], dict[str, str]]:
    """The sides of this run (``--side``; liger only where importable) and why any is absent."""
    absent: dict[str, str] = {}
    reason = _deps.liger_unavailable() if LIGER in settings.sides else None
    if reason is not None:
        absent[LIGER] = reason
    return [s for s in settings.sides if s not in absent], absent


def make_side(name: str, device: torch.device) -> Side:
    """A fresh side (its state lives for one workload)."""
    sides = {TORCH: Side, FLAGGEMS: FlaggemsSide, PATCHED: PatchedSide, COMPILED: CompiledSide,
             PATCHED_COMPILED: PatchedCompiledSide}
    return sides.get(name, functools.partial(LigerSide, device))()
