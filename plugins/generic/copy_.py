"""``aten::copy_``: broadcast, cast and strided copy in one kernel launch.

Contract (everything else declines to the native kernel, with the reason on
the ``fallback`` log channel):

* ``self`` and ``src`` on the same device, dtypes among float16, bfloat16,
  float32, float64, int8, int16, int32, int64, uint8 and bool (any pair: the
  cast happens in the kernel), strided layout, no conj/neg view bits;
* ``src`` broadcastable to ``self`` (expanded, zero strides allowed);
* any strides on both sides (expand, transpose, slice with a step, permute,
  any rank): the toolkit collapses dimensions and passes real strides.

Errors are torch's: a destination whose elements overlap each other (an
expanded tensor) raises torch's RuntimeError; a shape that does not
broadcast raises torch's message. Partial overlap between ``src`` and
``self`` goes native, so the result (or error) is exactly torch's.
"""

from __future__ import annotations

import torch

from flaggems import Decline
from flaggems.toolkit.layout import overlaps
from flaggems.toolkit.strided import SUPPORTED_DTYPES, copy_dense, strided_copy

INTERNAL_OVERLAP = ("unsupported operation: more than one element of the written-to tensor refers to a "
                    "single memory location. Please clone() the tensor before performing the operation.")


def _overlap(dst: torch.Tensor, src: torch.Tensor) -> str | None:
    """``"same"`` when ``src`` is ``dst`` viewed identically, ``"partial"`` for other overlaps."""
    if (dst.data_ptr() == src.data_ptr() and dst.dtype == src.dtype
            and dst.shape == src.shape and dst.stride() == src.stride()):
        return "same"
    return "partial" if overlaps(dst, src) else None


def _decline_reason(dst: torch.Tensor, src: torch.Tensor) -> str | None:
    if dst.device != src.device:
        return f"cross-device copy {src.device} -> {dst.device}"
    if dst.dtype not in SUPPORTED_DTYPES or src.dtype not in SUPPORTED_DTYPES:
        return f"dtype pair {src.dtype} -> {dst.dtype}"
    if src.is_neg() or dst.is_neg():
        return "negative view bit"
    return None


def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``self.copy_(src)`` through the toolkit's strided cast kernel."""
    if (self.dtype not in SUPPORTED_DTYPES or src.dtype not in SUPPORTED_DTYPES
            or self.get_device() != src.get_device() or src.is_neg() or self.is_neg()):
        raise Decline(_decline_reason(self, src) or "unsupported")
    if self.shape == src.shape and self.is_contiguous() and src.is_contiguous():
        return _copy_dense(self, src)
    return _copy_strided(self, src)


def _copy_dense(self: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Hot path: same shape, both contiguous (no internal overlap is possible)."""
    numel = self.numel()
    if numel:
        dst_ptr, src_ptr = self.data_ptr(), src.data_ptr()
        if dst_ptr == src_ptr and self.dtype == src.dtype:
            return self
        if dst_ptr < src_ptr + numel * src.element_size() and src_ptr < dst_ptr + numel * self.element_size():
            raise Decline("source and destination partially overlap")
        copy_dense(self, src, numel)
    return self


def _copy_strided(self: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    if torch._debug_has_internal_overlap(self) == 1:  # torch's MemOverlap::Yes
        raise RuntimeError(INTERNAL_OVERLAP)
    if src.shape != self.shape:
        src = _broadcast(src, self)
    if self.numel() == 0:
        return self
    overlap = _overlap(self, src)
    if overlap == "same":
        return self
    if overlap == "partial":
        raise Decline("source and destination partially overlap")
    strided_copy(self, src)
    return self


def _broadcast(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """``src`` expanded to ``dst``'s shape, with torch's error messages."""
    shape = torch._C._infer_size(dst.shape, src.shape)  # raises torch's own message
    if shape != dst.shape:
        raise RuntimeError(f"output with shape {list(dst.shape)} doesn't match the broadcast shape {list(shape)}")
    return src.expand(dst.shape)
