"""``flaggems::group_norm_silu``: the reference's semantics, for any kernel.

The reference (:func:`flaggems.ops.group_norm_silu`) is
``F.silu(F.group_norm(input, num_groups, weight, bias, eps))``: the GroupNorm
then SiLU a diffusers ``ResnetBlock2D`` runs twice. torch makes two passes of
the activation for it (three reads and two writes); one kernel reads it twice
and writes once. The front owns what every implementation must agree on:

* what a kernel serves (:func:`reason`): the arguments ``aten::group_norm``'s
  composite accepts (rank >= 2, ``num_groups`` dividing ``C``, a weight and a
  bias each a vector of ``C`` or absent; other arguments decline and the
  reference raises its own error), an input of :data:`DTYPES`, strided, not
  empty, with any strides (a channels_last input is read in place), the
  affine parameters on its device, in dtypes torch's group norm takes
  together (its own, or, on CPU only, fp32 with a half input);
  :mod:`flaggems.fronts.group_norm`'s checks, shared;
* the output: the input's shape and dtype, laid out in the input's suggested
  memory format (:func:`allocate`). That is the reference's layout on CPU;
  on other devices torch's composite copies a channels_last input and
  returns a contiguous output, where this op keeps channels_last, as
  flaggems' ``aten::group_norm`` does: the convolution after it reads it
  without a copy;
* autograd: with grad mode on and the input, weight or bias requiring grad,
  the output comes from :func:`flaggems.autograd.apply` with the
  :class:`~flaggems.autograd.Derivative` built by :func:`entry`, whose
  backward asks the kernel for the gradients needed only: ``dx`` laid out
  like the input (:func:`flaggems.fronts.group_norm.dx_format` with
  ``like_input``), ``dweight``/``dbias`` vectors in the parameter's dtype.
  Under ``create_graph=True`` the backward is the reference's own derivative
  on a recomputed forward (:func:`differentiable_backward`), differentiable
  again. Forward-mode AD and functorch transforms decline (the reference
  handles them), and so does a bias that requires grad without a weight
  (torch's backward raises for it: the reference's error).

A kernel provides two functions (see :func:`entry`): ``forward(input, weight,
bias, N, C, HxW, group, eps, y, save)``, which fills ``y`` and returns what
its backward needs (with ``save``; anything otherwise), and ``backward(grad,
input, saved, weight, bias, N, C, HxW, group, dx, dweight, dbias)``, which
fills every gradient that is not ``None`` and never declines.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .. import autograd
from .. import ops as reference
from ..chain import Decline
from ..toolkit import context
from ..toolkit.iterator_layout import iterator_strides
from ..toolkit.layout import remember
from . import group_norm

#: Dtypes the kernels normalise (fp32 statistics and math, one rounding).
DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})

Forward = Callable[..., object]
Backward = Callable[..., None]
Gradients = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def reason(input: torch.Tensor, num_groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
           dtypes: frozenset[torch.dtype] = DTYPES) -> str | None:
    """Why a call declines (``None`` when a kernel may serve it); metadata only."""
    found = group_norm.composite_reason(input, num_groups, weight, bias)
    if found is not None:
        return f"{found} (the reference raises)"
    N, C, HxW = group_norm.dims(input)
    return group_norm.forward_reason(input, weight, bias, N, C, HxW, dense_only=False, dtypes=dtypes)


def allocate(input: torch.Tensor) -> torch.Tensor:
    """The output, uninitialised: the input's shape and dtype in its suggested memory format.

    With a size-1 dimension, the strides the reference's SiLU gives that layout (TensorIterator sets a
    size-1 dimension's stride from the dimensions inside it: ``[2, 6, 1, 1]`` channels_last comes back
    ``(6, 1, 1, 1)``, not ``empty_like``'s ``(6, 1, 6, 6)``).
    """
    fmt = group_norm.suggest_memory_format(input)
    if 1 not in input.shape:
        return torch.empty_like(input, memory_format=fmt)
    shape = list(input.shape)
    dense = torch.empty(shape, device="meta", memory_format=fmt).stride()
    strides = iterator_strides(shape, [(shape, dense)])
    return torch.empty_strided(shape, strides, dtype=input.dtype, device=input.device)


def allocate_backward(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                      needs: Sequence[bool]) -> Gradients:
    """``(dx, dweight, dbias)`` uninitialised, each only where ``needs`` asks (and the parameter exists)."""
    dx = None
    if needs[0]:
        like_x, fmt = group_norm.dx_format(input, like_input=True)
        dx = torch.empty_like(input) if like_x else torch.empty_like(input, memory_format=fmt)
    dw = None if weight is None or not needs[1] else torch.empty(weight.shape[0], dtype=weight.dtype,
                                                                    device=weight.device)
    db = None if bias is None or not needs[2] else torch.empty(bias.shape[0], dtype=bias.dtype, device=bias.device)
    return dx, dw, db


def needs_grad(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> bool:
    """Whether the call records a graph (grad mode on and an input requires grad).

    ``Decline`` under forward-mode AD or a functorch transform (the
    reference's decomposition knows how to handle those), and for a bias that
    requires grad without a weight: torch's group-norm backward raises there,
    so the reference must keep the call
    (:func:`flaggems.fronts.group_norm.needs_grad`).
    """
    if group_norm.transformed():
        raise Decline("forward-mode AD or a functorch transform")
    return group_norm.needs_grad(input, weight, bias)


def differentiable_backward(grad: torch.Tensor, input: torch.Tensor, weight: torch.Tensor | None,
                            bias: torch.Tensor | None, num_groups: int, eps: float,
                            needs: Sequence[bool]) -> Gradients:
    """``(dx, dweight, dbias)`` as the reference's autograd computes them, recorded (``create_graph``)."""
    inputs = (input, weight, bias)
    wanted = [t for t, need in zip(inputs, needs) if need and t is not None]
    if not wanted:
        return None, None, None
    with torch.enable_grad():
        out = reference.group_norm_silu(input, num_groups, weight, bias, eps)
        found = iter(torch.autograd.grad(out, wanted, grad, create_graph=True))
    return tuple(next(found) if need and t is not None else None for t, need in zip(inputs, needs))


def _key(input: torch.Tensor, num_groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None) -> tuple:
    params = tuple(None if p is None else (p.shape, p.stride(), p.dtype, p.device, p.layout) for p in (weight, bias))
    return input.shape, input.stride(), input.dtype, input.device, input.layout, num_groups, params


def entry(forward: Forward, backward: Backward, dtypes: frozenset[torch.dtype] = DTYPES,
          ) -> Callable[..., torch.Tensor]:
    """The ``flaggems::group_norm_silu`` implementation around a kernel's ``forward`` and ``backward``.

    It checks a layout once (:func:`reason`, cached per layout); per call it
    allocates the output and launches, through :func:`flaggems.autograd.apply`
    when a gradient is needed (the forward then keeps what ``forward`` returns
    for ``backward``).
    """
    checked: dict[tuple, tuple[int, int, int]] = context.cache()  # emptied with the kernel context

    def plan(input: torch.Tensor, num_groups: int, weight: torch.Tensor | None,
             bias: torch.Tensor | None) -> tuple[int, int, int]:
        key = _key(input, num_groups, weight, bias)
        found = checked.get(key)
        if found is None:
            why = reason(input, num_groups, weight, bias, dtypes)
            if why is not None:
                raise Decline(why)
            found = remember(checked, key, group_norm.dims(input))
        return found

    def run(input: torch.Tensor, num_groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
            eps: float, dims: tuple[int, int, int], save: bool) -> tuple[torch.Tensor, ...]:
        y = allocate(input)
        saved = forward(input, weight, bias, *dims, num_groups, float(eps), y, save)
        return (y, saved) if save else (y,)

    def grads(grad: torch.Tensor | None, input: torch.Tensor, saved: torch.Tensor, weight: torch.Tensor | None,
              bias: torch.Tensor | None, num_groups: int, needs: list[bool]) -> Gradients:
        """``(dx, dweight, dbias)`` from the kernel's backward, each only where ``needs`` asks."""
        if grad is None:
            return None, None, None
        if grad.is_neg():
            grad = grad.resolve_neg()
        dx, dw, db = allocate_backward(input, weight, bias, needs)
        if dx is None and dw is None and db is None:
            return None, None, None
        backward(grad, input, saved, weight, bias, *group_norm.dims(input), num_groups, dx, dw, db)
        return dx, dw, db

    def double(grad: torch.Tensor | None, input: torch.Tensor, saved: torch.Tensor, weight: torch.Tensor | None,
               bias: torch.Tensor | None, num_groups: int, needs: list[bool], eps: float) -> Gradients:
        if grad is None:
            return None, None, None
        return differentiable_backward(grad, input, weight, bias, num_groups, eps, needs)

    derivative = autograd.Derivative(
        "flaggems::group_norm_silu_backward",
        "(Tensor grad, Tensor input, Tensor saved, Tensor? weight, Tensor? bias, int num_groups, bool[3] needs) "
        "-> (Tensor, Tensor, Tensor)",
        grads, double)

    def group_norm_silu(input: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None,
                        bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
        """``flaggems::group_norm_silu``: ``silu(group_norm(input))`` (see :mod:`flaggems.fronts.group_norm_silu`)."""
        dims = plan(input, num_groups, weight, bias)
        if needs_grad(input, weight, bias):
            return autograd.apply(
                derivative, lambda: run(input, num_groups, weight, bias, eps, dims, True),
                outputs=1, differentiable=(input, weight, bias),
                args=(autograd.Grad(0), input, autograd.Result(1), weight, bias, num_groups, autograd.NEEDS),
                extra=(float(eps),))
        return run(input, num_groups, weight, bias, eps, dims, False)[0]

    group_norm_silu.derivative = derivative
    return group_norm_silu
