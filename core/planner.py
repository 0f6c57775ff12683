"""The Python planner behind the compiled entry: runs a call and says how to replay it.

The compiled entry (:mod:`flaggems.compiled`) keys each call by its arguments'
metadata. On a miss it calls the op's planner, built here from the same chain
as the Python entry. The planner runs the call (its result is the call's
result) while watching what it does:

* a :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every torch
  op the implementation calls: allocations are noted, views are free, anything
  else (a device-to-host read, a fill, a copy) means the call does work the
  launches alone do not show;
* the kernel toolkit records every launch (:mod:`flaggems.toolkit.recording`).

and answers one of:

The records are :mod:`flaggems.toolkit.plans`' (named tuples; C++ reads their fields where
:func:`~flaggems.toolkit.plans.field_layout` says):

* ``("replay", allocations, steps, returns[, pinned, stream])``: the call was
  served by launches over its inputs and fresh allocations only, or also over
  state buffers the plan owns (:meth:`flaggems.toolkit.recording.Recording.pin`),
  which bind the plan to the stream they were recorded on;
* ``("native",)``: every implementation declined from metadata alone (no data
  was read), so the native kernel serves this key from now on;
* ``("autograd", forward, ...)``: the call was served by
  :func:`flaggems.autograd.apply`: the forward's launches replay under a C++
  autograd node whose backward is planned and replayed as its own entry;
* ``("python",)``: the call needs the Python path every time (a host sync, a
  persistent workspace, a graph recorded otherwise, work outside the recorded
  launches);
* ``None``: nothing is cached (the call raised, or could not be watched).

A replay may come with a third answer, a generic plan that serves the call's
whole layout class at other sizes (:mod:`flaggems.generalize`).

The entry budgets misses (``binding.PLAN_FREE_MISSES``, ``PLAN_RETRY_EVERY``):
planning costs several Python-path calls, so an op whose plans are not used
again stops planning most of its misses until they are.

The plan is only as good as the key: everything an implementation decides
from must be in it (the entry keys dtypes, sizes, strides, storage offsets,
address mod 16, aliasing, devices and scalar arguments; flags are read once
and plans are dropped at every ``enable()``/``disable()``). A generic plan is
only as good as its class key and guards (see :mod:`flaggems.generalize`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import autograd, generalize
from .chain import walk
from .toolkit import plans
from .toolkit import recording as rec_mod

NATIVE_PLAN, PYTHON_PLAN = plans.NATIVE_PLAN, plans.PYTHON_PLAN

_aten = torch.ops.aten
#: Torch ops that allocate without touching data: their results may become plan allocations.
ALLOCATING = frozenset({
    _aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
    _aten.new_empty.default, _aten.new_empty_strided.default,
})
#: Torch ops that neither allocate nor touch device data, beyond the view ops (``OpOverload.is_view``).
METADATA_ONLY = frozenset({
    _aten.detach.default, _aten.alias.default, _aten.sym_size.int, _aten.sym_stride.int, _aten.sym_numel.default,
    _aten.sym_storage_offset.default, _aten.is_contiguous.default, _aten.is_contiguous.memory_format,
    _aten.is_non_overlapping_and_dense.default, _aten.lift_fresh.default, _aten._debug_has_internal_overlap.default,
    _aten.is_same_size.default,
})


class _Watch(TorchDispatchMode):
    """Notes allocations and spoils the recording on any op that does device work."""

    def __init__(self, recording: rec_mod.Recording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.recording.quiet:
            return out  # the recording's own state buffer (Recording.pin)
        if isinstance(out, torch.Tensor) and out.device.type == "meta":
            return out  # shape arithmetic of a plan being built: no memory, no device work
        if func in ALLOCATING:
            self.recording.allocated(out)
        elif not (func in METADATA_ONLY or getattr(func, "is_view", False)):
            self.recording.spoil(f"{func} runs outside the recorded launches")
        return out


def _tensors(result: Any) -> tuple[torch.Tensor | None, ...] | None:
    """The call's results as a tuple; ``None`` entries are undefined tensors (a gradient not asked for)."""
    if isinstance(result, torch.Tensor):
        return (result,)
    if isinstance(result, (tuple, list)) and any(isinstance(t, torch.Tensor) for t in result) and all(
            t is None or isinstance(t, torch.Tensor) for t in result):
        return tuple(result)
    return None


def _needs_grad(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor | None]) -> bool:
    return (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)) or any(
        t is not None and t.requires_grad for t in outputs)


def replay_spec(recording: rec_mod.Recording, result: Any, *, graph_free: bool = True) -> tuple:
    """The plan for a served call: a replay, or the Python path when the recording cannot be replayed.

    ``graph_free``: a call that needs a graph is not replayed (an autograd
    plan's forward, whose node the entry records, passes ``False``).
    """
    outputs = _tensors(result)
    if outputs is None or recording.taint is not None or (graph_free and _needs_grad(recording.inputs, outputs)):
        return PYTHON_PLAN
    device = recording.inputs[0].device if recording.inputs else None
    returns = []
    for out in outputs:
        if out is None:
            returns.append(None)
            continue
        view = recording.view(out)
        if view is None or view[0] == rec_mod.PINNED:
            return PYTHON_PLAN  # a result must be the call's own memory, never the plan's state
        returns.append(view)
    kept = {out.untyped_storage().data_ptr() for out in outputs if out is not None}
    for alloc in recording.allocations:
        if alloc.device != device:
            return PYTHON_PLAN
        if alloc.ref() is not None and alloc.begin not in kept:
            return PYTHON_PLAN  # kept alive by the implementation: a persistent workspace, not the call's own
    allocations = tuple(plans.Allocation(a.sizes, a.strides, a.dtype) for a in recording.allocations)
    if recording.pinned:
        return plans.PinnedReplay("replay", allocations, tuple(recording.steps), tuple(returns),
                                  tuple(recording.pinned), recording.stream)
    return plans.Replay("replay", allocations, tuple(recording.steps), tuple(returns))


def build_planner(chain: Sequence[Any], native: Callable[..., Any], goes_native: Callable[[tuple], bool],
                  op: str = "", autograd_key: bool = True) -> Callable[..., tuple[Any, ...]]:
    """The planner of one op: ``planner(args, kwargs, inputs, layout=None) -> (result, plan or None[,
    generic plan or None])``.

    ``chain`` holds the op's resolved links (``fn``, ``supports``) in order,
    ``native`` the captured native kernel, ``goes_native`` the entry's test of
    Python numbers in Tensor slots (those calls are native whatever the key);
    declines are counted under ``op`` (:func:`flaggems.chain.note_decline`).
    ``layout`` is the call's class key from the entry: replays of one class are
    kept, and a generic plan is returned once they generalise
    (:mod:`flaggems.generalize`). ``autograd_key``: the op is served on an
    Autograd key, where a call that needs a graph is never replayed. Below
    autograd (a backend key) the graph is autograd's business: a call whose
    inputs require grad replays like any other (the SD-1.5 training step sent
    every such ``copy_`` and ``native_group_norm`` down the Python path: 152
    ``copy_`` calls per two steps on the H200).
    """
    points = generalize.Points()

    def planner(args: tuple, kwargs: dict, inputs: tuple, layout: Sequence[int] | None = None) -> plans.Answer:
        if goes_native(args):
            return plans.Answer(native(*args, **kwargs), NATIVE_PLAN)
        with rec_mod.recording(inputs) as recording, _Watch(recording), autograd.planning() as planned:
            result, served = walk(chain, args, kwargs, op)
        if served is not None:
            if not served.replayable:
                return plans.Answer(result, PYTHON_PLAN)
            if planned.notes:
                plan = autograd_spec(recording, planned.notes, result)
                return plans.Answer(result, plan, points.add(layout, inputs, plan))
            plan = replay_spec(recording, result, graph_free=autograd_key)
            return plans.Answer(result, plan, points.add(layout, inputs, plan))
        if recording.steps:
            return plans.Answer(native(*args, **kwargs), None)  # a link launched, then declined: do not trust this key
        if recording.taint is None and all(link.replayable for link in chain):
            return plans.Answer(native(*args, **kwargs), NATIVE_PLAN)
        return plans.Answer(native(*args, **kwargs), PYTHON_PLAN)

    return planner


def _input_index(recording: rec_mod.Recording, tensor: torch.Tensor) -> int | None:
    for index, candidate in enumerate(recording.inputs):
        if candidate is tensor:
            return index
    return None


def autograd_spec(recording: rec_mod.Recording, notes: Sequence[autograd.Note], result: Any) -> tuple:
    """The plan of a call served by one :func:`flaggems.autograd.apply` (else the Python path)."""
    if len(notes) != 1:
        return PYTHON_PLAN
    note = notes[0]
    outputs = _tensors(result)
    if outputs is None or len(outputs) != note.outputs or any(
            o is not r for o, r in zip(outputs, note.results)):
        return PYTHON_PLAN  # the front returned something else than the node's outputs
    forward = replay_spec(recording, note.results, graph_free=False)
    if not isinstance(forward, plans.Replay):
        return PYTHON_PLAN  # a forward with state buffers: the node's replay does not bind streams
    slots = []
    for tensor in note.differentiable:
        index = -1 if tensor is None else _input_index(recording, tensor)
        if index is None:
            return PYTHON_PLAN
        slots.append(index)
    saved = []
    for tensor in note.saved:
        index = _input_index(recording, tensor)
        if index is not None:
            saved.append(plans.Saved(rec_mod.INPUT, index))
            continue
        found = [j for j, r in enumerate(note.results) if r is tensor]
        if not found:
            return PYTHON_PLAN  # a tensor neither input nor result: the replay cannot rebuild it
        saved.append(plans.Saved(rec_mod.ALLOCATION, found[0]))
    derivative = note.derivative
    entry, planner = backward_entry(derivative)
    backward = plans.Backward(derivative.name, f"{derivative.name}{derivative.schema}", entry, planner)
    return plans.AutogradPlan("autograd", forward, note.outputs, tuple(slots), tuple(saved), backward,
                              _backward_args(note.args), derivative.double_backward, _backward_args(note.extra))


def _backward_args(template: tuple[tuple, ...]) -> tuple[plans.BackwardArg, ...]:
    """:func:`flaggems.autograd.apply`'s argument templates (plain ``(kind[, value])`` tuples, as its Python node
    reads them) as the plan's records."""
    return tuple(plans.BackwardArg(*item) for item in template)


class _BackwardLink:
    """A derivative's backward as a planner chain of one link (it never declines)."""

    replayable = True
    supports = None

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn


def backward_entry(derivative: autograd.Derivative) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(entry, planner)`` of a derivative's backward op, made once per derivative."""
    made = _BACKWARDS.get(derivative)
    if made is None:
        made = _BACKWARDS[derivative] = (derivative.backward, build_planner(
            (_BackwardLink(derivative.backward),), derivative.backward, lambda args: False))
    return made


_BACKWARDS: dict[autograd.Derivative, tuple[Callable[..., Any], Callable[..., Any]]] = {}
