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

* ``("replay", allocations, steps, returns)``: the call was served by launches
  over its inputs and fresh allocations only;
* ``("native",)``: every implementation declined from metadata alone (no data
  was read), so the native kernel serves this key from now on;
* ``("python",)``: the call needs the Python path every time (a host sync, a
  persistent workspace, autograd, work outside the recorded launches);
* ``None``: nothing is cached (the call raised, or could not be watched).

The plan is only as good as the key: everything an implementation decides
from must be in it (the entry keys dtypes, sizes, strides, storage offsets,
address mod 16, aliasing, devices and scalar arguments; flags are read once
and plans are dropped at every ``enable()``/``disable()``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import binding
from .toolkit import recording as rec_mod

binding._RECORDERS = rec_mod.RECORDERS

NATIVE_PLAN = ("native",)
PYTHON_PLAN = ("python",)

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
        if isinstance(out, torch.Tensor) and out.device.type == "meta":
            return out  # shape arithmetic of a plan being built: no memory, no device work
        if func in ALLOCATING:
            self.recording.allocated(out)
        elif not (func in METADATA_ONLY or getattr(func, "is_view", False)):
            self.recording.spoil(f"{func} runs outside the recorded launches")
        return out


def _tensors(result: Any) -> tuple[torch.Tensor, ...] | None:
    if isinstance(result, torch.Tensor):
        return (result,)
    if isinstance(result, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in result):
        return tuple(result)
    return None


def _needs_grad(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> bool:
    return (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)) or any(
        t.requires_grad for t in outputs)


def replay_spec(recording: rec_mod.Recording, result: Any) -> tuple:
    """The plan for a served call: a replay, or the Python path when the recording cannot be replayed."""
    outputs = _tensors(result)
    if outputs is None or recording.taint is not None or _needs_grad(recording.inputs, outputs):
        return PYTHON_PLAN
    device = recording.inputs[0].device if recording.inputs else None
    returns = []
    for out in outputs:
        view = recording.view(out)
        if view is None:
            return PYTHON_PLAN
        returns.append(view)
    kept = {out.untyped_storage().data_ptr() for out in outputs}
    for alloc in recording.allocations:
        if alloc.device != device:
            return PYTHON_PLAN
        if alloc.ref() is not None and alloc.begin not in kept:
            return PYTHON_PLAN  # kept alive by the implementation: a persistent workspace, not the call's own
    allocations = tuple((a.sizes, a.strides, a.dtype) for a in recording.allocations)
    return ("replay", allocations, tuple(recording.steps), tuple(returns))


def build_planner(chain: Sequence[Any], native: Callable[..., Any],
                  goes_native: Callable[[tuple], bool]) -> Callable[[tuple, dict, tuple], tuple[Any, Any]]:
    """The planner of one op: ``planner(args, kwargs, inputs) -> (result, plan or None)``.

    ``chain`` holds the op's resolved links (``fn``, ``supports``) in order,
    ``native`` the captured native kernel, ``goes_native`` the entry's test of
    Python numbers in Tensor slots (those calls are native whatever the key).
    """
    def planner(args: tuple, kwargs: dict, inputs: tuple) -> tuple[Any, Any]:
        if goes_native(args):
            return native(*args, **kwargs), NATIVE_PLAN
        with rec_mod.recording(inputs) as recording, _Watch(recording):
            result, served = _run_chain(chain, args, kwargs)
        if served is not None:
            return result, replay_spec(recording, result) if served.replayable else PYTHON_PLAN
        if recording.steps:
            return native(*args, **kwargs), None  # a link launched, then declined: do not trust this key
        if recording.taint is None and all(link.replayable for link in chain):
            return native(*args, **kwargs), NATIVE_PLAN
        return native(*args, **kwargs), PYTHON_PLAN

    return planner


def _run_chain(chain: Sequence[Any], args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """``(result, the link that served)``, or ``(None, None)`` when every link declined."""
    from .binding import Decline

    for link in chain:
        if link.supports is not None and link.supports(*args, **kwargs) is not True:
            continue
        try:
            return link.fn(*args, **kwargs), link
        except Decline:
            continue
    return None, None
