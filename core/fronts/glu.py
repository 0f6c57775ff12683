"""``flaggems::silu_mul``, ``gelu_tanh_mul`` and ``gelu_mul``: the references' semantics, for any kernel.

The ops are ``act(gate) * up`` (:mod:`flaggems.ops`: ``F.silu(gate) * up``,
``F.gelu(gate, approximate="tanh") * up``, ``F.gelu(gate) * up``), the product of a gated MLP whose
two linears give ``gate`` and ``up``. The front owns what every implementation
must agree on with the reference:

* what a kernel serves (:func:`reason`): ``gate`` and ``up`` of one shape,
  one dtype of :data:`DTYPES` (the reference promotes mixed dtypes), one
  device, strided and non-empty, any strides (a merged gate/up projection
  gives the two halves of one ``[..., 2 * I]`` tensor: row stride ``2 * I``).
  Other shapes decline: the reference broadcasts them or raises its own error;
* the output's layout: the one the reference returns, ``act(gate)`` then
  ``* up`` each laid out by TensorIterator's rules (:func:`output_strides`,
  metadata only): contiguous for contiguous inputs and for the halves of a
  merged projection, the inputs' own strides for a dense permuted layout;
* autograd: with grad mode on and ``gate`` or ``up`` requiring grad, the
  output comes from :func:`flaggems.autograd.apply` with a ``Derivative``
  built by :func:`entry` around the implementation's kernels: ``dgate = dy *
  up * act'(gate)`` and ``dup = dy * act(gate)`` in one launch, each only when
  needed, laid out like the forward's output. Under ``create_graph=True`` the
  backward is the reference's own derivative (:func:`differentiable_backward`).
  Forward-mode AD and functorch transforms decline (the reference handles them).

A kernel provides two functions (see :func:`entry`): ``prepare(shape,
strides, dtype, activation, needs, device)``, from metadata only, cached here
per layout, and ``launch(prepared, *tensors)``, which launches it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import autograd
from ..chain import Decline
from ..toolkit import context
from ..toolkit.iterator_layout import iterator_strides
from ..toolkit.layout import remember
from .group_norm import transformed

#: Dtypes the kernels compute (fp32 math, one rounding).
DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
SILU = "silu"
GELU_TANH = "gelu_tanh"
GELU = "gelu"
#: The op of each activation (its reference is ``flaggems.ops.<op>``).
OPS = {SILU: "silu_mul", GELU_TANH: "gelu_tanh_mul", GELU: "gelu_mul"}

Strides = tuple[int, ...]


@dataclass(frozen=True)
class Plan:
    """A validated layout: the output's strides and the kernel's own launch description (``prepare``'s)."""

    out_strides: Strides
    prepared: Any


def reason(gate: torch.Tensor, up: torch.Tensor, dtypes: frozenset[torch.dtype] = DTYPES) -> str | None:
    """Why a call declines (``None`` when a kernel serves it); reads metadata only."""
    if gate.dtype not in dtypes:
        return f"dtype {gate.dtype}"
    if up.dtype != gate.dtype:
        return "mixed dtypes (the reference promotes)"
    if up.device != gate.device:
        return "tensors on different devices"
    if gate.layout != torch.strided or up.layout != torch.strided:
        return "non-strided layout"
    if gate.shape != up.shape:
        return "gate and up of different shapes (the reference broadcasts or raises)"
    if gate.numel() == 0:
        return "empty input"
    return None


# --------------------------------------------------------------------------- the reference's output layout
# ``act(gate)`` and ``* up`` are each a TensorIterator: :mod:`flaggems.toolkit.iterator_layout` gives
# their outputs' strides.
def output_strides(shape: Sequence[int], gate_strides: Strides, up_strides: Strides) -> Strides:
    """The strides of the reference's ``act(gate) * up`` (two TensorIterators)."""
    activated = iterator_strides(shape, [(shape, gate_strides)])
    return tuple(iterator_strides(shape, [(shape, activated), (shape, up_strides)]))


# --------------------------------------------------------------------------- autograd
def needs_grad(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether the call must record a graph (grad mode on, ``gate`` or ``up`` requires grad).

    ``Decline`` under forward-mode AD or a functorch transform: the reference's ops handle those.
    """
    if transformed():
        raise Decline("forward-mode AD or a functorch transform")
    return torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)


def allocate(like: torch.Tensor, strides: Strides) -> torch.Tensor:
    """An uninitialised tensor of ``like``'s shape, dtype and device with ``strides``."""
    return torch.empty_strided(like.shape, strides, dtype=like.dtype, device=like.device)


def differentiable_backward(activation: str) -> Callable[..., tuple[torch.Tensor | None, ...]]:
    """The backward used under ``create_graph``: the reference's derivative, recorded (differentiable again)."""
    from .. import ops

    reference = getattr(ops, OPS[activation])

    def backward(grad: torch.Tensor | None, gate: torch.Tensor, up: torch.Tensor,
                 needs: list[bool]) -> tuple[torch.Tensor | None, ...]:
        """``(dgate, dup)``: the reference recomputed on the saved inputs and differentiated, recorded."""
        wanted = [t for t, need in zip((gate, up), needs, strict=True) if need]
        if grad is None or not wanted:
            return None, None
        with torch.enable_grad():
            found = iter(torch.autograd.grad(reference(gate, up), wanted, grad, create_graph=True))
        return tuple(next(found) if need else None for need in needs)

    return backward


# --------------------------------------------------------------------------- the implementation
Prepare = Callable[[tuple[int, ...], tuple[Strides, ...], torch.dtype, str, tuple[bool, bool] | None, torch.device],
                   Any]
Launch = Callable[..., None]


def entry(prepare: Prepare, launch: Launch, activation: str, dtypes: frozenset[torch.dtype] = DTYPES,
          ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The ``flaggems::<activation>_mul`` implementation around one forward and one backward kernel.

    ``prepare(shape, strides, dtype, activation, needs, device)`` describes a
    launch from metadata (called once per layout): the forward when ``needs``
    is ``None``, strides ``(gate, up, out)``, launched as
    ``launch(prepared, gate, up, out)``; else the backward, strides ``(dy,
    gate, up, grads)`` (``dgate`` and ``dup`` share the output's layout) and
    ``needs = (dgate wanted, dup wanted)``, launched as ``launch(prepared, dy,
    gate, up, dgate, dup)`` with ``None`` for a gradient not wanted. Only the
    forward's ``prepare`` may ``Decline`` (a layout the kernel cannot address);
    the backward's must serve any ``dy`` strides.
    """
    name = f"flaggems::{OPS[activation]}"
    forward_plans: dict[tuple, Plan] = context.cache()  # emptied with the kernel context (tuning, facts)
    backward_plans: dict[tuple, Any] = context.cache()  # emptied with the kernel context (tuning, facts)

    def forward_plan(gate: torch.Tensor, up: torch.Tensor) -> Plan:
        key = (gate.shape, gate.stride(), up.stride(), gate.dtype, up.dtype, gate.device, up.device, up.shape,
               gate.layout, up.layout)
        plan = forward_plans.get(key)
        if plan is None:
            why = reason(gate, up, dtypes)
            if why is not None:
                raise Decline(why)
            shape, strides = tuple(gate.shape), (tuple(gate.stride()), tuple(up.stride()))
            out = output_strides(shape, *strides)
            prepared = prepare(shape, (*strides, out), gate.dtype, activation, None, gate.device)
            plan = remember(forward_plans, key, Plan(out, prepared))
        return plan

    def backward(grad: torch.Tensor | None, gate: torch.Tensor, up: torch.Tensor,
                 needs: list[bool]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(dgate, dup)`` in one launch, each only where ``needs`` asks (never declines), laid out as the
        forward's output (:func:`output_strides` of the saved ``gate`` and ``up``)."""
        wanted = (bool(needs[0]), bool(needs[1]))
        if grad is None or not (wanted[0] or wanted[1]):
            return None, None
        if grad.is_neg():
            grad = grad.resolve_neg()
        key = (grad.shape, grad.stride(), gate.stride(), up.stride(), wanted, gate.dtype, grad.dtype, gate.device)
        found = backward_plans.get(key)
        if found is None:
            shape = tuple(gate.shape)
            out = output_strides(shape, tuple(gate.stride()), tuple(up.stride()))
            strides = (tuple(grad.stride()), tuple(gate.stride()), tuple(up.stride()), out)
            found = remember(backward_plans, key, Plan(out, prepare(shape, strides, gate.dtype, activation, wanted,
                                                                    gate.device)))
        dgate = allocate(gate, found.out_strides) if wanted[0] else None
        dup = allocate(up, found.out_strides) if wanted[1] else None
        launch(found.prepared, grad, gate, up, dgate, dup)
        return dgate, dup

    # No sizes among the arguments (the layout comes from the saved inputs): one autograd node, and one
    # backward layout class, serve every prompt length (with ``int[] out_strides`` every length missed both).
    derivative = autograd.Derivative(
        f"{name}_backward", "(Tensor grad, Tensor gate, Tensor up, bool[2] needs) -> (Tensor, Tensor)",
        backward, differentiable_backward(activation))

    def implementation(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` in one launch, recording our backward when a gradient is needed."""
        plan = forward_plan(gate, up)

        def run() -> tuple[torch.Tensor]:
            out = allocate(gate, plan.out_strides)
            launch(plan.prepared, gate, up, out)
            return (out,)

        if not needs_grad(gate, up):
            return run()[0]
        return autograd.apply(derivative, run, outputs=1, differentiable=(gate, up),
                              args=(autograd.Grad(0), gate, up, autograd.NEEDS))

    implementation.__name__ = OPS[activation]
    implementation.__doc__ = f"``{name}``: ``{activation}(gate) * up`` in one launch (see :mod:`{__name__}`)."
    implementation.derivative = derivative
    return implementation
