"""``aten::index_select``: gather rows along a dimension, in place of the input's layout.

``out[..., j, ...] = self[..., index[j], ...]`` through the toolkit's
gather/scatter kernel. The input is indexed through its real strides as an
``[outer, index, inner]`` view: no transpose or copy of the input when ``dim``
is not the last one (the known peer implementation copied the whole input,
twice). ``out`` is contiguous, as torch's.

int64 and int32 indices. Invalid arguments decline to native (torch's error);
out-of-range indices follow :mod:`flaggems.toolkit.checks` (when checking,
torch's CPU error: RuntimeError on its dim-1 path of rank 2 or more, IndexError
"index out of range in self" on every other; masked, zeros written, otherwise).
"""

from __future__ import annotations

import torch

from flaggems import Decline
from flaggems.toolkit import checks
from flaggems.toolkit.indexing import index_along_dim
from flaggems.toolkit.strided import SUPPORTED_DTYPES


def _valid(self: torch.Tensor, index: torch.Tensor) -> bool:
    if index.dim() > 1 or index.dtype not in (torch.int64, torch.int32):
        return False
    if self.device != index.device or self.dtype not in SUPPORTED_DTYPES or self.layout != torch.strided:
        return False
    return self.dim() > 0 or index.numel() == 1


def _out_of_range(source: torch.Tensor, dim: int, bad: int, size: int) -> Exception:
    """torch's CPU error: its dim-1 path (rank 2 or more) raises RuntimeError, every other path IndexError."""
    if source.dim() > 1 and dim == 1:
        return RuntimeError(f"INDICES element is out of DATA bounds, id={bad} axis_dim={size}")
    return IndexError("index out of range in self")


def index_select(self: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """``torch.index_select(self, dim, index)``."""
    wrap = max(self.dim(), 1)
    if not _valid(self, index) or not -wrap <= dim < wrap:
        raise Decline("invalid arguments: the native kernel raises torch's error")
    source = self.reshape(1) if self.dim() == 0 else self
    dim = dim % wrap
    size = source.shape[dim]
    if size == 0 and index.numel():
        raise Decline("indices into an empty dimension: the native kernel raises torch's error")
    if checks.enabled():
        bad = checks.first_out_of_range(index, size)
        if bad is not None:
            raise _out_of_range(source, dim, bad, size)
    shape = list(source.shape)
    shape[dim] = index.numel()
    out = torch.empty(shape, dtype=self.dtype, device=self.device)
    flat = index if index.dim() == 1 else index.reshape(1)  # a view costs ~2 µs of host time
    if out.numel() and not index_along_dim(out, source, dim, flat, scatter=False):
        raise Decline("layout needs more than 2 outer or 2 inner dimensions")
    return out.reshape(()) if self.dim() == 0 else out
