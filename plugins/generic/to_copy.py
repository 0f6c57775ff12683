"""``aten::_to_copy`` (``x.to(dtype)``, ``x.to(memory_format=...)``): one on-device pass.

The output is allocated exactly as torch allocates it (``preserve_format``:
a dense, non-overlapping input keeps its strides; otherwise torch's suggested
memory format), then one strided kernel reads the input's real strides and
casts on store: no intermediate contiguous copy.

Declines to native: a device change, ``pin_memory``, non-strided layouts,
and dtypes outside the toolkit's set (complex, fp8, ...).
"""

from __future__ import annotations

import torch

from flaggems import Decline
from flaggems.toolkit.strided import SUPPORTED_DTYPES, copy_dense, strided_copy


def _decline_reason(self: torch.Tensor, dtype: torch.dtype | None, layout: torch.layout | None,
                    device: torch.device | None, pin_memory: bool | None) -> str | None:
    if device is not None and torch.device(device) != self.device:
        return f"device change {self.device} -> {device}"
    if pin_memory:
        return "pin_memory"
    if layout is not None and layout != torch.strided:
        return "non-strided layout"
    target = self.dtype if dtype is None else dtype
    if self.dtype not in SUPPORTED_DTYPES or target not in SUPPORTED_DTYPES:
        return f"dtype pair {self.dtype} -> {target}"
    if self.is_neg() or self.is_conj():
        return "conj/neg view bit"
    return None


def to_copy(self: torch.Tensor, *, dtype: torch.dtype | None = None, layout: torch.layout | None = None,
            device: torch.device | None = None, pin_memory: bool | None = None, non_blocking: bool = False,
            memory_format: torch.memory_format | None = None) -> torch.Tensor:
    """``aten::_to_copy`` through the toolkit's strided cast kernel."""
    reason = _decline_reason(self, dtype, layout, device, pin_memory)
    if reason is not None:
        raise Decline(reason)
    out = torch.empty_like(self, dtype=dtype, memory_format=memory_format or torch.preserve_format)
    numel = out.numel()
    if numel:
        if self.is_contiguous() and out.is_contiguous():
            copy_dense(out, self, numel)  # same shape, fresh output: nothing to check
        else:
            strided_copy(out, self)
    return out
