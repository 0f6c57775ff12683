"""``aten::index_copy_`` and ``aten::index_copy``: scatter rows along a dimension.

``self[..., index[j], ...] = source[..., j, ...]`` through the toolkit's
gather/scatter kernel, which addresses ``self`` and ``source`` with their real
strides (a transposed or sliced tensor is written in place, never through a
copy: the known peer implementation derived offsets from the source's storage
offset and was silently wrong there). The out-of-place form copies ``self``
with the toolkit's strided copy (a flat kernel when dense), then scatters.

Invalid arguments (shapes, dtypes, index rank or dtype, devices) decline to the
native kernel, which raises torch's exact error. Out-of-range indices: see
:mod:`flaggems.toolkit.checks` (IndexError when checking; masked otherwise).
Duplicate indices: one of the candidates wins, unspecified (as in torch).
Empty index or source: no kernel launch.
"""

from __future__ import annotations

import torch

from flaggems import Decline
from flaggems.toolkit import checks
from flaggems.toolkit.indexing import index_along_dim
from flaggems.toolkit.strided import SUPPORTED_DTYPES, strided_copy


def _valid(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor) -> bool:
    """torch's argument checks, without building error messages (native builds them)."""
    if index.dim() > 1 or index.dtype != torch.int64 or self.dtype != source.dtype:
        return False
    if not (self.device == source.device == index.device) or self.dtype not in SUPPORTED_DTYPES:
        return False
    if source.dim() == 0 or self.dim() == 0:
        return index.numel() == 1 and source.numel() == 1 and self.dim() <= 1 and source.dim() <= 1
    if source.dim() != self.dim():
        return False
    if any(s != t for d, (s, t) in enumerate(zip(self.shape, source.shape)) if d != dim):
        return False
    return source.shape[dim] == index.numel()


def _check_range(index: torch.Tensor, size: int, dim: int) -> None:
    bad = checks.first_out_of_range(index, size)
    if bad is not None:
        raise IndexError(f"index_copy_(): index {bad} is out of bounds for dimension {dim} with size {size}")


def _as_rank1(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(1) if tensor.dim() == 0 else tensor


def scatter_rows(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor) -> None:
    """Validated scatter of ``source`` into ``self`` along ``dim`` (``dim`` normalised)."""
    if self.dim() == 0 or source.dim() == 0:
        self_1d, source_1d, dim = _as_rank1(self), _as_rank1(source), 0
    else:
        self_1d, source_1d = self, source
    size = self_1d.shape[dim]
    if checks.enabled():
        _check_range(index, size, dim)
    if source_1d.numel() == 0:
        return
    if not index_along_dim(source_1d, self_1d, dim, _as_rank1(index), scatter=True):
        raise Decline("layout needs more than 2 outer or 2 inner dimensions")


def _normalise_dim(dim: int, rank: int) -> int:
    """``dim`` in ``[0, max(rank, 1))``; -1 when out of range (native raises torch's error)."""
    wrap = max(rank, 1)
    return dim + wrap if -wrap <= dim < 0 else (dim if 0 <= dim < wrap else -1)


def index_copy_(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """In place: ``self.index_copy_(dim, index, source)``."""
    dim = _normalise_dim(dim, self.dim())
    if dim < 0 or not _valid(self, dim, index, source):
        raise Decline("invalid arguments: the native kernel raises torch's error")
    if any(st == 0 and n > 1 for n, st in zip(self.shape, self.stride())):
        raise Decline("self overlaps itself: the native kernel raises torch's error")
    scatter_rows(self, dim, index, source)
    return self


def index_copy(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """Out of place: a contiguous copy of ``self`` (as torch allocates it) with the rows replaced."""
    dim = _normalise_dim(dim, self.dim())
    if dim < 0 or not _valid(self, dim, index, source):
        raise Decline("invalid arguments: the native kernel raises torch's error")
    out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
    if out.numel():
        strided_copy(out, self)
    scatter_rows(out, dim, index, source)
    return out
