"""``aten::native_group_norm``, its backward and ``aten::group_norm``: torch's semantics, for any kernel.

The front owns what every group-norm implementation must agree on with torch:

* the arguments torch accepts: ``check_group_norm_inputs``'s shape errors are
  raised here as torch raises them (``RuntimeError``, torch's messages); every
  other call torch rejects (``X.numel() != N*C*HxW``, dtypes or devices that
  do not match, mixed dtypes outside the CPU's half-input/fp32-affine case,
  an input not dense in its suggested memory format, a ``dY`` of another
  size, a ``mean``/``rstd`` that is not a contiguous ``[N, group]``,
  ``dweight``/``dbias`` asked without a weight) declines with ``Decline``, so
  that the native kernel raises torch's own error; so does what no kernel
  here computes (empty input, dtypes outside the implementation's set,
  negative or conjugate views, non-strided layouts);
* the statistics' dtype (the input's, or fp32 for a half input with fp32
  affine parameters on CPU) and the outputs' layouts: ``y`` in the input's
  suggested memory format, ``dx`` as torch's kernel lays it out (the
  suggested format on CPU, contiguous elsewhere, the input's own strides
  where it already is so), ``mean``/``rstd`` ``[N, group]`` contiguous,
  ``dweight``/``dbias`` vectors of ``C`` in the weight's dtype, each gradient
  only where ``output_mask`` asks for it;
* for the composite ``aten::group_norm``: the arguments its composite
  rejects, the calls it must keep (forward-mode AD, functorch transforms, a
  bias that needs a gradient without a weight) and whether it would copy the
  input first.

A vendor with its own group-norm kernels writes only the kernels::

    from flaggems.fronts import group_norm

    def forward(call: group_norm.ForwardCall) -> None: ...    # fills call.y, call.mean, call.rstd
    def backward(call: group_norm.BackwardCall) -> None: ...  # fills call.dx / dweight / dbias (not None)

    native_group_norm, native_group_norm_backward = group_norm.entries(forward, backward, dtypes=...)
    group_norm_fwd = group_norm.group_norm_entry(forward, dtypes=...)  # aten::group_norm without a graph

An implementation that caches a plan per call layout (as the generic one
does) calls the pieces instead of :func:`prepare_forward` /
:func:`prepare_backward`: the checks (:func:`check_forward`,
:func:`check_backward`) once per plan, since everything they read is part of
the plan's key, and per call only the allocations (:func:`allocate_forward`,
:func:`allocate_backward`: plain ``torch.empty``/``torch.empty_like``, which
the compiled entry records and replays) and the per-call parts of the
backward's contract (:func:`backward_mask`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.autograd import forward_ad

from ..chain import Decline

#: Dtypes torch's group norm computes in (a vendor passes its own, narrower set).
DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
#: Input dtypes that take fp32 affine parameters (and fp32 statistics) on CPU.
HALF_DTYPES = frozenset({torch.float16, torch.bfloat16})

Mask = tuple[bool, bool, bool]


# --------------------------------------------------------------------------- layouts and dtypes
def suggest_memory_format(t: torch.Tensor) -> torch.memory_format:
    """torch's ``Tensor::suggest_memory_format()`` (cheap for the unambiguous cases)."""
    if t.dim() not in (4, 5):
        return torch.contiguous_format
    last = torch.channels_last if t.dim() == 4 else torch.channels_last_3d
    dense, channels_last = t.is_contiguous(), t.is_contiguous(memory_format=last)
    if dense != channels_last and 1 not in t.shape:  # the flags ignore size-1 dimensions; torch's rule does not
        return torch.contiguous_format if dense else last
    return last if strides_like_channels_last(t.shape, t.stride()) else torch.contiguous_format


def strides_like_channels_last(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """torch's ``is_channels_last_strides_2d``/``_3d`` rule (c10 ``MemoryFormat.h``), which
    ``suggest_memory_format`` follows: dimensions in channels-last order (C, then W, H[, D], then N) with
    non-decreasing strides, each at least the last one times its size where that size is above 1. Written
    here because ``torch._prims_common``'s copy imports the symbolic-shapes machinery on first use (3.3 s
    in a kit process on the H200)."""
    if len(sizes) not in (4, 5) or strides[1] == 0:
        return False
    order = (1, 3, 2, 0) if len(sizes) == 4 else (1, 4, 3, 2, 0)
    smallest = 0
    for d in order:
        if sizes[d] == 0 or strides[d] < smallest:
            return False
        if d == 0 and smallest == strides[1]:  # N111: as contiguous as channels-last, torch keeps contiguous
            return False
        smallest = strides[d] * (sizes[d] if sizes[d] > 1 else 1)
    return True


def native_format(t: torch.Tensor) -> torch.memory_format:
    """The layout torch's kernels and composite work in: the suggested format on CPU, contiguous elsewhere.

    ``aten::group_norm``'s composite copies its input into it before
    ``native_group_norm``; ``native_group_norm_backward`` lays ``dx`` out in it.
    """
    return suggest_memory_format(t) if t.device.type == "cpu" else torch.contiguous_format


def stat_dtype(x: torch.Tensor, params: tuple[torch.Tensor | None, ...]) -> torch.dtype | None:
    """dtype of mean/rstd as torch picks it from ``x`` and ``params``, or ``None`` for a mix torch rejects.

    ``params`` are the affine parameters (forward) or ``mean``/``rstd`` (backward), ``None`` for an absent one.
    """
    defined = [p for p in params if p is not None]
    if all(p.dtype == x.dtype for p in defined):
        return x.dtype
    mixed = x.dtype in HALF_DTYPES and x.device.type == "cpu"  # elsewhere torch's kernels reject mixed dtypes
    if mixed and all(p.dtype == torch.float32 for p in defined):
        return torch.float32
    return None


# --------------------------------------------------------------------------- checks
def _sizes(t: torch.Tensor | None) -> list[int]:
    return [0] if t is None else list(t.shape)


def check_group_norm_inputs(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, C: int,
                            group: int) -> None:
    """torch's ``check_group_norm_inputs``: same checks, order and messages (``RuntimeError``)."""
    if group <= 0:
        raise RuntimeError(f"Expected num groups to be greater than 0, got {group}")
    if C % group != 0:
        raise RuntimeError("Expected number of channels in input to be divisible by num_groups, but got input "
                           f"of shape {_sizes(x)} and num_groups={group}")
    if weight is not None and (weight.dim() != 1 or weight.numel() != C):
        raise RuntimeError("Expected weight to be a vector of size equal to the number of channels in input, "
                           f"but got weight of shape {_sizes(weight)} and input of shape {_sizes(x)}")
    if bias is not None and (bias.dim() != 1 or bias.numel() != C):
        # torch prints the weight's shape here (an undefined weight prints [0]).
        raise RuntimeError("Expected bias to be a vector of size equal to the number of channels in input, "
                           f"but got bias of shape {_sizes(weight)} and input of shape {_sizes(x)}")


def _input_reason(x: torch.Tensor, N: int, C: int, HxW: int, dtypes: frozenset[torch.dtype]) -> str | None:
    if x.dtype not in dtypes:
        return f"dtype {x.dtype}"
    if x.layout != torch.strided or x.is_neg() or x.is_conj():
        return "non-strided layout or view bit"
    if x.numel() != N * C * HxW:
        return "X.numel() != N * C * HxW (torch raises)"
    if x.numel() == 0:
        return "empty input"
    return None


def forward_reason(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, N: int, C: int,
                   HxW: int, *, dense_only: bool = True, dtypes: frozenset[torch.dtype] = DTYPES) -> str | None:
    """Why a forward call declines (``None`` when it does not); the shape checks are :func:`check_group_norm_inputs`.

    ``dense_only`` (the aten op): an input not dense in its suggested memory
    format declines, torch's kernel raises for it; ``aten::group_norm``'s route
    passes ``False`` when its kernel reads any layout.
    """
    reason = _input_reason(input, N, C, HxW, dtypes)
    if reason:
        return reason
    for p in (weight, bias):
        if p is not None and p.device != input.device:
            return "affine parameter on another device (torch raises)"
    if stat_dtype(input, (weight, bias)) is None:
        return "affine dtype combination torch rejects"
    if dense_only and not input.is_contiguous(memory_format=suggest_memory_format(input)):
        return "input not dense in its memory format: torch's kernel raises for it"
    return None


def check_forward(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, N: int, C: int,
                  HxW: int, group: int, *, dense_only: bool = True,
                  dtypes: frozenset[torch.dtype] = DTYPES) -> torch.dtype:
    """Every check of a forward call; returns the statistics' dtype.

    Raises torch's ``RuntimeError`` for what :func:`check_group_norm_inputs`
    reports, ``Decline`` for every other call torch (or the implementation)
    rejects (:func:`forward_reason`). It reads only the arguments' metadata:
    shapes, strides, dtypes, devices, view bits, ``N, C, HxW, group``.
    """
    check_group_norm_inputs(input, weight, bias, C, group)
    reason = forward_reason(input, weight, bias, N, C, HxW, dense_only=dense_only, dtypes=dtypes)
    if reason is not None:
        raise Decline(reason)
    return stat_dtype(input, (weight, bias))


def allocate_forward(input: torch.Tensor, N: int, group: int, y_format: torch.memory_format,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, mean, rstd)`` uninitialised, as torch returns them.

    ``y_format`` is ``suggest_memory_format(input)`` and ``dtype`` the
    statistics' dtype :func:`check_forward` returned (a cached plan keeps both).
    """
    device = input.device
    return (torch.empty_like(input, memory_format=y_format),
            torch.empty((N, group), dtype=dtype, device=device),
            torch.empty((N, group), dtype=dtype, device=device))


def backward_mask(grad_out: torch.Tensor, input: torch.Tensor, output_mask: list[bool]) -> Mask:
    """``output_mask`` as three bools, after torch's first check (dY's dtype is X's, its ``RuntimeError``)."""
    if grad_out.dtype != input.dtype:
        raise RuntimeError("Expected scalar types of X and dY are same.")
    return bool(output_mask[0]), bool(output_mask[1]), bool(output_mask[2])


def backward_reason(grad_out: torch.Tensor, input: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                    weight: torch.Tensor | None, N: int, C: int, HxW: int, group: int, mask: Mask,
                    dtypes: frozenset[torch.dtype] = DTYPES) -> str | None:
    """Why a backward call declines (``None`` when it does not)."""
    reason = _input_reason(input, N, C, HxW, dtypes)
    if reason:
        return reason
    dy = grad_out
    if dy.numel() != input.numel() or dy.layout != torch.strided or dy.device != input.device or dy.is_neg():
        return "dY does not match X (torch raises)"
    if group <= 0 or C % group != 0:
        return f"C={C} not divisible by group={group}"
    if weight is None and (mask[1] or mask[2]):
        return "dweight/dbias asked without weight (torch raises)"
    dtype = stat_dtype(input, (mean, rstd))
    if dtype is None or dtype != mean.dtype:
        return "mean/rstd dtype combination torch rejects"
    for t in (mean, rstd):
        if t.numel() != N * group or not t.is_contiguous() or t.device != input.device:
            return "mean/rstd not contiguous [N, group] (torch raises)"
    if weight is not None and (weight.numel() != C or weight.dtype != dtype or weight.device != input.device):
        return "weight size or dtype torch rejects"
    return None


def check_backward(grad_out: torch.Tensor, input: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                   weight: torch.Tensor | None, N: int, C: int, HxW: int, group: int, mask: Mask,
                   dtypes: frozenset[torch.dtype] = DTYPES) -> None:
    """``Decline`` for a backward call torch (or the implementation) rejects (:func:`backward_reason`).

    ``mask`` comes from :func:`backward_mask`, which made torch's first check.
    Only metadata is read (shapes, strides, dtypes, devices, view bits).
    """
    reason = backward_reason(grad_out, input, mean, rstd, weight, N, C, HxW, group, mask, dtypes)
    if reason is not None:
        raise Decline(reason)


def dx_format(input: torch.Tensor, like_input: bool = False) -> tuple[bool, torch.memory_format]:
    """``(like_x, fmt)``: torch allocates ``dx`` like ``X.contiguous(fmt)``, X's own strides when it already is.

    ``fmt`` is :func:`native_format` (torch's kernels), or the suggested
    format on every device with ``like_input`` (``aten::group_norm``'s route:
    a channels_last input gets a channels_last gradient). ``like_x``: allocate
    ``dx`` with ``empty_like(input)`` (``input`` is dense in ``fmt``).
    """
    fmt = suggest_memory_format(input) if like_input else native_format(input)
    return input.is_contiguous(memory_format=fmt), fmt


def allocate_backward(input: torch.Tensor, weight: torch.Tensor | None, C: int, mask: Mask, like_x: bool,
                      fmt: torch.memory_format) -> tuple[torch.Tensor | None, torch.Tensor | None,
                                                         torch.Tensor | None]:
    """``(dx, dweight, dbias)`` uninitialised, each ``None`` where ``mask`` does not ask for it.

    ``like_x, fmt`` are :func:`dx_format`'s answer (a cached plan keeps it);
    ``dweight``/``dbias`` are vectors of ``C`` in the weight's dtype.
    """
    device = input.device
    dx = None
    if mask[0]:
        dx = torch.empty_like(input) if like_x else torch.empty_like(input, memory_format=fmt)
    dtype = input.dtype if weight is None else weight.dtype
    dw = torch.empty(C, dtype=dtype, device=device) if mask[1] else None
    db = torch.empty(C, dtype=dtype, device=device) if mask[2] else None
    return dx, dw, db


# --------------------------------------------------------------------------- calls and entries
@dataclass(frozen=True)
class ForwardCall:
    """One validated forward: ``y = (x - mean) * rstd * weight + bias`` per group of ``C / group`` channels.

    Attributes:
        input: ``N*C*HxW`` elements viewed as ``[N, C, HxW]``; dense in its
            suggested memory format unless the call came with ``dense_only=False``.
        weight, bias: vectors of ``C`` elements or ``None``; possibly strided (``randn(3C)[::3]``).
        N, C, HxW, group: as passed (``C % group == 0``).
        eps: added to the variance (biased, over ``C / group * HxW`` elements) before ``rsqrt``.
        y: ``input``'s shape, in its suggested memory format, its dtype.
        mean, rstd: contiguous ``[N, group]`` in the statistics' dtype (:func:`stat_dtype`).
    """

    input: torch.Tensor
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    N: int
    C: int
    HxW: int
    group: int
    eps: float
    y: torch.Tensor
    mean: torch.Tensor
    rstd: torch.Tensor


@dataclass(frozen=True)
class BackwardCall:
    """One validated backward: the gradients ``mask`` asks for, from the forward's ``mean``/``rstd``.

    Attributes:
        grad_out: ``dY``, ``input``'s element count and dtype, any strides.
        input, mean, rstd, weight, N, C, HxW, group: the forward's (``mean``/``rstd`` contiguous ``[N, group]``).
        mask: which of ``dx``, ``dweight``, ``dbias`` are asked (at least one).
        dx: ``input``'s shape and dtype, laid out by :func:`dx_format`; ``None`` unless ``mask[0]``.
        dweight, dbias: vectors of ``C`` in the weight's dtype; ``None`` unless asked (never without a weight).
    """

    grad_out: torch.Tensor
    input: torch.Tensor
    mean: torch.Tensor
    rstd: torch.Tensor
    weight: torch.Tensor | None
    N: int
    C: int
    HxW: int
    group: int
    mask: Mask
    dx: torch.Tensor | None
    dweight: torch.Tensor | None
    dbias: torch.Tensor | None


def prepare_forward(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, N: int, C: int,
                    HxW: int, group: int, eps: float, *, dense_only: bool = True,
                    dtypes: frozenset[torch.dtype] = DTYPES) -> ForwardCall:
    """The validated forward with its outputs allocated (:func:`check_forward`, :func:`allocate_forward`)."""
    dtype = check_forward(input, weight, bias, N, C, HxW, group, dense_only=dense_only, dtypes=dtypes)
    y, mean, rstd = allocate_forward(input, N, group, suggest_memory_format(input), dtype)
    return ForwardCall(input, weight, bias, N, C, HxW, group, float(eps), y, mean, rstd)


def prepare_backward(grad_out: torch.Tensor, input: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                     weight: torch.Tensor | None, N: int, C: int, HxW: int, group: int, output_mask: list[bool],
                     *, dx_like_input: bool = False, dtypes: frozenset[torch.dtype] = DTYPES,
                     ) -> BackwardCall | None:
    """The validated backward with its gradients allocated, or ``None`` when ``output_mask`` asks for nothing.

    torch's ``RuntimeError`` for a ``dY`` of another dtype (:func:`backward_mask`),
    ``Decline`` for the rest torch rejects (:func:`check_backward`).
    ``dx_like_input``: see :func:`dx_format`.
    """
    mask = backward_mask(grad_out, input, output_mask)
    if not (mask[0] or mask[1] or mask[2]):
        return None
    check_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, mask, dtypes)
    dx, dw, db = allocate_backward(input, weight, C, mask, *dx_format(input, dx_like_input))
    return BackwardCall(grad_out, input, mean, rstd, weight, N, C, HxW, group, mask, dx, dw, db)


def entries(forward: Callable[[ForwardCall], None], backward: Callable[[BackwardCall], None],
            dtypes: frozenset[torch.dtype] = DTYPES) -> tuple[Callable[..., tuple], Callable[..., tuple]]:
    """``(native_group_norm, native_group_norm_backward)`` aten implementations around two kernels.

    ``forward(call)`` fills ``call.y``, ``call.mean`` and ``call.rstd``;
    ``backward(call)`` fills every one of ``call.dx``, ``call.dweight``,
    ``call.dbias`` that is not ``None``. Either may raise ``Decline`` for a
    layout it cannot serve, before writing anything.
    """

    def native_group_norm(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, N: int,
                          C: int, HxW: int, group: int, eps: float,
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``aten::native_group_norm``: ``(y, mean, rstd)``."""
        call = prepare_forward(input, weight, bias, N, C, HxW, group, eps, dtypes=dtypes)
        forward(call)
        return call.y, call.mean, call.rstd

    def native_group_norm_backward(grad_out: torch.Tensor, input: torch.Tensor, mean: torch.Tensor,
                                   rstd: torch.Tensor, weight: torch.Tensor | None, N: int, C: int, HxW: int,
                                   group: int, output_mask: list[bool]) -> tuple[torch.Tensor | None, ...]:
        """``aten::native_group_norm_backward``: ``(dx, dweight, dbias)``, each only if ``output_mask`` asks."""
        call = prepare_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask, dtypes=dtypes)
        if call is None:
            return None, None, None
        backward(call)
        return call.dx, call.dweight, call.dbias

    return native_group_norm, native_group_norm_backward


# --------------------------------------------------------------------------- aten::group_norm
def dims(input: torch.Tensor) -> tuple[int, int, int]:
    """``(N, C, HxW)`` of an ``(N, C, *spatial)`` input."""
    shape = input.shape
    return shape[0], shape[1], math.prod(shape[2:])


def _vector_of(t: torch.Tensor | None, C: int) -> bool:
    return t is None or (t.dim() == 1 and t.numel() == C)


def composite_reason(input: torch.Tensor, num_groups: int, weight: torch.Tensor | None,
                     bias: torch.Tensor | None) -> str | None:
    """Why torch's ``aten::group_norm`` composite raises for these arguments (``None`` when it does not)."""
    if input.dim() < 2:
        return "input of rank < 2"
    C = input.shape[1]
    if num_groups <= 0 or C % num_groups != 0:
        return f"num_groups={num_groups} does not divide C={C}"
    if not (_vector_of(weight, C) and _vector_of(bias, C)):
        return "weight or bias is not a vector of C elements"
    return None


def transformed() -> bool:
    """Forward-mode AD or a functorch transform is active: torch's composite knows how to handle those."""
    return forward_ad._current_level >= 0 or torch._C._are_functorch_transforms_active()


def prepare_group_norm(input: torch.Tensor, num_groups: int, weight: torch.Tensor | None,
                       bias: torch.Tensor | None) -> tuple[int, int, int]:
    """``(N, C, HxW)`` of an ``aten::group_norm`` call an implementation may serve.

    ``Decline`` (to torch's composite) for arguments the composite rejects,
    which then raises its own error (:func:`composite_reason`), and under
    forward-mode AD or a functorch transform (:func:`transformed`). The
    output is laid out in the input's suggested memory format, as the
    composite lays it out on CPU: :func:`prepare_forward` allocates it so;
    on other devices torch's composite returns it contiguous, having copied
    the input (:func:`composite_copies`).
    """
    reason = composite_reason(input, num_groups, weight, bias)
    if reason is not None:
        raise Decline(f"{reason} (torch raises)")
    if transformed():
        raise Decline("forward-mode AD or a functorch transform")
    return dims(input)


def needs_grad(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> bool:
    """Whether the call must record a graph: grad mode on and ``input``, ``weight`` or ``bias`` requires grad.

    ``Decline`` for a bias that requires grad without a weight: torch's
    backward raises there, the composite must keep the call.
    """
    if not torch.is_grad_enabled():
        return False
    if weight is None:
        if bias is not None and bias.requires_grad:
            raise Decline("bias needs grad without a weight (torch's backward raises)")
        return input.requires_grad
    return input.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)


def composite_copies(input: torch.Tensor) -> bool:
    """Whether torch's composite copies ``input`` (into :func:`native_format`) before ``native_group_norm``."""
    return not input.is_contiguous(memory_format=native_format(input))


def group_norm_entry(forward: Callable[[ForwardCall], None],
                     dtypes: frozenset[torch.dtype] = DTYPES) -> Callable[..., torch.Tensor]:
    """An ``aten::group_norm`` implementation that needs no graph, around the kernel ``forward(call)``.

    It reads the input in place, whatever its strides (``forward`` sees
    ``call.input`` as passed, and may ``Decline`` a layout it cannot serve),
    and returns ``call.y`` in the input's suggested memory format. A call that
    needs a gradient declines: torch's composite records it over
    ``native_group_norm`` and its backward (an implementation's :func:`entries`).
    """

    def group_norm(input: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, eps: float = 1e-05, cudnn_enabled: bool = True) -> torch.Tensor:
        """``aten::group_norm`` (``cudnn_enabled`` is ignored, as torch deprecated it)."""
        N, C, HxW = prepare_group_norm(input, num_groups, weight, bias)
        if needs_grad(input, weight, bias):
            raise Decline("gradient needed: torch's composite records it over native_group_norm")
        call = prepare_forward(input, weight, bias, N, C, HxW, num_groups, eps, dense_only=False, dtypes=dtypes)
        forward(call)
        return call.y

    return group_norm
