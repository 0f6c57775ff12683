"""Argument checks that need the device's data (and so a host synchronisation).

The contract: on the CPU interpreter, or with ``FLAGGEMS_CHECK_INDICES=1``,
index-like arguments are validated synchronously and bad input raises the
error torch raises. On a GPU by default no synchronisation is added: kernels
mask invalid indices so nothing is written out of bounds, but no error is
raised (torch itself stops there with a device-side assert).
"""

from __future__ import annotations

import torch

from . import context


def enabled() -> bool:
    """True when synchronous checks run: ``FLAGGEMS_CHECK_INDICES`` or the interpreter (the kernel context)."""
    return context.current().checks


def first_out_of_range(index: torch.Tensor, size: int) -> int | None:
    """The first index value outside ``[0, size)``, or ``None`` (one host sync).

    A ``size`` past the index dtype's range (an int32 index into an expanded view of 2**31 rows) bounds
    nothing above: torch would compare with the size wrapped to the dtype (every int32 ``>= 2**31 + 8``).
    """
    flat = index.reshape(-1)
    top = torch.iinfo(flat.dtype).max if not flat.dtype.is_floating_point and flat.dtype != torch.bool else None
    bad = flat < 0 if top is not None and size > top else (flat < 0) | (flat >= size)
    if not bool(bad.any()):
        return None
    return int(flat[bad.nonzero()[0, 0]])
