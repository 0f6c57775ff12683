"""``aten::index_copy_`` / ``aten::index_copy``: torch's semantics, for any kernel.

:func:`prepare` turns the aten arguments into a :class:`Call` or raises
``Decline`` where torch raises (invalid shapes, dtypes, index rank or dtype,
devices, a ``self`` overlapping itself or sharing memory with ``source`` or
``index``: the native kernel then raises torch's exact error). It wraps
``dim``, views 0-dim operands as one-element vectors, checks the index range
when the checking contract says so (IndexError, torch's message) and
allocates the out-of-place result contiguous, as torch does. :func:`entries`
builds the two aten entry points around a kernel ``scatter(call)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..chain import Decline
from ..toolkit import checks
from ..toolkit.dtypes import SUPPORTED_DTYPES
from ..toolkit.layout import overlaps

#: Dtypes the shared kernels move (a vendor passes its own set to :func:`prepare` / :func:`entries`).
DTYPES = SUPPORTED_DTYPES


@dataclass(frozen=True)
class Call:
    """One validated index_copy: rows ``index[j]`` of ``target`` along ``dim`` get ``source``'s row ``j``.

    Attributes:
        self: the caller's ``self`` (rank >= 1: a 0-dim operand is viewed as one element).
        dim: wrapped, in ``[0, self.dim())``.
        index: int64, rank 1 (in range where the checking contract checked it).
        source: ``self``'s rank, ``index.numel()`` rows along ``dim``.
        out: the fresh contiguous result (out of place), or ``None`` (in place: ``target`` is ``self``).
    """

    self: torch.Tensor
    dim: int
    index: torch.Tensor
    source: torch.Tensor
    out: torch.Tensor | None

    @property
    def target(self) -> torch.Tensor:
        """The tensor the rows are written into."""
        return self.self if self.out is None else self.out


def wrap_dim(dim: int, rank: int) -> int:
    """``dim`` in ``[0, max(rank, 1))``; -1 when out of range (native raises torch's error)."""
    wrap = max(rank, 1)
    return dim + wrap if -wrap <= dim < 0 else (dim if 0 <= dim < wrap else -1)


def valid(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor,
          dtypes: frozenset[torch.dtype] = DTYPES) -> bool:
    """torch's argument checks (``dim`` wrapped), without building error messages (native builds them)."""
    if index.dim() > 1 or index.dtype != torch.int64 or self.dtype != source.dtype:
        return False
    if not (self.device == source.device == index.device) or self.dtype not in dtypes:
        return False
    if source.dim() == 0 or self.dim() == 0:
        return index.numel() == 1 and source.numel() == 1 and self.dim() <= 1 and source.dim() <= 1
    if source.dim() != self.dim():
        return False
    if any(s != t for d, (s, t) in enumerate(zip(self.shape, source.shape)) if d != dim):
        return False
    return source.shape[dim] == index.numel()


def _rank1(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(1) if tensor.dim() == 0 else tensor


def check_range(index: torch.Tensor, size: int, dim: int) -> None:
    """IndexError with torch's message for the first index outside ``[0, size)`` (one host sync)."""
    bad = checks.first_out_of_range(index, size)
    if bad is not None:
        raise IndexError(f"index_copy_(): index {bad} is out of bounds for dimension {dim} with size {size}")


def prepare(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor, *, inplace: bool,
            dtypes: frozenset[torch.dtype] = DTYPES) -> Call:
    """The normalised call, or ``Decline`` where torch raises (see the module docstring)."""
    dim = wrap_dim(dim, self.dim())
    if dim < 0 or not valid(self, dim, index, source, dtypes):
        raise Decline("invalid arguments: the native kernel raises torch's error")
    if self.numel() == 0:  # nothing to write; torch's checks there differ by device (CUDA: overlap, storage)
        raise Decline("empty self: the native kernel gives torch's result or error")
    if inplace:
        strides = self.stride()  # ``0 in`` first: 0.12 against 0.55 µs for the loop alone (CI host)
        if 0 in strides and any(st == 0 and n > 1 for n, st in zip(self.shape, strides)):
            raise Decline("self overlaps itself: the native kernel raises torch's error")
        if overlaps(self, source) or overlaps(self, index):
            raise Decline("self shares memory with source or index: the native kernel raises torch's error")
        out = None
    else:
        # empty_like: 3.5 µs against 7.9 for torch.empty(shape, dtype=, device=) on the CI host
        out = torch.empty_like(self, memory_format=torch.contiguous_format)
    if self.dim() == 0 or source.dim() == 0:
        self, source, dim = _rank1(self), _rank1(source), 0
        out = None if out is None else _rank1(out)
    if checks.enabled() and source.numel():  # torch checks indices as it copies: nothing to copy, no error
        check_range(index, self.shape[dim], dim)
    return Call(self, dim, _rank1(index), source, out)


def entries(scatter: Callable[[Call], None], dtypes: frozenset[torch.dtype] = DTYPES,
            ) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """``(index_copy_, index_copy)`` aten implementations around ``scatter(call)``.

    ``scatter`` writes ``call.source``'s rows into ``call.target`` (for an
    out-of-place call it first fills ``call.out`` with ``call.self``); it may
    raise ``Decline`` for a layout it cannot serve, before writing anything.
    """

    def index_copy_(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """In place: ``self.index_copy_(dim, index, source)``."""
        scatter(prepare(self, dim, index, source, inplace=True, dtypes=dtypes))
        return self

    def index_copy(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """Out of place: a contiguous copy of ``self`` with the rows replaced."""
        call = prepare(self, dim, index, source, inplace=False, dtypes=dtypes)
        scatter(call)
        return call.out.reshape(self.shape) if self.dim() == 0 else call.out

    return index_copy_, index_copy
