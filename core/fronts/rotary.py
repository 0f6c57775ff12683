"""``flaggems::rotary_embedding``: the reference's semantics (:mod:`flaggems.ops`), for any kernel.

The op rotates ``q`` and ``k`` by the angles of ``cos``/``sin`` (unsqueezed at
``unsqueeze_dim``): ``x * cos + rotate(x) * sin``, ``rotate`` being Llama's
rotate-half or, ``interleaved``, GPT-J's rotation of each pair. The front owns
what every implementation must agree on with the reference:

* what a kernel serves (:func:`reason`, :func:`sides`): ``q``, ``k``, ``cos``
  and ``sin`` of one dtype of :data:`DTYPES` (the reference promotes mixed
  dtypes) on one device, strided, non-empty; ``q``/``k`` of rank 1 to 4 with
  one even head dimension ``D``; ``cos`` and ``sin`` of one shape and layout
  whose unsqueezed shape broadcasts to ``q``'s and ``k``'s without growing
  them, with last dimension ``D`` (partial rotary is out of scope). Everything
  else declines: the reference then computes the result or raises its own error;
* the outputs' layouts: those the reference returns (:func:`output_strides`,
  TensorIterator's rules reproduced from metadata, once per layout): a
  transposed ``[B, H, S, D]`` view of ``[B, S, H*D]`` gives an output laid out
  like ``q``, but a size-1 dimension may get another stride than ``q``'s
  (decode: ``empty_like(q)`` would differ);
* autograd: with grad mode on and ``q`` or ``k`` requiring grad, the outputs
  come from :func:`flaggems.autograd.apply` with a ``Derivative`` built by
  :func:`entry` around the implementation's kernel: the rotation is
  orthogonal, ``dx = dy * cos + rotate^T(dy * sin)`` with ``rotate^T =
  -rotate``, so the backward is the same kernel run as the inverse rotation,
  ``dq`` and ``dk`` in one launch, laid out like the forward outputs (a
  transposed ``q`` gets a transposed ``dq``: its view's backward then needs
  no copy). ``cos``/``sin`` that require grad decline (the reference's
  autograd differentiates them); so do forward-mode AD and functorch
  transforms. Under ``create_graph=True`` the backward is the reference's own
  derivative (:func:`differentiable_backward`).

A kernel provides two functions (see :func:`entry`): ``prepare(sides, dtype,
interleaved, inverse)``, from metadata only, cached here per layout, and
``launch(prepared, xs, cos, sin, outs)``, which launches it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import autograd
from ..chain import Decline
from ..toolkit import context
from ..toolkit.iterator_layout import contiguous_strides, iterator_strides, layout_code, strides_of_code
from ..toolkit.layout import remember
from .group_norm import transformed

#: Dtypes the kernels rotate in (fp32 math, one rounding).
DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
#: Highest rank of ``q``/``k`` served (transformers passes rank 4).
MAX_RANK = 4


@dataclass(frozen=True)
class Side:
    """The geometry of one rotated tensor (``q``, ``k`` or one of their gradients), metadata only.

    Attributes:
        shape: the tensor's shape (its last dimension is the head dimension ``D``).
        strides: the tensor's strides.
        angles: the strides at which ``cos`` and ``sin`` are read in that shape (0 where they broadcast).
        out_strides: the strides of the result, allocated by the front.
    """

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    angles: tuple[int, ...]
    out_strides: tuple[int, ...]


@dataclass(frozen=True)
class Plan:
    """A validated layout: both sides, and the kernel's own launch description (``prepare``'s answer)."""

    sides: tuple[Side, ...]
    prepared: Any

    @functools.cached_property
    def layouts(self) -> tuple[list[int], ...]:
        """Each side's output layout as a size-free code (the backward's ``q_layout``, ``k_layout``)."""
        return tuple(layout_code(side.shape, side.out_strides) for side in self.sides)


def _unsqueezed(cos: torch.Tensor, unsqueeze_dim: int) -> tuple[list[int], list[int]] | None:
    """``cos.unsqueeze(unsqueeze_dim)``'s sizes and strides (as torch's), or ``None`` where ``unsqueeze`` raises."""
    rank = cos.dim() + 1
    if not -rank <= unsqueeze_dim < rank:
        return None
    return _torch_unsqueeze(list(cos.shape), list(cos.stride()), unsqueeze_dim + rank if unsqueeze_dim < 0
                            else unsqueeze_dim)


def angle_strides(shape: Sequence[int], sizes: Sequence[int], strides: Sequence[int]) -> tuple[int, ...] | None:
    """Strides of the unsqueezed ``cos`` (``sizes``, ``strides``) broadcast to ``shape``, 0 where it broadcasts.

    ``None`` where the broadcast would not give ``shape`` (the reference's result would be larger, or it
    raises) or where ``cos``'s last dimension is not the head dimension.
    """
    if len(sizes) > len(shape) or sizes[-1] != shape[-1]:
        return None
    lead = len(shape) - len(sizes)
    out = [0] * lead
    for n, size, stride in zip(shape[lead:], sizes, strides, strict=True):
        if size == n and n != 1:
            out.append(stride)
        elif size == 1:
            out.append(0)
        else:
            return None
    return tuple(out)


def reason(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           dtypes: frozenset[torch.dtype] = DTYPES) -> str | None:
    """Why a call declines (``None`` when a kernel serves it); reads metadata only."""
    tensors = (q, k, cos, sin)
    if q.dtype not in dtypes:
        return f"dtype {q.dtype}"
    if any(t.dtype != q.dtype for t in tensors):
        return "mixed dtypes (the reference promotes)"
    if any(t.device != q.device for t in tensors):
        return "tensors on different devices"
    if any(t.layout != torch.strided for t in tensors):
        return "non-strided layout"
    if not (1 <= q.dim() <= MAX_RANK and 1 <= k.dim() <= MAX_RANK):
        return f"q/k of rank {q.dim()}/{k.dim()} (1 to {MAX_RANK} served)"
    D = q.shape[-1]
    if k.shape[-1] != D or D % 2:
        return f"head dimensions {D} and {k.shape[-1]} (one even head dimension served)"
    if q.numel() == 0 or k.numel() == 0:
        return "empty input"
    if cos.shape != sin.shape or cos.stride() != sin.stride():
        return "cos and sin of different shapes or layouts"
    return None


# --------------------------------------------------------------------------- the reference's output layout
# The reference's result is ``add(mul(x, cos), mul(rotate(x), sin))``: each op is a TensorIterator, whose
# output layout :mod:`flaggems.toolkit.iterator_layout` reproduces.
def _channels_last_like(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """torch's ``is_strides_like_channels_last`` (rank 4) / ``_3d`` (rank 5): ``suggest_memory_format``'s test."""
    order = {4: (1, 3, 2, 0), 5: (1, 4, 3, 2, 0)}.get(len(sizes))
    if order is None or strides[1] == 0:
        return False
    least = 0
    for d in order:
        if sizes[d] == 0 or strides[d] < least or (d == 0 and least == strides[1]):
            return False
        least = strides[d] * (sizes[d] if sizes[d] > 1 else 1)
    return True


def _torch_unsqueeze(sizes: Sequence[int], strides: Sequence[int], dim: int) -> tuple[list[int], list[int]]:
    """``unsqueeze(dim)``'s geometry as torch computes it (the new dimension's stride included)."""
    new = strides[dim] * sizes[dim] if dim < len(sizes) else 1
    return [*sizes[:dim], 1, *sizes[dim:]], [*strides[:dim], new, *strides[dim:]]


def output_strides(x: torch.Tensor, angles: tuple[list[int], list[int]], interleaved: bool) -> tuple[int, ...] | None:
    """The strides of the reference's ``x * cos + rotate(x) * sin`` (``angles``: the unsqueezed ``cos``'s
    geometry, as torch's ``unsqueeze`` gives it), or ``None`` where ``rotate``'s ``cat`` would keep a
    channels_last layout (not reproduced here: declined)."""
    shape, strides = list(x.shape), list(x.stride())
    half = shape[-1] // 2
    if interleaved:  # stack((-x[..., 1::2], x[..., ::2]), -1): cat of unsqueezed columns
        column = _torch_unsqueeze(shape[:-1] + [half], strides[:-1] + [2 * strides[-1]], len(shape))
    else:  # cat((-x[..., half:], x[..., :half]), -1)
        column = (shape[:-1] + [half], strides)
    if _channels_last_like(*column):
        return None
    product = iterator_strides(shape, [(shape, strides), angles])
    rotated = iterator_strides(shape, [(shape, contiguous_strides(shape)), angles])
    return tuple(iterator_strides(shape, [(shape, product), (shape, rotated)]))


def sides(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int,
          interleaved: bool, dtypes: frozenset[torch.dtype] = DTYPES) -> tuple[Side, Side]:
    """The geometry of both sides of a call a kernel serves; ``Decline`` otherwise (:func:`reason`)."""
    why = reason(q, k, cos, sin, dtypes)
    if why is not None:
        raise Decline(why)
    unsqueezed = _unsqueezed(cos, unsqueeze_dim)
    if unsqueezed is None:
        raise Decline(f"unsqueeze_dim={unsqueeze_dim} out of range (the reference raises)")
    angles = [angle_strides(x.shape, *unsqueezed) for x in (q, k)]
    if angles[0] is None or angles[1] is None:
        raise Decline("cos/sin do not broadcast to q and k (or their last dimension is not the head dimension)")
    outs = [output_strides(x, unsqueezed, interleaved) for x in (q, k)]
    if outs[0] is None or outs[1] is None:
        raise Decline("rotate(x) of this layout is channels_last-like: the reference's layout is not reproduced")
    return (Side(tuple(q.shape), tuple(q.stride()), angles[0], outs[0]),
            Side(tuple(k.shape), tuple(k.stride()), angles[1], outs[1]))


def needs_grad(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the call must record a graph (grad mode on, ``q`` or ``k`` requires grad).

    ``Decline`` where the reference's autograd must keep the call: ``cos`` or
    ``sin`` requiring grad, forward-mode AD, functorch transforms.
    """
    if transformed():
        raise Decline("forward-mode AD or a functorch transform")
    if not torch.is_grad_enabled():
        return False
    if cos.requires_grad or sin.requires_grad:
        raise Decline("cos/sin require grad: the reference's autograd differentiates them")
    return q.requires_grad or k.requires_grad


def allocate(like: torch.Tensor, side: Side) -> torch.Tensor:
    """The uninitialised result of one side (``like``'s dtype and device, ``side.out_strides``)."""
    return torch.empty_strided(side.shape, side.out_strides, dtype=like.dtype, device=like.device)


def differentiable_backward(grad_q: torch.Tensor | None, grad_k: torch.Tensor | None, cos: torch.Tensor,
                            sin: torch.Tensor, unsqueeze_dim: int, interleaved: bool, q_layout: list[int],
                            k_layout: list[int], needs: list[bool]) -> tuple[torch.Tensor | None, ...]:
    """Under ``create_graph``: the reference's derivative, recorded (differentiable again).

    The rotation is linear, so its derivative does not read ``q``/``k``: the
    reference runs on zeros of their shapes (the forward saves nothing for
    this rare path). An undefined incoming gradient (zero) gives none.
    """
    from .. import ops

    result: list[torch.Tensor | None] = [None, None]
    with torch.enable_grad():
        for i, g in enumerate((grad_q, grad_k)):
            if g is None or not needs[i]:
                continue
            x = torch.zeros_like(g, requires_grad=True)
            out = ops.rotary_embedding(x, x, cos, sin, unsqueeze_dim, interleaved)[0]
            result[i] = torch.autograd.grad(out, x, g, create_graph=True)[0]
    return tuple(result)


Prepare = Callable[[tuple[Side, ...], torch.dtype, bool, bool], Any]
Launch = Callable[[Any, tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]], None]


def _key(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int,
         interleaved: bool) -> tuple:
    return (q.shape, q.stride(), k.shape, k.stride(), cos.shape, cos.stride(), sin.shape, sin.stride(), q.dtype,
            k.dtype,
            cos.dtype, sin.dtype, q.device, k.device, cos.device, sin.device, unsqueeze_dim, interleaved,
            q.layout, k.layout, cos.layout, sin.layout)


def entry(prepare: Prepare, launch: Launch, dtypes: frozenset[torch.dtype] = DTYPES,
          name: str = "flaggems::rotary_embedding") -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The ``flaggems::rotary_embedding`` implementation around one kernel.

    ``prepare(sides, dtype, interleaved, inverse)`` describes the launch from
    metadata (called once per layout; it may ``Decline``, forward only);
    ``launch(prepared, xs, cos, sin, outs)`` writes ``outs[i]`` from ``xs[i]``
    (one tensor per side, 1 or 2 sides): the rotation, or with ``inverse``
    its transpose. Plans (checks, output layouts, the kernel's description)
    are cached per layout: a repeated call looks one up, allocates and launches.
    """
    forward_plans: dict[tuple, Plan] = context.cache()  # emptied with the kernel context (tuning, facts)
    backward_plans: dict[tuple, Plan] = context.cache()  # emptied with the kernel context (tuning, facts)

    def forward_plan(q, k, cos, sin, unsqueeze_dim, interleaved) -> Plan:
        key = _key(q, k, cos, sin, unsqueeze_dim, interleaved)
        plan = forward_plans.get(key)
        if plan is None:
            found = sides(q, k, cos, sin, unsqueeze_dim, interleaved, dtypes)
            plan = remember(forward_plans, key, Plan(found, prepare(found, q.dtype, interleaved, False)))
        return plan

    def backward(grad_q: torch.Tensor | None, grad_k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                 unsqueeze_dim: int, interleaved: bool, q_layout: list[int], k_layout: list[int],
                 needs: list[bool]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(dq, dk)``: the inverse rotation of the incoming gradients, in one launch (never declines), laid out
        as the forward's outputs (``*_layout``: :func:`~flaggems.toolkit.iterator_layout.layout_code`)."""
        grads = tuple(g if need else None for g, need in zip((grad_q, grad_k), needs, strict=True))
        present = [g for g in grads if g is not None]
        if not present:
            return None, None
        key = (tuple((g.shape, g.stride(), g.dtype) if g is not None else None for g in grads), cos.shape,
               cos.stride(), unsqueeze_dim, interleaved, tuple(q_layout), tuple(k_layout))
        plan = backward_plans.get(key)
        if plan is None:
            plan = remember(backward_plans, key, _backward_plan(prepare, grads, cos, unsqueeze_dim, interleaved,
                                                                (q_layout, k_layout)))
        outs = tuple(allocate(g, side) for g, side in zip(present, plan.sides, strict=True))
        launch(plan.prepared, tuple(present), cos, sin, outs)
        found = iter(outs)
        return tuple(None if g is None else next(found) for g in grads)

    # The outputs' layouts travel as size-free codes (a dense order): one autograd node and one backward layout
    # class serve every sequence length (with the strides themselves every length missed both).
    derivative = autograd.Derivative(
        f"{name}_backward",
        "(Tensor? grad_q, Tensor? grad_k, Tensor cos, Tensor sin, int unsqueeze_dim, bool interleaved, "
        "int[] q_layout, int[] k_layout, bool[2] needs) -> (Tensor, Tensor)",
        backward, differentiable_backward)

    def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         unsqueeze_dim: int = 1, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``flaggems::rotary_embedding``: ``(q_rot, k_rot)`` in one launch, recording our backward if needed."""
        plan = forward_plan(q, k, cos, sin, unsqueeze_dim, interleaved)
        grad = needs_grad(q, k, cos, sin)

        def run() -> tuple[torch.Tensor, torch.Tensor]:
            outs = (allocate(q, plan.sides[0]), allocate(k, plan.sides[1]))
            launch(plan.prepared, (q, k), cos, sin, outs)
            return outs

        if not grad:
            return run()
        return autograd.apply(derivative, run, outputs=2, differentiable=(q, k),
                              args=(autograd.Grad(0), autograd.Grad(1), cos, sin, unsqueeze_dim, interleaved,
                                    plan.layouts[0], plan.layouts[1], autograd.NEEDS))

    return rotary_embedding


def _backward_plan(prepare: Prepare, grads: tuple[torch.Tensor | None, ...], cos: torch.Tensor, unsqueeze_dim: int,
                   interleaved: bool, layouts: tuple[Sequence[int], Sequence[int]]) -> Plan:
    """The backward's geometry: each gradient read where it is, written in its forward output's layout
    (``layouts``: their codes)."""
    unsqueezed = _unsqueezed(cos, unsqueeze_dim)
    found = []
    for g, code in zip(grads, layouts, strict=True):
        if g is None:
            continue
        angles = angle_strides(g.shape, *unsqueezed)  # the forward checked that these broadcast
        found.append(Side(tuple(g.shape), tuple(g.stride()), angles, strides_of_code(g.shape, code)))
    found = tuple(found)
    return Plan(found, prepare(found, grads[0].dtype if grads[0] is not None else grads[1].dtype, interleaved, True))
