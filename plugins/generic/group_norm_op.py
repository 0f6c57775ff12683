"""``aten::group_norm``: ``F.group_norm`` / ``nn.GroupNorm`` through the kernels of :mod:`.group_norm`.

``aten::group_norm`` is CompositeImplicitAutograd: torch's composite copies
the input (``.contiguous()`` on CUDA, the suggested memory format on CPU)
before ``native_group_norm``. Routing it here reads a channels_last input in
place (no copy). The binding registers this entry on the backend key and on
its Autograd key; at the Autograd key the inputs may require grad:

* grad needed (grad mode on and ``input``, ``weight`` or ``bias`` requires
  grad) for an input that torch's composite would copy
  (:func:`in_place_grad`): the output comes from a node of
  :func:`flaggems.autograd.apply` (:data:`GROUP_NORM_GRAD`), whose forward runs
  ``native_group_norm``'s kernels (mean/rstd saved) and whose backward runs
  ``native_group_norm_backward``'s, asking only for the gradients needed; the
  compiled entry replays both without Python.
  Under ``create_graph=True`` the backward is torch's instead (the forward
  recomputed through ``aten::native_group_norm``, whose derivative is
  differentiable again): double backward, e.g. a gradient penalty, gets
  torch's values. ``once_differentiable`` would be wrong there: it marks
  the gradients only when a ``grad_output`` requires grad, so
  ``grad(y, x, ones, create_graph=True)`` would silently lose its second order.
* grad needed otherwise: declined to torch's composite, whose
  ``native_group_norm`` and ``native_group_norm_backward`` our kernels serve
  (C++ host path: cheaper per call than our Python node).
* no grad needed: the forward kernels only.

Output layout: the input's suggested memory format, so a channels_last input
gives a channels_last output (as torch's composite does on CPU; on CUDA it
returns a contiguous output, having copied the input). The input's gradient
is laid out the same way (torch's CUDA composite returns it contiguous, which
a channels_last convolution's backward then copies back); the parameters'
gradients are vectors.

Everything else declines to torch's composite, which then raises its own
error or computes the result: invalid arguments (``num_groups`` not dividing
``C``, a weight or bias not a vector of ``C``, rank < 2), what the kernels
decline (empty input, other dtypes, mixed dtypes torch rejects, devices),
forward-mode AD and functorch transforms, and a bias that needs grad without
a weight (torch's backward raises there). Those decisions, the composite's
layouts and whether it copies the input are :mod:`flaggems.fronts.group_norm`'s
(:func:`~flaggems.fronts.group_norm.prepare_group_norm`,
:func:`~flaggems.fronts.group_norm.needs_grad`,
:func:`~flaggems.fronts.group_norm.composite_copies`); this module keeps the
routing policy (:func:`in_place_grad`) and the autograd plumbing.
"""

from __future__ import annotations

import torch

from flaggems import Decline, autograd
from flaggems.fronts import group_norm as front

from . import group_norm as kernels  # through the module: a patched (spied) function is seen


def in_place_grad(input: torch.Tensor) -> bool:
    """Whether a call that needs a gradient goes through our node (else torch's composite).

    Only where the composite would copy the input: with a gradient needed our node beat the composite over
    our kernels on every channels_last size measured, 10-128 MiB (the copies cost more than our node's Python
    host time); a dense input costs the composite no copy and its host path is C++ (H200).
    """
    return front.composite_copies(input)


def _backward_fallback(grad_out: torch.Tensor, input: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                       weight: torch.Tensor | None, dims: tuple[int, int, int, int],
                       mask: list[bool]) -> tuple[torch.Tensor | None, ...]:
    """torch's backward on the operands its autograd formula passes (a ``grad_out`` our kernels decline)."""
    fmt = front.native_format(input)
    dy = grad_out.resolve_neg().resolve_conj().contiguous(memory_format=fmt)
    return torch.ops.aten.native_group_norm_backward(dy, input.contiguous(memory_format=fmt), mean, rstd, weight,
                                                     *dims, mask)


def _differentiable_backward(grad_out: torch.Tensor, saved: tuple[torch.Tensor | None, ...],
                             dims: tuple[int, int, int, int], eps: float,
                             mask: list[bool]) -> tuple[torch.Tensor | None, ...]:
    """torch's backward on a recomputed forward, recorded (``create_graph=True``): differentiable again."""
    input, weight, bias = saved
    x = input.contiguous(memory_format=front.native_format(input))  # what torch's composite passes
    y = torch.ops.aten.native_group_norm(x, weight, bias, *dims, eps)[0]
    found = iter(torch.autograd.grad(y, [t for t, m in zip(saved, mask) if m], grad_out, create_graph=True))
    return tuple(next(found) if m else None for m in mask)


def _backward(grad_out: torch.Tensor, input: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
              weight: torch.Tensor | None, N: int, C: int, HxW: int, group: int,
              output_mask: list[bool]) -> tuple[torch.Tensor | None, ...]:
    """Our backward kernels for the gradients asked; torch's where they decline (never raises ``Decline``)."""
    dims = (N, C, HxW, group)
    try:
        return kernels.native_group_norm_backward(grad_out, input, mean, rstd, weight, *dims, output_mask,
                                                  dx_like_input=True)
    except Decline:
        return _backward_fallback(grad_out, input, mean, rstd, weight, dims, output_mask)


def _double_backward(grad_out: torch.Tensor, input: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                     weight: torch.Tensor | None, N: int, C: int, HxW: int, group: int, output_mask: list[bool],
                     bias: torch.Tensor | None, eps: float) -> tuple[torch.Tensor | None, ...]:
    """Under ``create_graph``: torch's backward on a recomputed forward, differentiable again."""
    return _differentiable_backward(grad_out, (input, weight, bias), (N, C, HxW, group), eps, list(output_mask))


#: The backward of our ``aten::group_norm`` node: ``native_group_norm_backward``'s arguments, with ``dx``
#: laid out like the input (see the module docstring).
GROUP_NORM_GRAD = autograd.Derivative(
    "flaggems::group_norm_backward",
    "(Tensor grad_out, Tensor input, Tensor mean, Tensor rstd, Tensor? weight, int N, int C, int HxW, int group, "
    "bool[3] output_mask) -> (Tensor, Tensor, Tensor)",
    _backward, _double_backward,
)


def group_norm(input: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-05, cudnn_enabled: bool = True) -> torch.Tensor:
    """``aten::group_norm``: the normalised input, recording our backward when a gradient is needed.

    ``cudnn_enabled`` is ignored (torch deprecated it). A decline raised by
    the forward kernels leaves no graph behind: it passes the call, inputs
    untouched, to torch's composite.
    """
    N, C, HxW = front.prepare_group_norm(input, num_groups, weight, bias)
    if front.needs_grad(input, weight, bias):
        if not in_place_grad(input):
            raise Decline("gradient needed and torch's composite reads this input without a large copy: it "
                          "calls native_group_norm (and its backward), which our kernels serve")
        return autograd.apply(
            GROUP_NORM_GRAD,
            lambda: kernels.native_group_norm(input, weight, bias, N, C, HxW, num_groups, eps, dense_only=False),
            outputs=1, differentiable=(input, weight, bias),
            args=(autograd.Grad(0), input, autograd.Result(1), autograd.Result(2), weight, N, C, HxW, num_groups,
                  autograd.NEEDS),
            extra=(bias, eps))
    return kernels.native_group_norm(input, weight, bias, N, C, HxW, num_groups, eps, dense_only=False)[0]
