"""``flaggems::rms_norm`` and ``flaggems::add_rms_norm``: the references' semantics, for any kernel.

The references (:func:`flaggems.ops.rms_norm`, :func:`flaggems.ops.add_rms_norm`)
are transformers' RMSNorm module code. Per row of the last dimension ``H``:
``rstd = 1 / sqrt(mean(x**2) + eps)`` and ``n = x * rstd`` in fp32, then

* ``cast_first`` (Llama, Qwen2/3, Mistral): ``s * round_in(n)`` in the promoted
  dtype of the weight and the input, ``s = round_w(weight + weight_offset)``
  (``weight`` itself when the offset is 0);
* otherwise (Gemma): ``round_in(n * (weight.float() + weight_offset))``;
* no weight: ``round_in(n)``.

``add_rms_norm`` first rounds ``input + residual`` to the input's dtype (the
reference adds in that dtype) and normalises the rounded sum; it returns
``(normed, sum)``.

The front owns what every implementation must agree on:

* what a kernel serves (:func:`reason`): input, residual and weight of the
  dtypes of :data:`DTYPES` on one device, strided, non-empty; the input of
  rank >= 1; the residual of the input's shape and dtype (the reference would
  broadcast or promote: declined); the weight a vector of ``H`` elements (any
  stride, any of :data:`DTYPES`: a float32 weight with bfloat16 activations is
  what autocast training gives). Everything else declines: the reference then
  computes the result or raises its own error;
* the outputs' dtype and layout: those the reference returns, found once per
  layout by running the reference on ``meta`` tensors (:func:`layout`);
* autograd: with grad mode on and any of input, residual or weight requiring
  grad, the outputs come from :func:`flaggems.autograd.apply` (the records
  :data:`RMS_NORM_GRAD`-style, built by :func:`entries`); the forward also
  returns ``rstd`` (fp32, one per row, laid out as the leading dimensions),
  kept only for the backward. The backward computes, per row,
  ``dx = rstd * (g - n * mean(g * n))`` with ``g`` the gradient reaching
  ``n`` (``round_in(round_out(dy * s))`` with ``cast_first``, as the
  reference's autograd rounds it; ``dy * (w + offset)`` without; ``dy``
  without a weight) and ``dweight = sum over rows of dy * round_in(n)``
  (``dy * n`` without ``cast_first``); for ``add_rms_norm`` the gradient of
  the sum joins: ``d(sum) = round_in(dx) + grad_sum``, returned for both the
  input and the residual (one tensor, as torch's own ``add`` backward does).
  Under ``create_graph=True`` the backward is the reference's own derivative
  on a recomputed forward (:func:`differentiable_backward`), differentiable again. Forward-mode AD
  and functorch transforms decline.

A kernel provides two functions (see :func:`entries`): ``forward(input,
residual, weight, y, total, rstd, eps, offset, cast_first)``, which fills
``y`` (and ``total`` and ``rstd`` where they are not ``None``) and may raise
``Decline`` before launching anything, and ``backward(dy, dsum, x, rstd,
weight, dx, dweight, offset, cast_first)``, which fills ``dx`` and ``dweight``
where they are not ``None`` (``x`` is the normalised tensor: the input, or the
sum) and never declines.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .. import autograd
from .. import ops as reference
from ..chain import Decline
from ..toolkit import context
from ..toolkit.iterator_layout import contiguous_strides, is_dense, iterator_strides
from ..toolkit.layout import remember
from .group_norm import transformed

#: Dtypes the kernels normalise (fp32 math).
DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})

Forward = Callable[..., None]
Backward = Callable[..., None]


@dataclass(frozen=True)
class Layout:
    """The outputs of one call layout, as the reference returns them (metadata only).

    Attributes:
        out_dtype: dtype of the normalised output (the promoted dtype of weight and input with
            ``cast_first`` and a weight, else the input's).
        out_strides: strides of the normalised output.
        sum_strides: strides of ``input + residual`` (``add_rms_norm``), else ``None``.
    """

    out_dtype: torch.dtype
    out_strides: tuple[int, ...]
    sum_strides: tuple[int, ...] | None


def _tensor_reason(t: torch.Tensor, what: str) -> str | None:
    if t.dtype not in DTYPES:
        return f"{what} dtype {t.dtype}"
    if t.layout != torch.strided or t.is_neg() or t.is_conj():
        return f"{what}: non-strided layout or view bit"
    return None


def reason(input: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None) -> str | None:
    """Why a call declines (``None`` when a kernel may serve it); metadata only."""
    found = _tensor_reason(input, "input")
    if found:
        return found
    if input.dim() == 0 or input.numel() == 0:
        return "empty or 0-dim input"
    if residual is not None:
        found = _tensor_reason(residual, "residual")
        if found:
            return found
        if residual.shape != input.shape or residual.dtype != input.dtype or residual.device != input.device:
            return "residual of another shape, dtype or device (the reference broadcasts, promotes or raises)"
    if weight is not None:
        found = _tensor_reason(weight, "weight")
        if found:
            return found
        if weight.dim() != 1 or weight.shape[0] != input.shape[-1] or weight.device != input.device:
            return "weight not a vector of the hidden size on the input's device (the reference broadcasts or raises)"
    return None


def _meta(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def layout(input: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
           cast_first: bool) -> Layout:
    """The outputs' dtype and strides, as the reference's would be.

    The dtype is a run of the reference on ``meta`` tensors (``torch.promote_types``
    would be a dispatched op, which spoils the planner's recording of the call
    that builds this layout). The strides follow the reference's TensorIterator
    steps (:mod:`flaggems.toolkit.iterator_layout`): meta kernels lay a size-1
    dimension out differently from the device kernels (``[1, 8]`` strides
    ``(1, 1)``: the CPU kernel keeps them, the meta one gives ``(8, 1)``).
    """
    x, w = _meta(input), _meta(weight)
    if residual is None:
        y, total = reference.rms_norm(x, w, 1e-6, 0.0, cast_first), None
        total_strides = None
    else:
        y, total = reference.add_rms_norm(x, _meta(residual), w, 1e-6, 0.0, cast_first)
        total_strides = iterator_strides(input.shape, [(input.shape, input.stride()),
                                                       (residual.shape, residual.stride())])
    source = total_strides if total_strides is not None else input.stride()
    y_strides = _normed_strides(list(input.shape), list(source), total_strides is None and
                                input.dtype != torch.float32, weight, cast_first)
    return Layout(y.dtype, tuple(y_strides), None if total is None else tuple(total_strides))


def _kept_or_dense(sizes: Sequence[int], strides: Sequence[int]) -> list[int]:
    """The strides of a cast (``preserve_format``), as torch's ``_to_copy`` lays them out (run on ``meta``): a
    dense tensor's own; another's dense permutation of its stride order (``[2, 3, 4, 64]`` strides
    ``(128, 2049, 512, 1)`` -> ``(64, 512, 128, 1)``, not the contiguous ``(768, 256, 64, 1)``)."""
    if is_dense(sizes, strides):
        return list(strides)
    probe = torch.empty_strided(tuple(sizes), tuple(strides), dtype=torch.bfloat16, device="meta")
    return list(probe.to(torch.float32).stride())


def _normed_strides(shape: list[int], strides: list[int], copies: bool, weight: torch.Tensor | None,
                    cast_first: bool) -> list[int]:
    """``x * rsqrt(mean(x**2) + eps)`` then the weight's product, TensorIterator's layout at each step.

    ``copies``: the reference's ``.float()`` copies the input (kept when dense, else its suggested format).
    The weight's strides never decide: a broadcast vector has one non-zero stride, the last dimension's.
    """
    x = _kept_or_dense(shape, strides) if copies else strides
    stats = (shape[:-1] + [1], contiguous_strides(shape[:-1] + [1]))  # the keepdim mean: a fresh reduction
    normed = iterator_strides(shape, [(shape, x), stats])
    if weight is None:
        return normed
    w = (list(weight.shape), list(weight.stride()))
    return iterator_strides(shape, [w, (shape, normed)] if cast_first else [(shape, normed), w])


def needs_grad(input: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None) -> bool:
    """Whether the call records a graph (grad mode on and an input requires grad).

    ``Decline`` under forward-mode AD or a functorch transform: the
    reference's decomposition knows how to handle those.
    """
    if not torch.is_grad_enabled():
        return False
    wants = input.requires_grad or (residual is not None and residual.requires_grad) or (
        weight is not None and weight.requires_grad)
    if wants and transformed():
        raise Decline("forward-mode AD or a functorch transform")
    return wants


def allocate(input: torch.Tensor, found: Layout, save_rstd: bool,
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(y, total, rstd)`` uninitialised: ``total`` for ``add_rms_norm``, ``rstd`` only when saved."""
    device = input.device
    y = torch.empty_strided(input.shape, found.out_strides, dtype=found.out_dtype, device=device)
    total = None
    if found.sum_strides is not None:
        total = torch.empty_strided(input.shape, found.sum_strides, dtype=input.dtype, device=device)
    rstd = torch.empty(input.shape[:-1], dtype=torch.float32, device=device) if save_rstd else None
    return y, total, rstd


def allocate_backward(x: torch.Tensor, weight: torch.Tensor | None, need_dx: bool,
                      need_dweight: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dweight)``: ``dx`` laid out like ``x`` (dense) in its dtype, ``dweight`` a vector in the weight's."""
    dx = torch.empty_like(x) if need_dx else None
    dw = None
    if need_dweight and weight is not None:
        dw = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    return dx, dw


def differentiable_backward(grads: Sequence[torch.Tensor | None], x: torch.Tensor, weight: torch.Tensor | None,
                            eps: float, offset: float, cast_first: bool,
                            wanted: Sequence[bool]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(d x, d weight)`` as the reference's autograd computes them, recorded (``create_graph``).

    ``grads``: the normalised output's gradient, then (``add_rms_norm``) the
    sum's, which joins ``d x`` unchanged (``x`` is the sum there, this node's
    own output). ``d x`` comes from ``torch.autograd.grad`` through the
    reference on ``x``; ``d weight`` is written out (``sum over rows of
    dy * round_in(n)``, as the reference's ``mul`` backward makes it): asking
    the engine for it would also walk back through this node, which has an
    edge to the weight, and re-enter this backward without end.
    """
    dx = dw = None
    with torch.enable_grad():
        if wanted[0]:
            y = reference.rms_norm(x, weight, eps, offset, cast_first)
            dx = torch.autograd.grad(y, x, grads[0], create_graph=True)[0]
            if len(grads) > 1 and grads[1] is not None:
                dx = dx + grads[1]
        if wanted[1] and weight is not None:
            xf = x.float()
            n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            terms = grads[0] * n.to(x.dtype) if cast_first else grads[0].float() * n
            dw = terms.sum(tuple(range(x.dim() - 1))).to(weight.dtype)
    return dx, dw


# --------------------------------------------------------------------------- entries
def _key(input: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, cast_first: bool) -> tuple:
    res = None if residual is None else (residual.shape, residual.stride(), residual.dtype, residual.device)
    w = None if weight is None else (weight.shape, weight.stride(), weight.dtype, weight.device)
    return input.shape, input.stride(), input.dtype, input.device, res, w, bool(cast_first)


def entries(forward: Forward, backward: Backward) -> tuple[Callable[..., torch.Tensor], Callable[..., tuple]]:
    """``(rms_norm, add_rms_norm)`` implementations around a kernel's ``forward`` and ``backward``.

    Each checks a layout once (:func:`reason`, :func:`layout`, cached per
    layout); per call it allocates the outputs and launches, through
    :func:`flaggems.autograd.apply` when a gradient is needed.
    """
    layouts: dict[tuple, Layout] = context.cache()  # emptied with the kernel context

    def plan(input: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
             cast_first: bool) -> Layout:
        key = _key(input, residual, weight, cast_first)
        found = layouts.get(key)
        if found is None:
            why = reason(input, residual, weight)
            if why is not None:
                raise Decline(why)
            found = remember(layouts, key, layout(input, residual, weight, cast_first))
        return found

    def run(input: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float,
            offset: float, cast_first: bool, found: Layout, save_rstd: bool) -> tuple[torch.Tensor, ...]:
        y, total, rstd = allocate(input, found, save_rstd)
        forward(input, residual, weight, y, total, rstd, float(eps), float(offset), bool(cast_first))
        return tuple(t for t in (y, total, rstd) if t is not None)

    def rms_backward(grad: torch.Tensor, input: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor | None,
                     offset: float, cast_first: bool, needs: list[bool]) -> tuple[torch.Tensor | None, ...]:
        dx, dw = allocate_backward(input, weight, needs[0], needs[1])
        backward(grad, None, input, rstd, weight, dx, dw, float(offset), bool(cast_first))
        return dx, dw

    def rms_double(grad: torch.Tensor, input: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor | None,
                   offset: float, cast_first: bool, needs: list[bool], eps: float) -> tuple[torch.Tensor | None, ...]:
        return differentiable_backward((grad,), input, weight, eps, offset, cast_first, needs)

    def add_backward(grad: torch.Tensor, grad_sum: torch.Tensor, total: torch.Tensor, rstd: torch.Tensor,
                     weight: torch.Tensor | None, offset: float, cast_first: bool,
                     needs: list[bool]) -> tuple[torch.Tensor | None, ...]:
        dx, dw = allocate_backward(total, weight, needs[0] or needs[1], needs[2])
        backward(grad, grad_sum, total, rstd, weight, dx, dw, float(offset), bool(cast_first))
        return dx if needs[0] else None, dx if needs[1] else None, dw

    def add_double(grad: torch.Tensor, grad_sum: torch.Tensor, total: torch.Tensor, rstd: torch.Tensor,
                   weight: torch.Tensor | None, offset: float, cast_first: bool, needs: list[bool],
                   eps: float) -> tuple[torch.Tensor | None, ...]:
        dx, dw = differentiable_backward((grad, grad_sum), total, weight, eps, offset, cast_first,
                                         (needs[0] or needs[1], needs[2]))
        return dx if needs[0] else None, dx if needs[1] else None, dw

    rms_grad = autograd.Derivative(
        "flaggems::rms_norm_backward",
        "(Tensor grad, Tensor input, Tensor rstd, Tensor? weight, float weight_offset, bool cast_first, "
        "bool[2] needs) -> (Tensor, Tensor)",
        rms_backward, rms_double)
    add_grad = autograd.Derivative(
        "flaggems::add_rms_norm_backward",
        "(Tensor grad, Tensor grad_sum, Tensor sum, Tensor rstd, Tensor? weight, float weight_offset, "
        "bool cast_first, bool[3] needs) -> (Tensor, Tensor, Tensor)",
        add_backward, add_double)

    def rms_norm(input: torch.Tensor, weight: torch.Tensor | None, eps: float, weight_offset: float = 0.0,
                 cast_first: bool = True) -> torch.Tensor:
        """``flaggems::rms_norm``: the normalised input (see :mod:`flaggems.fronts.rms_norm`)."""
        found = plan(input, None, weight, cast_first)
        if needs_grad(input, None, weight):
            return autograd.apply(
                rms_grad, lambda: run(input, None, weight, eps, weight_offset, cast_first, found, True),
                outputs=1, differentiable=(input, weight),
                args=(autograd.Grad(0), input, autograd.Result(1), weight, float(weight_offset), bool(cast_first),
                      autograd.NEEDS),
                extra=(float(eps),))
        return run(input, None, weight, eps, weight_offset, cast_first, found, False)[0]

    def add_rms_norm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
                     weight_offset: float = 0.0, cast_first: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """``flaggems::add_rms_norm``: ``(normed, input + residual)`` in one pass over both inputs."""
        found = plan(input, residual, weight, cast_first)
        if needs_grad(input, residual, weight):
            return autograd.apply(
                add_grad, lambda: run(input, residual, weight, eps, weight_offset, cast_first, found, True),
                outputs=2, differentiable=(input, residual, weight),
                args=(autograd.Grad(0), autograd.Grad(1), autograd.Result(1), autograd.Result(2), weight,
                      float(weight_offset), bool(cast_first), autograd.NEEDS),
                extra=(float(eps),))
        return run(input, residual, weight, eps, weight_offset, cast_first, found, False)

    return rms_norm, add_rms_norm
