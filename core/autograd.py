"""Differentiable calls that the compiled entry serves without Python, forward and backward.

An implementation that must record a graph (``aten::group_norm`` on an
Autograd key, where torch's composite would copy its input) describes the
call with :func:`apply` instead of writing a ``torch.autograd.Function``:

* ``forward``: a function of no arguments that launches the forward kernels
  and returns the op's outputs followed by any tensors kept only for the
  backward (statistics, ...);
* a :class:`Derivative`, the typed record of the backward: a backward op
  with a torch schema, the function that computes it, and the function used
  instead under ``create_graph=True`` (a backward that is itself
  differentiable);
* the backward op's arguments as a template: :class:`Grad` (an incoming
  gradient), :class:`Result` (a forward result), :data:`NEEDS` (which
  differentiable inputs need a gradient), tensors of the call (saved for the
  backward) and constants.

On the Python entry, :func:`apply` runs a ``torch.autograd.Function`` built
from these pieces. Under the compiled entry's planner it also notes them, and
the planner turns the call into an *autograd plan*: the next call with the
same key replays the forward launches under a C++ autograd node whose
backward is a keyed entry of its own (replayed launches again, planned on
its first call by running :attr:`Derivative.backward`). No Python runs in the
steady state, in either direction.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Grad:
    """The incoming gradient of the ``index``-th output."""

    index: int


@dataclass(frozen=True)
class Result:
    """The ``index``-th result of the forward (outputs first, then the tensors kept for the backward)."""

    index: int


class _Needs:
    def __repr__(self) -> str:
        return "NEEDS"


#: The backward argument that says, per differentiable input, whether its gradient is needed (``bool[]``).
NEEDS = _Needs()


@dataclass(frozen=True)
class Derivative:
    """How calls of one op are differentiated: its backward op (a typed record the core replays).

    ``name`` and ``schema`` describe the backward op as torch would
    (``"flaggems::group_norm_backward"``, ``"(Tensor grad, ...) -> (Tensor, Tensor, Tensor)"``); it is never
    registered with the dispatcher: the compiled entry keys and plans its calls like an op's.
    ``backward(*args)`` returns one gradient per differentiable input (``None`` where not needed) and must
    not decline. ``double_backward(*args, *extra)`` serves backward passes under ``create_graph=True``:
    its gradients must be differentiable again.
    """

    name: str
    schema: str
    backward: Callable[..., Sequence[torch.Tensor | None]]
    double_backward: Callable[..., Sequence[torch.Tensor | None]]


@dataclass(frozen=True)
class Note:
    """What :func:`apply` tells the planner about the call it served."""

    derivative: Derivative
    results: tuple[torch.Tensor, ...]
    outputs: int
    differentiable: tuple[torch.Tensor | None, ...]
    saved: tuple[torch.Tensor, ...]
    args: tuple[tuple, ...]
    extra: tuple[tuple, ...]


_planning = threading.local()


def planning() -> _Planning:
    """A context in which :func:`apply` notes its call (the planner's; one per thread)."""
    return _Planning()


class _Planning:
    def __enter__(self) -> _Planning:
        self.outer = getattr(_planning, "notes", None)
        self.notes: list[Note] = []
        _planning.notes = self.notes
        return self

    def __exit__(self, *exc: object) -> None:
        _planning.notes = self.outer


def _template(items: Sequence[Any], results: tuple[torch.Tensor, ...], saved: list[torch.Tensor]) -> tuple:
    """Argument items as the compiled entry reads them; tensors join ``saved`` (each once)."""
    out = []
    for item in items:
        if isinstance(item, Grad):
            out.append(("grad", item.index))
        elif isinstance(item, Result):
            out.append(("saved", _save(results[item.index], saved)))
        elif item is NEEDS:
            out.append(("needs",))
        elif isinstance(item, torch.Tensor):
            out.append(("saved", _save(item, saved)))
        else:
            out.append(("const", item))
    return tuple(out)


def _save(tensor: torch.Tensor, saved: list[torch.Tensor]) -> int:
    for index, kept in enumerate(saved):
        if kept is tensor:
            return index
    saved.append(tensor)
    return len(saved) - 1


def _values(template: tuple, grads: Sequence[torch.Tensor | None], saved: Sequence[torch.Tensor],
            needs: list[bool]) -> list[Any]:
    values: list[Any] = []
    for item in template:
        kind = item[0]
        values.append(grads[item[1]] if kind == "grad" else saved[item[1]] if kind == "saved"
                      else needs if kind == "needs" else item[1])
    return values


class FlaggemsFunction(torch.autograd.Function):
    """The Python entry's node for :func:`apply` (the compiled entry builds the same node in C++)."""

    @staticmethod
    def forward(ctx: Any, call: _Call, *differentiable: torch.Tensor | None) -> Any:
        results = tuple(call.forward())
        saved: list[torch.Tensor] = []
        args = _template(call.args, results, saved)
        extra = _template(call.extra, results, saved)
        ctx.save_for_backward(*saved)
        ctx.plan = (call.derivative, args, extra)
        call.results, call.saved, call.templates = results, tuple(saved), (args, extra)
        outputs = results[:call.outputs]
        return outputs[0] if len(outputs) == 1 else outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        derivative, args, extra = ctx.plan
        saved = ctx.saved_tensors
        needs = list(ctx.needs_input_grad[1:])
        values = _values(args, grads, saved, needs)
        if torch.is_grad_enabled():
            found = derivative.double_backward(*values, *_values(extra, grads, saved, needs))
        else:
            found = derivative.backward(*values)
        return (None, *(g if need else None for g, need in zip(found, needs)))


@dataclass
class _Call:
    derivative: Derivative
    forward: Callable[[], Sequence[torch.Tensor]]
    outputs: int
    args: tuple
    extra: tuple
    results: tuple = ()
    saved: tuple = ()
    templates: tuple = ((), ())


def apply(derivative: Derivative, forward: Callable[[], Sequence[torch.Tensor]], *, outputs: int,
          differentiable: tuple[torch.Tensor | None, ...], args: tuple, extra: tuple = ()) -> Any:
    """The call's outputs, recording a node whose backward calls ``derivative`` with ``args``.

    ``forward()`` returns the op's ``outputs`` outputs, then tensors kept only
    for the backward. ``differentiable`` lists the inputs gradients flow to
    (``None`` for an absent optional input), in the order ``derivative.backward``
    returns their gradients. ``args`` (and ``extra``, appended for
    ``double_backward``) hold :class:`Grad`, :class:`Result`, :data:`NEEDS`,
    tensors of the call and constants. An exception raised by ``forward``
    (a decline) leaves no graph behind.
    """
    call = _Call(derivative, forward, outputs, args, extra)
    out = FlaggemsFunction.apply(call, *differentiable)
    notes = getattr(_planning, "notes", None)
    if notes is not None:
        args_t, extra_t = call.templates
        notes.append(Note(derivative, call.results, outputs, differentiable, call.saved, args_t, extra_t))
    return out


def is_node(grad_fn: Any) -> bool:
    """Whether ``grad_fn`` is a node recorded by :func:`apply` (Python or compiled entry)."""
    return grad_fn is not None and "FlaggemsFunction" in grad_fn.name()
