"""``aten::index_select``: torch's semantics, for any gather kernel.

:func:`prepare` turns the aten arguments into a :class:`Call` or raises
``Decline`` where torch raises (an index of rank above 1 or not int32/int64,
devices, a dtype outside the kernel's set, a non-strided layout, ``dim`` out
of range, a 0-dim ``self`` with other than one index, an empty ``self``
(nothing to gather, and torch's checks there differ by device): the native
kernel then gives torch's exact result or error). It wraps
``dim``, views a 0-dim ``self`` and index as one-element vectors, checks the
index range when the checking contract says so (:mod:`flaggems.toolkit.checks`:
torch's CPU error types and messages, :func:`out_of_range_error`) and
allocates the result contiguous, as torch does. :func:`entries` builds the
aten entry point around a kernel ``gather(call)``, which it calls only when
there is something to write.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..chain import Decline
from ..toolkit import checks
from ..toolkit.dtypes import SUPPORTED_DTYPES

#: Dtypes the shared gather kernel moves (a vendor passes its own set to :func:`prepare` / :func:`entries`).
DTYPES = SUPPORTED_DTYPES
#: Index dtypes torch accepts.
INDEX_DTYPES = (torch.int64, torch.int32)


# Built per call: slotted, not frozen (0.2 µs against 1 µs on the CI host); kernels treat it as read-only.
@dataclass(slots=True)
class Call:
    """One validated index_select: ``out[..., j, ...] = source[..., index[j], ...]`` along ``dim``.

    Attributes:
        source: the caller's ``self`` (rank >= 1: a 0-dim ``self`` is viewed as one element), any strides.
        dim: wrapped, in ``[0, source.dim())``.
        index: int64 or int32, rank 1 (in range where the checking contract checked it).
        out: the fresh contiguous result, ``source``'s rank with ``index.numel()`` rows along ``dim``.
    """

    source: torch.Tensor
    dim: int
    index: torch.Tensor
    out: torch.Tensor


def valid(self: torch.Tensor, index: torch.Tensor, dtypes: frozenset[torch.dtype] = DTYPES) -> bool:
    """torch's argument checks but ``dim``'s, without building error messages (native builds them)."""
    if index.dim() > 1 or index.dtype not in INDEX_DTYPES:
        return False
    if self.device != index.device or self.dtype not in dtypes or self.layout != torch.strided:
        return False
    return self.dim() > 0 or index.numel() == 1


def out_of_range_error(source: torch.Tensor, dim: int, bad: int, size: int) -> Exception:
    """torch's CPU error: its dim-1 path (rank 2 or more) raises RuntimeError, every other path IndexError."""
    if source.dim() > 1 and dim == 1:
        return RuntimeError(f"INDICES element is out of DATA bounds, id={bad} axis_dim={size}")
    return IndexError("index out of range in self")


def prepare(self: torch.Tensor, dim: int, index: torch.Tensor, dtypes: frozenset[torch.dtype] = DTYPES) -> Call:
    """The normalised call, or ``Decline`` where torch raises (see the module docstring)."""
    wrap = max(self.dim(), 1)
    if not valid(self, index, dtypes) or not -wrap <= dim < wrap:
        raise Decline("invalid arguments: the native kernel raises torch's error")
    source = self.reshape(1) if self.dim() == 0 else self
    dim = dim % wrap
    size = source.shape[dim]
    if source.numel() == 0:
        # nothing to gather; torch's checks differ by device here (CPU raises RuntimeError for rank >= 2)
        raise Decline("empty source: the native kernel gives torch's result or error")
    if checks.enabled():
        bad = checks.first_out_of_range(index, size)
        if bad is not None:
            raise out_of_range_error(source, dim, bad, size)
    shape = list(source.shape)
    shape[dim] = index.numel()
    out = torch.empty(shape, dtype=self.dtype, device=self.device)
    flat = index if index.dim() == 1 else index.reshape(1)  # a view costs ~2 µs of host time
    return Call(source, dim, flat, out)


def entries(gather: Callable[[Call], None], dtypes: frozenset[torch.dtype] = DTYPES,
            ) -> Callable[..., torch.Tensor]:
    """The ``index_select`` aten implementation around ``gather(call)``.

    ``gather`` fills ``call.out`` (never empty when called); it may raise
    ``Decline`` for a layout it cannot serve, before writing anything.
    """

    def index_select(self: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
        """``torch.index_select(self, dim, index)``: a contiguous result."""
        call = prepare(self, dim, index, dtypes)
        out = call.out
        if out.numel():
            gather(call)
        return out.reshape(()) if self.dim() == 0 else out

    return index_select
