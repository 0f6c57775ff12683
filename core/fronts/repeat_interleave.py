"""``aten::repeat_interleave`` (``.Tensor``, ``.self_Tensor``, ``.self_int``): torch's semantics, for any kernel.

:func:`entries` builds the three aten entry points around two kernels a
vendor writes, called only with validated arguments:

``expand(repeats, output_size, values) -> Tensor``
    Row ``i`` repeated ``repeats[i]`` times: the row ids themselves
    (``values`` is ``None``: the ``.Tensor`` overload, in ``repeats``' dtype)
    or ``values[i]`` (``values`` 1-D, as long as ``repeats``, read through its
    stride: ``.self_Tensor`` on a vector, in its dtype). ``repeats`` is 1-D,
    int32 or int64, on ``values``' device, with at least one row (and fewer
    than ``max_rows``), read through its stride. ``output_size`` is the total
    when the caller gave it (never 0: the front returns the empty result
    itself): the kernel allocates its result with :func:`expanded` and reads
    nothing back from the device (no host sync: the call can be captured in a
    CUDA graph). A wrong ``output_size`` or a negative repeat may then only
    give unspecified values inside the result (with checks on, the front has
    raised torch's errors already, :func:`check_output_size`). ``output_size``
    ``None``: the kernel computes the total and the smallest repeat (its one
    sync) and allocates with ``expanded(source, total, smallest)``, which
    raises torch's error for a negative repeat.
``gather(out, source, dim, rows, repeat) -> None``
    ``out[..., p, ...] = source[..., r, ...]`` along ``dim`` (wrapped, ``out``
    allocated contiguous by the front, with elements), where ``r`` is
    ``rows[p]`` (``rows`` a 1-D int32/int64 tensor of row ids, each in range:
    the expand's output) or ``p // repeat`` (``rows`` is ``None``; ``repeat``
    a non-negative Python int, or a one-element int32/int64 tensor read on the
    device, whose value may be wrong or negative when checks are off: the
    gather must then stay in bounds). ``source`` keeps its strides.

Either kernel may raise ``Decline`` for a layout it cannot serve, before
writing anything. A vendor writes only these::

    from flaggems.fronts import repeat_interleave

    tensor, self_tensor, self_int = repeat_interleave.entries(expand, gather, dtypes=MY_DTYPES)

and the front owns the rest:

* argument checks that decline (``Decline``) where torch raises, so that the
  native kernel or composite raises torch's exact error: ``repeats`` not a
  1-D int32/int64 strided tensor, a negative Python repeat, an explicit
  ``dim`` on a 0-dim tensor or out of range, a ``repeats`` size mismatch, a
  wrong ``output_size`` for a Python repeat, devices that differ, a dtype
  outside the vendor's set;
* autograd: ``.self_int`` and ``.self_Tensor`` are CompositeImplicitAutograd
  in torch, so a call that needs a graph declines to the native composite,
  which records it;
* ``dim=None`` flattens; ``dim`` wrapped;
* a scalar-tensor ``repeats`` (one element, a ``dim`` longer than 1): with
  ``output_size`` given and checks off, nothing is read back; otherwise its
  one sync reads the count (torch's RuntimeErrors for a negative count or a
  wrong ``output_size``);
* with checks on (:func:`flaggems.toolkit.checks.enabled`), torch's
  RuntimeErrors for negative repeats or a wrong ``output_size`` before the
  known-size expand (one sync); off, the known-size paths read nothing back;
* the results: allocated with ``torch.empty*`` only (no other torch op on the
  known-size paths: the compiled entry replays such calls), the repeated
  ``dim`` as long as the total; empty repeats or an empty total launch nothing;
* ``max_rows``: repeats of that many rows or more decline (a kernel's row
  offsets, say int32).

Plain functions and positional arguments rather than a ``Call`` object: the
entries run per op call, and building a frozen dataclass costs 1.4 µs a call
(measured on the development host, Python 3.11), against 0.1-0.3 µs for the
whole front over the former inline code.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..chain import Decline
from ..toolkit import checks
from ..toolkit.dtypes import SUPPORTED_DTYPES
from ..toolkit.recording import host_values

#: Dtypes of ``self`` the shared kernels move (a vendor passes its own set to :func:`entries`).
DTYPES = SUPPORTED_DTYPES
#: Dtypes torch accepts for a tensor of repeats (also the ``.Tensor`` overload's result dtype).
REPEATS_DTYPES = frozenset({torch.int32, torch.int64})

#: ``expand(repeats, output_size, values) -> Tensor`` (see the module docstring).
Expand = Callable[[torch.Tensor, int | None, torch.Tensor | None], torch.Tensor]
#: ``gather(out, source, dim, rows, repeat) -> None`` (see the module docstring).
Gather = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor | None, int | torch.Tensor | None], None]


def repeats_ok(repeats: torch.Tensor) -> bool:
    """Whether ``repeats`` is what the ``.Tensor`` overload takes: 1-D, int32 or int64, strided."""
    return repeats.dim() == 1 and repeats.dtype in REPEATS_DTYPES and repeats.layout == torch.strided


def needs_autograd(tensor: torch.Tensor) -> bool:
    """Whether a call on ``tensor`` must record an autograd graph (then the native composite serves it)."""
    return tensor.requires_grad and torch.is_grad_enabled()


def flatten(self: torch.Tensor, dim: int | None) -> tuple[torch.Tensor, int] | None:
    """The input and the wrapped dimension to repeat along (``dim=None`` flattens); ``None`` if ``dim`` is invalid.

    An explicit ``dim`` on a 0-dim tensor is invalid: torch raises IndexError for it (native serves it).
    """
    if dim is None:
        return (self if self.dim() == 1 else self.reshape(-1)), 0
    if self.dim() == 0 or not -self.dim() <= dim < self.dim():
        return None
    return self, dim % self.dim()


def check_output_size(repeats: torch.Tensor, output_size: int) -> None:
    """torch's RuntimeErrors for a negative repeat or an ``output_size`` that is not the total (one sync)."""
    total, smallest = host_values(torch.stack((repeats.sum(), repeats.min().to(torch.int64))))
    if smallest < 0:
        raise RuntimeError("repeats can not be negative")
    if output_size != total:
        raise RuntimeError("allocated size does not match required size")


def expanded(source: torch.Tensor, total: int, smallest: int = 0) -> torch.Tensor:
    """The expand's result: ``total`` elements of ``source``'s dtype on its device.

    ``smallest``: the smallest repeat, when the kernel computed it with the
    total (``output_size`` unknown); a negative one raises torch's error.
    """
    if smallest < 0:
        raise RuntimeError("repeats can not be negative")
    return torch.empty(total, dtype=source.dtype, device=source.device)


def _along(source: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """``source``'s shape with ``length`` along ``dim``, fresh and contiguous."""
    shape = list(source.shape)
    shape[dim] = length
    return torch.empty(shape, dtype=source.dtype, device=source.device)


def entries(expand: Expand, gather: Gather, dtypes: frozenset[torch.dtype] = DTYPES, max_rows: int | None = None,
            ) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """``(repeat_interleave.Tensor, .self_Tensor, .self_int)`` aten implementations around the two kernels.

    ``dtypes`` narrows ``self``'s dtype (``.self_Tensor``, ``.self_int``);
    ``max_rows``: repeats of this many rows or more decline (``None``: no limit).
    """

    def expand_rows(repeats: torch.Tensor, output_size: int | None, values: torch.Tensor | None) -> torch.Tensor:
        if max_rows is not None and repeats.shape[0] >= max_rows:
            raise Decline(f"{max_rows} or more repeats: more rows than the kernel addresses")
        if output_size is not None:
            if checks.enabled():
                check_output_size(repeats, output_size)
            if output_size == 0:
                return expanded(repeats if values is None else values, 0)
        return expand(repeats, output_size, values)

    def repeat_interleave_tensor(repeats: torch.Tensor, output_size: int | None = None) -> torch.Tensor:
        """``torch.repeat_interleave(repeats, output_size=...)``: ``[0]*r0 + [1]*r1 + ...``."""
        if not repeats_ok(repeats):
            raise Decline("repeats must be a 1-D int32/int64 tensor: the native kernel raises torch's error")
        if repeats.shape[0] == 0:
            return torch.empty(0, dtype=repeats.dtype, device=repeats.device)
        return expand_rows(repeats, output_size, None)

    def by_scalar_tensor(source: torch.Tensor, dim: int, repeats: torch.Tensor,
                         output_size: int | None) -> torch.Tensor:
        """One repeat count held on the device: ``output_size`` given (checks off) means no sync."""
        if output_size is None or checks.enabled():
            count = int(repeats[0])  # the one sync computing the size needs
            if count < 0:
                raise RuntimeError("repeats can not be negative")
            expected = source.shape[dim] * count
            if output_size is not None and output_size != expected:
                raise RuntimeError("allocated size does not match required size")
            output_size = expected
        out = _along(source, dim, output_size)
        if out.numel():
            gather(out, source, dim, None, repeats)
        return out

    def repeat_interleave_self_tensor(self: torch.Tensor, repeats: torch.Tensor, dim: int | None = None,
                                      output_size: int | None = None) -> torch.Tensor:
        """``x.repeat_interleave(repeats, dim)`` with a tensor of repeats (one, or one per slice)."""
        prepared = flatten(self, dim)
        if (prepared is None or needs_autograd(self) or self.dtype not in dtypes
                or repeats.dtype not in REPEATS_DTYPES or repeats.dim() > 1 or repeats.device != self.device):
            raise Decline("invalid arguments or autograd: the native composite handles it")
        source, dim = prepared
        if repeats.numel() == 1 and source.shape[dim] == 0:
            return _along(source, dim, 0)  # torch expands the repeat to no rows: nothing is checked
        if repeats.numel() == 1 and source.shape[dim] != 1:
            return by_scalar_tensor(source, dim, repeats.reshape(1), output_size)
        if repeats.dim() == 0 or repeats.shape[0] != source.shape[dim]:
            raise Decline("repeats size mismatch: the native composite raises torch's error")
        if source.dim() == 1 and source.shape[0]:
            return expand_rows(repeats, output_size, source)
        rows = repeat_interleave_tensor(repeats, output_size) if repeats.shape[0] else repeats
        out = _along(source, dim, rows.shape[0])
        if out.numel():
            gather(out, source, dim, rows, None)
        return out

    def repeat_interleave_self_int(self: torch.Tensor, repeats: int, dim: int | None = None,
                                   output_size: int | None = None) -> torch.Tensor:
        """``x.repeat_interleave(r, dim)`` with a Python int: no tensor of repeats at all."""
        prepared = flatten(self, dim)
        if prepared is None or repeats < 0 or needs_autograd(self) or self.dtype not in dtypes:
            raise Decline("invalid arguments or autograd: the native composite handles it")
        source, dim = prepared
        total = source.shape[dim] * repeats
        if output_size is not None and output_size != total:
            raise Decline("wrong output_size: the native composite raises torch's error")
        out = _along(source, dim, total)
        if out.numel():
            gather(out, source, dim, None, repeats)
        return out

    return repeat_interleave_tensor, repeat_interleave_self_tensor, repeat_interleave_self_int
