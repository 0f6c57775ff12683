"""``aten::copy_`` and ``aten::_to_copy``: torch's semantics, for any copy kernel.

A vendor supplies one or both of two kernels and gets the two aten entry
points from :func:`entries`:

* ``copy_dense(dst, src, numel)``: both operands contiguous, same shape,
  ``numel > 0`` elements, no overlap between them; cast to ``dst.dtype``;
* ``copy_strided(dst, src)``: same shape, any strides (``src`` may be
  expanded: zero strides), ``dst`` never overlapping itself nor ``src``,
  ``numel > 0``; cast to ``dst.dtype``.

Given only ``copy_strided``, dense calls go through it; given only
``copy_dense``, a call that needs strides declines. A kernel may raise
``Decline`` for a layout it cannot serve, before writing anything.

What the front owns (the same for every kernel):

* declines, with a reason on the ``fallback`` log channel: operands on
  different devices, a dtype (either side) outside the kernel's set, a
  negative view bit (and for ``_to_copy``: a device change, ``pin_memory``, a
  non-strided layout, a conjugate view bit);
* torch's errors: a destination whose elements overlap each other (an
  expanded tensor) raises torch's RuntimeError (:data:`INTERNAL_OVERLAP`),
  nothing written; a source that does not broadcast to the destination
  raises torch's message (:func:`broadcast`);
* no-ops: an empty destination, a source that is the destination viewed
  identically; a partial overlap of source and destination declines (the
  native kernel's result, or error, is then exactly torch's);
* ``_to_copy``'s output allocated as torch allocates it (:func:`allocate`:
  ``preserve_format`` keeps a dense, non-overlapping input's strides).

The dense, same-shape, contiguous ``copy_`` is the library's hottest call:
:func:`entries` tests it with attribute checks only, inline.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..chain import Decline
from ..toolkit.dtypes import SUPPORTED_DTYPES
from ..toolkit.layout import overlaps

#: Dtypes the shared copy kernels move (either side; a vendor passes its own set to :func:`entries`).
DTYPES = SUPPORTED_DTYPES

#: torch's RuntimeError for a destination whose elements share memory (``MemOverlap::Yes``).
INTERNAL_OVERLAP = ("unsupported operation: more than one element of the written-to tensor refers to a "
                    "single memory location. Please clone() the tensor before performing the operation.")

#: ``copy_dense(dst, src, numel)``: see the module docstring.
DenseCopy = Callable[[torch.Tensor, torch.Tensor, int], None]
#: ``copy_strided(dst, src)``: see the module docstring.
StridedCopy = Callable[[torch.Tensor, torch.Tensor], None]


def decline_reason(dst: torch.Tensor, src: torch.Tensor, dtypes: frozenset[torch.dtype] = DTYPES) -> str | None:
    """Why ``dst.copy_(src)`` goes to the native kernel, or ``None`` when a kernel serves it."""
    if dst.device != src.device:
        return f"cross-device copy {src.device} -> {dst.device}"
    if dst.dtype not in dtypes or src.dtype not in dtypes:
        return f"dtype pair {src.dtype} -> {dst.dtype}"
    if src.is_neg() or dst.is_neg():
        return "negative view bit"
    return None


def to_copy_decline_reason(self: torch.Tensor, dtype: torch.dtype | None = None, layout: torch.layout | None = None,
                           device: torch.device | str | None = None, pin_memory: bool | None = None,
                           dtypes: frozenset[torch.dtype] = DTYPES) -> str | None:
    """Why ``aten::_to_copy`` goes to the native kernel, or ``None`` when a kernel serves it."""
    if device is not None and torch.device(device) != self.device:
        return f"device change {self.device} -> {device}"
    if pin_memory:
        return "pin_memory"
    if layout is not None and layout != torch.strided:
        return "non-strided layout"
    target = self.dtype if dtype is None else dtype
    if self.dtype not in dtypes or target not in dtypes:
        return f"dtype pair {self.dtype} -> {target}"
    if self.is_neg() or self.is_conj():
        return "conj/neg view bit"
    return None


def broadcast(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """``src`` expanded to ``dst``'s shape; torch's RuntimeError (and message) when it does not broadcast."""
    shape = torch._C._infer_size(dst.shape, src.shape)  # raises torch's own message
    if shape != dst.shape:
        raise RuntimeError(f"output with shape {list(dst.shape)} doesn't match the broadcast shape {list(shape)}")
    return src.expand(dst.shape)


def overlap(dst: torch.Tensor, src: torch.Tensor) -> str | None:
    """``"same"`` when ``src`` is ``dst`` viewed identically, ``"partial"`` for any other overlap, else ``None``."""
    if (dst.data_ptr() == src.data_ptr() and dst.dtype == src.dtype
            and dst.shape == src.shape and dst.stride() == src.stride()):
        return "same"
    return "partial" if overlaps(dst, src) else None


def strided_source(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor | None:
    """torch's checks of ``dst.copy_(src)`` for any layout: the source to copy, or ``None`` for nothing to do.

    Raises torch's RuntimeError for a ``dst`` overlapping itself and for a
    ``src`` that does not broadcast; ``Decline`` for a partial overlap of the
    two. Returns ``src`` expanded to ``dst``'s shape, or ``None`` when ``dst``
    is empty or ``src`` is ``dst`` itself.
    """
    if torch._debug_has_internal_overlap(dst) == 1:  # torch's MemOverlap::Yes
        raise RuntimeError(INTERNAL_OVERLAP)
    if src.shape != dst.shape:
        src = broadcast(src, dst)
    if dst.numel() == 0:
        return None
    found = overlap(dst, src)
    if found == "same":
        return None
    if found == "partial":
        raise Decline("source and destination partially overlap")
    return src


def allocate(self: torch.Tensor, dtype: torch.dtype | None = None,
             memory_format: torch.memory_format | None = None) -> torch.Tensor:
    """``_to_copy``'s output as torch allocates it (``preserve_format`` unless ``memory_format`` is given)."""
    return torch.empty_like(self, dtype=dtype, memory_format=memory_format or torch.preserve_format)


def entries(copy_dense: DenseCopy | None = None, copy_strided: StridedCopy | None = None,
            dtypes: frozenset[torch.dtype] = DTYPES,
            ) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """``(copy_, to_copy)`` aten implementations around the kernels (at least one; see the module docstring)."""
    if copy_dense is None and copy_strided is None:
        raise TypeError("entries() needs copy_dense, copy_strided or both")
    if any(dtype.is_complex for dtype in dtypes):
        raise ValueError("complex dtypes: copy_'s checks do not resolve conjugate views")
    dense: DenseCopy = copy_dense if copy_dense is not None else (
        lambda dst, src, numel: copy_strided(dst, src))
    any_layout: StridedCopy | None = copy_strided

    def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        """``self.copy_(src)``: broadcast, cast, any strides."""
        # get_device(): an int, cheaper than comparing two torch.device objects on the hot path
        if (self.dtype not in dtypes or src.dtype not in dtypes
                or self.get_device() != src.get_device() or src.is_neg() or self.is_neg()):
            raise Decline(decline_reason(self, src, dtypes) or "unsupported")
        if self.shape == src.shape and self.is_contiguous() and src.is_contiguous():
            # Same shape, both contiguous: no internal overlap possible, one address-range test.
            numel = self.numel()
            if numel:
                dst_ptr, src_ptr = self.data_ptr(), src.data_ptr()
                if dst_ptr == src_ptr and self.dtype == src.dtype:
                    return self
                if (dst_ptr < src_ptr + numel * src.element_size()
                        and src_ptr < dst_ptr + numel * self.element_size()):
                    raise Decline("source and destination partially overlap")
                dense(self, src, numel)
            return self
        if any_layout is None:
            raise Decline("not both contiguous and of one shape: this implementation copies dense operands only")
        source = strided_source(self, src)
        if source is not None:
            any_layout(self, source)
        return self

    def to_copy(self: torch.Tensor, *, dtype: torch.dtype | None = None, layout: torch.layout | None = None,
                device: torch.device | None = None, pin_memory: bool | None = None, non_blocking: bool = False,
                memory_format: torch.memory_format | None = None) -> torch.Tensor:
        """``aten::_to_copy``: a fresh tensor laid out as torch's, cast to ``dtype``."""
        if (device is not None or pin_memory or layout is not None or self.dtype not in dtypes
                or (dtype is not None and dtype not in dtypes) or self.is_neg() or self.is_conj()):
            reason = to_copy_decline_reason(self, dtype, layout, device, pin_memory, dtypes)
            if reason is not None:
                raise Decline(reason)
        out = allocate(self, dtype, memory_format)
        numel = out.numel()
        if numel:
            if self.is_contiguous() and out.is_contiguous():
                dense(out, self, numel)  # same shape, fresh output: nothing to check
            elif any_layout is None:
                raise Decline("a strided input or output: this implementation copies dense operands only")
            else:
                any_layout(out, self)
        return out

    return copy_, to_copy
