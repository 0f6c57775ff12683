"""``flaggems::rotary_cache_append``: the reference's semantics (:mod:`flaggems.ops`), for any kernel.

The op is a decoder attention's rotary embedding and its ``DynamicCache``
append: ``q`` and ``k`` rotated as :mod:`flaggems.fronts.rotary` rotates them
(rotate-half), the rotated ``k`` appended to ``keys`` and ``v`` to ``values``
along dimension -2 (``torch.cat``). The front owns what every implementation
must agree on with the reference:

* what a kernel serves (:func:`reason`, :func:`geometry`): what rotary serves
  for ``q``, ``k``, ``cos``, ``sin``, with ``v``, ``keys`` and ``values`` of the
  same dtype and device, every tensor of rank 4, ``v`` shaped as ``k``,
  ``values`` as ``keys``, and ``keys`` the same ``[B, Hk, ., D]`` as ``k`` with
  at least one position (DynamicLayer's first call passes a 1-D empty tensor:
  the reference's ``cat`` serves it); no operand of the ``cat`` laid out
  channels_last-like (torch's ``cat`` would keep that format); no input that
  requires grad under grad mode (the reference's autograd records it),
  forward-mode AD or a functorch transform. Everything else declines;
* the outputs' layouts: ``q_rot`` as the reference lays it out (rotary's
  :func:`~flaggems.fronts.rotary.output_strides`), ``keys'`` and ``values'``
  contiguous, as ``cat`` of operands without a channels_last format gives them.

A kernel provides ``prepare(plan)`` (from metadata only, cached here per
layout) and ``launch(prepared, tensors, outs)``, ``tensors`` being ``(q, k, v,
cos, sin, keys, values)`` and ``outs`` ``(q_rot, keys', values')``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..chain import Decline
from ..toolkit import context
from ..toolkit.iterator_layout import contiguous_strides
from ..toolkit.layout import remember
from . import rotary
from .group_norm import transformed

#: Dtypes the kernels serve (fp32 rotation, one rounding; the appends are copies).
DTYPES = rotary.DTYPES


@dataclass(frozen=True)
class Plan:
    """A validated layout: what the kernel writes where, and its own launch description.

    Attributes:
        q: ``q``'s rotation into ``q_rot`` (:class:`~flaggems.fronts.rotary.Side`).
        k: ``k``'s rotation into ``keys'`` from position ``offset`` on (its ``out_strides``: ``keys'``'s).
        copies: ``keys`` into ``keys'``, ``values`` into ``values'`` (both at position 0) and ``v`` into
            ``values'`` at position ``offset`` (sides whose ``angles`` are unused).
        offset: the cache length ``L`` before the call, where the appended positions start.
        cache_shape: the shape of ``keys'`` and ``values'`` (``[B, Hk, L + S, D]``).
        prepared: the kernel's description (``prepare``'s answer).
    """

    q: rotary.Side
    k: rotary.Side
    copies: tuple[rotary.Side, rotary.Side, rotary.Side]
    offset: int
    cache_shape: tuple[int, ...]
    prepared: Any = None


def reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           keys: torch.Tensor, values: torch.Tensor, dtypes: frozenset[torch.dtype] = DTYPES) -> str | None:
    """Why a call declines (``None`` when a kernel serves it); reads metadata only."""
    why = rotary.reason(q, k, cos, sin, dtypes)
    if why is not None:
        return why
    appended = (v, keys, values)
    if any(t.dtype != q.dtype for t in appended):
        return "mixed dtypes (the reference's cat promotes)"
    if any(t.device != q.device for t in appended):
        return "tensors on different devices"
    if any(t.layout != torch.strided for t in appended):
        return "non-strided layout"
    if any(t.dim() != 4 for t in (q, k, v, keys, values)):
        return "q, k, v, keys or values not of rank 4"
    if v.shape != k.shape or values.shape != keys.shape:
        return "v not shaped as k, or values not as keys"
    if keys.shape[:2] != k.shape[:2] or keys.shape[3] != k.shape[3]:
        return "keys and k differ in batch, heads or head dimension (the reference's cat raises)"
    if keys.numel() == 0:
        return "empty cache (the reference's cat serves the first call)"
    return None


def geometry(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             keys: torch.Tensor, values: torch.Tensor, unsqueeze_dim: int,
             dtypes: frozenset[torch.dtype] = DTYPES) -> Plan:
    """The geometry of a call a kernel serves (``prepared`` left empty); ``Decline`` otherwise."""
    why = reason(q, k, v, cos, sin, keys, values, dtypes)
    if why is not None:
        raise Decline(why)
    q_side, k_side = rotary.sides(q, k, cos, sin, unsqueeze_dim, False, dtypes)
    cat_operands = ((tuple(keys.shape), keys.stride()), (k_side.shape, k_side.out_strides),
                    (tuple(values.shape), values.stride()), (tuple(v.shape), v.stride()))
    if any(rotary._channels_last_like(shape, strides) for shape, strides in cat_operands):
        raise Decline("an operand of the cache's cat is channels_last-like: the reference's layout is not reproduced")
    length = keys.shape[2]
    cache_shape = (*keys.shape[:2], length + k.shape[2], keys.shape[3])
    cache_strides = tuple(contiguous_strides(list(cache_shape)))
    k_side = rotary.Side(k_side.shape, k_side.strides, k_side.angles, cache_strides)
    copies = tuple(rotary.Side(tuple(t.shape), tuple(t.stride()), (0,) * 4, cache_strides)  # angles unused
                   for t in (keys, values, v))
    return Plan(q_side, k_side, copies, length, cache_shape)


def needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether the reference's autograd must record the call (``Decline`` then); ``False`` otherwise."""
    if transformed():
        raise Decline("forward-mode AD or a functorch transform")
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise Decline("an input requires grad: the reference's autograd records the call")
    return False


Prepare = Callable[[Plan], Any]
Launch = Callable[[Any, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]], None]


def _key(tensors: tuple[torch.Tensor, ...], unsqueeze_dim: int) -> tuple:
    return (tuple((t.shape, t.stride(), t.dtype, t.device, t.layout) for t in tensors), unsqueeze_dim)


def entry(prepare: Prepare, launch: Launch, dtypes: frozenset[torch.dtype] = DTYPES
          ) -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The ``flaggems::rotary_cache_append`` implementation around one kernel (plans cached per layout)."""
    plans: dict[tuple, Plan] = context.cache()  # emptied with the kernel context (tuning, facts)

    def rotary_cache_append(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                            unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``flaggems::rotary_cache_append``: ``(q_rot, keys', values')`` in one launch."""
        tensors = (q, k, v, cos, sin, keys, values)
        key = _key(tensors, unsqueeze_dim)
        plan = plans.get(key)
        if plan is None:
            found = geometry(*tensors, unsqueeze_dim, dtypes)
            plan = remember(plans, key, dataclasses.replace(found, prepared=prepare(found)))
        needs_grad(*tensors)
        outs = (rotary.allocate(q, plan.q), torch.empty(plan.cache_shape, dtype=q.dtype, device=q.device),
                torch.empty(plan.cache_shape, dtype=q.dtype, device=q.device))
        launch(plan.prepared, tensors, outs)
        return outs

    return rotary_cache_append
