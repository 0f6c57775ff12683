"""``aten::unfold`` (a view) and ``aten::unfold_backward``: torch's semantics, for any kernel.

:func:`unfold` is the whole view op: torch's sizes and strides over the
input's storage (``as_strided``, same storage offset; no kernel), 0-dim
inputs, ``size == dim size`` and ``step > size`` included, torch's error
types and messages. A backend whose torch lacks the view registers it as is.

``unfold_backward`` writes ``grad_input`` (contiguous, ``grad``'s dtype, as
torch) from the windows of ``grad``. What every kernel needs:

* :func:`check_backward`, per call: ``step > 0`` (ValueError otherwise), and
  ``Decline`` for a ``grad`` dtype outside the kernel's set, a non-strided
  layout or a negative view bit;
* :func:`backward_geometry`, per geometry (cacheable: it reads shapes only):
  ``dim`` wrapped (torch's IndexError), ``Decline`` for a 0-dim input, a
  window size outside ``[0, input size]`` and a ``grad`` whose shape is not the
  one :func:`unfold` gives (torch's own lenient kernel then answers);
* :func:`allocate_grad_input`: the contiguous result, zero-filled when no
  window holds an element (then no kernel runs).

:func:`entries` chains them around a kernel ``backward(call)`` that sums, into
each element of ``call.out``, the windows of ``call.grad`` that contain it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..chain import Decline
from ..toolkit import context

#: Dtypes the shared ``unfold_backward`` kernel sums (a vendor passes its own set).
BACKWARD_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def wrap_dim(dim: int, ndim: int, wrap_scalar: bool = True) -> int:
    """torch's ``maybe_wrap_dim``: same range, same IndexError message."""
    if ndim <= 0:
        if not wrap_scalar:
            raise IndexError(f"dimension specified as {dim} but tensor has no dimensions")
        ndim = 1
    low, high = -ndim, ndim - 1
    if not low <= dim <= high:
        raise IndexError(f"Dimension out of range (expected to be in range of [{low}, {high}], but got {dim})")
    return dim + ndim if dim < 0 else dim


def unfold(self: torch.Tensor, dimension: int, size: int, step: int) -> torch.Tensor:
    """``aten::unfold``: windows of ``size`` every ``step`` along ``dimension``, as a view."""
    ndim = self.dim()
    dim = wrap_dim(dimension, ndim)
    sizes, strides = list(self.shape), list(self.stride())
    max_size = 1 if ndim == 0 else sizes[dim]
    if size > max_size:
        raise RuntimeError(f"maximum size for tensor at dimension {dim} is {max_size} but size is {size}")
    if size < 0:
        raise RuntimeError(f"size is {size} but must be >= 0")
    if step <= 0:
        raise RuntimeError(f"step is {step} but must be > 0")
    sizes.append(size)
    strides.append(1 if ndim == 0 else strides[dim])
    if dim < ndim:
        sizes[dim] = (sizes[dim] - size) // step + 1
        strides[dim] *= step
    return self.as_strided(sizes, strides)


@dataclass(frozen=True)
class BackwardGeometry:
    """One validated ``unfold_backward`` geometry.

    Attributes:
        sizes: ``grad_input``'s sizes (the input's, as ints).
        dim: wrapped, in ``[0, len(sizes))``.
        empty: ``grad_input`` or ``grad`` has no element: nothing to gather (the result is zeros).
    """

    sizes: tuple[int, ...]
    dim: int
    empty: bool


# Built per call: slotted, not frozen (0.2 µs against 1 µs on the CI host); kernels treat it as read-only.
@dataclass(slots=True)
class BackwardCall:
    """One validated ``unfold_backward`` for a kernel: ``out`` gets the window sums of ``grad``.

    Attributes:
        grad: ``[*sizes[:dim], windows, *sizes[dim + 1:], size]``, any strides, not empty.
        dim: wrapped.
        size: window size.
        step: window step (> 0).
        out: the fresh contiguous ``grad_input`` (``grad``'s dtype), uninitialised, not empty.
    """

    grad: torch.Tensor
    dim: int
    size: int
    step: int
    out: torch.Tensor


def check_backward(grad: torch.Tensor, step: int, dtypes: frozenset[torch.dtype] = BACKWARD_DTYPES) -> None:
    """The per-call checks: ValueError for ``step <= 0``, ``Decline`` for ``grad``'s dtype, layout or neg bit."""
    if step <= 0:
        raise ValueError(f"step is {step} but must be > 0")
    if grad.dtype not in dtypes or grad.layout != torch.strided or grad.is_neg():
        raise Decline(f"dtype {grad.dtype} or layout")


def backward_geometry(grad: torch.Tensor, input_sizes: Sequence[int], dim: int, size: int,
                      step: int) -> BackwardGeometry:
    """The geometry of one call, or ``Decline`` where torch's kernel must decide (see the module docstring)."""
    sizes = tuple(int(s) for s in input_sizes)
    ndim = len(sizes)
    dim = wrap_dim(dim, ndim)
    if ndim == 0:
        raise Decline("0-dim input")
    if size < 0 or size > sizes[dim]:
        raise Decline("size outside [0, input size] (torch's kernel decides)")
    expected = [*sizes[:dim], (sizes[dim] - size) // step + 1, *sizes[dim + 1:], size]
    if list(grad.shape) != expected:
        raise Decline(f"grad shape {list(grad.shape)} is not unfold's {expected}")
    return BackwardGeometry(sizes, dim, math.prod(sizes) == 0 or grad.numel() == 0)


def allocate_grad_input(grad: torch.Tensor, geometry: BackwardGeometry) -> torch.Tensor:
    """``grad_input`` as torch allocates it: contiguous, ``grad``'s dtype; zeros when ``geometry.empty``."""
    out = torch.empty(geometry.sizes, dtype=grad.dtype, device=grad.device)
    return out.zero_() if geometry.empty and out.numel() else out


#: Geometries an :func:`entries` implementation keeps before starting afresh.
GEOMETRY_CACHE_SIZE = 1024


def entries(backward: Callable[[BackwardCall], None], dtypes: frozenset[torch.dtype] = BACKWARD_DTYPES,
            ) -> Callable[..., torch.Tensor]:
    """The ``unfold_backward`` aten implementation around ``backward(call)``.

    ``backward`` fills every element of ``call.out`` (called only when there
    is something to sum); it may raise ``Decline`` before writing anything.
    Geometries are validated once and cached.
    """
    geometries: dict[tuple, BackwardGeometry] = context.cache()  # emptied with the kernel context

    def unfold_backward(grad_in: torch.Tensor, input_sizes: Sequence[int], dim: int, size: int,
                        step: int) -> torch.Tensor:
        """``aten::unfold_backward``: the gradient of ``unfold(dim, size, step)`` for an input of ``input_sizes``."""
        check_backward(grad_in, step, dtypes)
        key = (grad_in.shape, tuple(input_sizes), dim, size, step)
        geometry = geometries.get(key)
        if geometry is None:
            if len(geometries) >= GEOMETRY_CACHE_SIZE:
                geometries.clear()
            geometry = geometries[key] = backward_geometry(grad_in, input_sizes, dim, size, step)
        out = allocate_grad_input(grad_in, geometry)
        if not geometry.empty:
            backward(BackwardCall(grad_in, geometry.dim, size, step, out))
        return out

    return unfold_backward
