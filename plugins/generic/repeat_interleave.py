"""``aten::repeat_interleave``: the ``.Tensor``, ``.self_Tensor`` and ``.self_int`` overloads.

* **output_size honoured**: when it is given, no overload reads anything back
  from the device (no ``.item()``, no host synchronisation), so the call can be
  captured in a CUDA graph. Without it, exactly one synchronisation reads the
  total and the smallest repeat together.
* **Load-balanced**: the output is cut into equal spans, one program each
  (not one program per repeats element with a serial loop). Two kernels:

  - ``_fused_expand_kernel`` (``output_size`` known, at most
    ``FUSED_MAX_ROWS`` rows): one launch, no ``cumsum``. Each program scans
    ``repeats`` up to the end of its span (``tl.cumsum`` per tile), marks
    where each row starts inside its span, and a running max over the span
    turns the marks into row ids. At these sizes the call is bound by host
    launch cost (cumsum + our launch was 28.6 µs against torch's 12.5 µs on
    the seed case, H200), so one launch is what pays.
  - ``_expand_kernel`` (otherwise): ``torch.cumsum`` first, then every
    output element binary-searches it in its own lane.
* **Never out of bounds**: a wrong ``output_size`` or a negative repeat can
  only produce unspecified values inside the output. With checks on (CPU
  interpreter, ``FLAGGEMS_CHECK_INDICES=1``) they raise torch's RuntimeError.
* Scalar-tensor repeats (one element) with ``output_size`` known: the kernel
  reads the repeat count on the device.
* ``self_int`` / ``self_Tensor`` are CompositeImplicitAutograd in torch: a
  call that needs autograd declines to the native composite, which records
  the graph.
"""

# ruff: noqa: N803 - constexpr parameters are UPPER_CASE, as in every Triton kernel
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from flaggems import Decline
from flaggems.toolkit import checks
from flaggems.toolkit.indexing import INDEX_DIVIDE_INT, INDEX_DIVIDE_TENSOR, index_along_dim
from flaggems.toolkit.launch import FastLauncher
from flaggems.toolkit.strided import SUPPORTED_DTYPES

BLOCK = 1024


@triton.jit(do_not_specialize=("total", "n", "steps", "values_stride"))
def _expand_kernel(cumsum, out, values, total: tl.int64, n: tl.int64, steps: tl.int64, values_stride: tl.int64,
                   BLOCK: tl.constexpr, GATHER: tl.constexpr):
    """``out[p]`` = the row ``i`` with ``cumsum[i-1] <= p < cumsum[i]`` (or ``values[i]`` when gathering)."""
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = p < total
    lo = tl.zeros((BLOCK,), dtype=tl.int64)
    hi = tl.zeros((BLOCK,), dtype=tl.int64) + n
    for _ in range(steps):
        mid = (lo + hi) // 2
        ends = tl.load(cumsum + mid, mask=live & (mid < n), other=0)
        right = ends <= p
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right, hi, mid)
    row = tl.minimum(lo, n - 1)  # p beyond cumsum[-1] (a wrong output_size) stays in bounds
    if GATHER:
        tl.store(out + p, tl.load(values + row * values_stride, mask=live), mask=live)
    else:
        tl.store(out + p, row.to(out.dtype.element_ty), mask=live)


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit(do_not_specialize=("n", "total", "span", "repeats_stride", "values_stride"))
def _fused_expand_kernel(repeats, out, values, scratch, n: tl.int64, total: tl.int64, span: tl.int64,
                         repeats_stride: tl.int64, values_stride: tl.int64,
                         BLOCK: tl.constexpr, GATHER: tl.constexpr, MARKS: tl.constexpr):
    """``out[p0:p1]`` of this program's span, straight from ``repeats`` (no cumsum array).

    1. The span is filled with -1. 2. ``repeats`` is scanned tile by tile
    until the rows start past the span: ``carry`` counts the rows that start
    at or before ``p0`` and every row with repeats that starts inside the span
    writes its id where it starts. 3. A running max over the span gives each
    position the last row that started at or before it: its row.
    ``MARKS`` 32/64 keeps the marks in ``out`` itself (read back as that
    integer type, element by element before being overwritten); 0 uses
    ``scratch``.
    """
    p0 = tl.program_id(0).to(tl.int64) * span
    p1 = tl.minimum(p0 + span, total)
    if MARKS == 64:
        marks = out.to(tl.pointer_type(tl.int64))
    elif MARKS == 32:
        marks = out.to(tl.pointer_type(tl.int32))
    else:
        marks = scratch
    lanes = tl.arange(0, BLOCK)
    for q in range(p0, p1, BLOCK):
        tl.store(marks + q + lanes, tl.full([BLOCK], -1, marks.dtype.element_ty), mask=q + lanes < p1)
    tl.debug_barrier()  # the marks below must land after the fill
    base = p0 * 0
    count = p0 * 0
    r0 = p0 * 0
    while (r0 < n) & (base < p1):
        r = r0 + lanes
        live = r < n
        rep = tl.load(repeats + r * repeats_stride, mask=live, other=0).to(tl.int64)
        tile_sum = tl.sum(rep, 0)
        if base + tile_sum <= p0:  # the whole tile starts before the span: count it, no scan
            count += tl.minimum(n - r0, BLOCK)
        else:
            start = base + tl.cumsum(rep, 0) - rep
            count += tl.sum(((start <= p0) & live).to(tl.int64), 0)
            starts_here = live & (rep > 0) & (start >= p0) & (start < p1)
            tl.store(marks + start, r.to(marks.dtype.element_ty), mask=starts_here)
        base += tile_sum
        r0 += BLOCK
    tl.debug_barrier()  # every mark of the span is visible before it is read
    carry = count - 1
    for q in range(p0, p1, BLOCK):
        p = q + lanes
        live = p < p1
        rows = tl.maximum(tl.associative_scan(tl.load(marks + p, mask=live, other=-1).to(tl.int64), 0, _max), carry)
        carry = tl.max(rows, 0)
        row = tl.minimum(tl.maximum(rows, 0), n - 1)  # negative repeats or a wrong size stay in bounds
        if GATHER:
            tl.store(out + p, tl.load(values + row * values_stride, mask=live), mask=live)
        else:
            tl.store(out + p, row.to(out.dtype.element_ty), mask=live)


#: Most rows the fused kernel takes: every program scans up to all of them
#: (a tile of ``FUSED_BLOCK`` a step), so beyond this cumsum + search wins.
FUSED_MAX_ROWS = 1 << 16
FUSED_BLOCK = 4096
FUSED_WARPS = 8
#: Rows a program may have to scan per element of its span: the span grows with ``n``
#: so the scan never costs more than the output it serves.
ROWS_PER_SPAN_ELEMENT = 4

_LAUNCHERS: dict[tuple, FastLauncher] = {}


def _launcher(gather: bool) -> FastLauncher:
    launcher = _LAUNCHERS.get(gather)
    if launcher is None:
        launcher = _LAUNCHERS[gather] = FastLauncher(_expand_kernel, {"BLOCK": BLOCK, "GATHER": gather}, num_warps=4)
    return launcher


def _fused_launcher(gather: bool, marks: int) -> FastLauncher:
    key = ("fused", gather, marks)
    launcher = _LAUNCHERS.get(key)
    if launcher is None:
        launcher = _LAUNCHERS[key] = FastLauncher(
            _fused_expand_kernel, {"BLOCK": FUSED_BLOCK, "GATHER": gather, "MARKS": marks}, num_warps=FUSED_WARPS)
    return launcher


def _span(n: int) -> int:
    """Output elements per program of the fused kernel."""
    return FUSED_BLOCK * max(1, -(-n // (ROWS_PER_SPAN_ELEMENT * FUSED_BLOCK)))


def _expand_fused(repeats: torch.Tensor, total: int, values: torch.Tensor | None) -> torch.Tensor:
    """One launch when ``output_size`` is trusted (no checks) and ``repeats`` is short."""
    source = repeats if values is None else values
    out = torch.empty(total, dtype=source.dtype, device=source.device)
    if total:
        width = out.element_size()
        marks = 64 if width == 8 else 32 if width == 4 else 0
        scratch = out if marks else torch.empty(total, dtype=torch.int32, device=out.device)
        span = _span(repeats.shape[0])
        gather = values is not None
        _fused_launcher(gather, marks)(((total + span - 1) // span,), repeats, out, values if gather else out,
                                       scratch, repeats.shape[0], total, span, repeats.stride(0),
                                       values.stride(0) if gather else 0)
    return out


def _total(repeats: torch.Tensor, cumsum: torch.Tensor, output_size: int | None) -> int:
    """The output length: ``output_size`` without a sync, else one read of (total, min)."""
    if output_size is not None and not checks.enabled():
        return output_size
    total, smallest = torch.stack((cumsum[-1], repeats.min().to(torch.int64))).tolist()
    if smallest < 0:
        raise RuntimeError("repeats can not be negative")
    if output_size is not None and output_size != total:
        raise RuntimeError("allocated size does not match required size")
    return total


def _expand(repeats: torch.Tensor, output_size: int | None, values: torch.Tensor | None) -> torch.Tensor:
    """Row ids (or ``values`` gathered by them) repeated ``repeats`` times each."""
    if output_size is not None and repeats.shape[0] <= FUSED_MAX_ROWS and not checks.enabled():
        return _expand_fused(repeats, output_size, values)
    cumsum = torch.cumsum(repeats, 0)
    total = _total(repeats, cumsum, output_size)
    source = repeats if values is None else values
    out = torch.empty(total, dtype=source.dtype, device=source.device)
    n = repeats.shape[0]
    if total:
        steps = max(math.ceil(math.log2(n + 1)), 1)
        gather = values is not None
        _launcher(gather)((triton.cdiv(total, BLOCK),), cumsum, out, values if gather else out, total, n, steps,
                          values.stride(0) if gather else 0)
    return out


def _repeats_ok(repeats: torch.Tensor) -> bool:
    return repeats.dim() == 1 and repeats.dtype in (torch.int32, torch.int64) and repeats.layout == torch.strided


def repeat_interleave_tensor(repeats: torch.Tensor, output_size: int | None = None) -> torch.Tensor:
    """``torch.repeat_interleave(repeats, output_size=...)``: ``[0]*r0 + [1]*r1 + ...``."""
    if not _repeats_ok(repeats):
        raise Decline("repeats must be a 1-D int32/int64 tensor: the native kernel raises torch's error")
    if repeats.shape[0] == 0:
        return torch.empty(0, dtype=repeats.dtype, device=repeats.device)
    return _expand(repeats, output_size, None)


def _needs_autograd(tensor: torch.Tensor) -> bool:
    return tensor.requires_grad and torch.is_grad_enabled()


def _flatten(self: torch.Tensor, dim: int | None) -> tuple[torch.Tensor, int] | None:
    """The input and dimension to repeat along (``dim=None`` flattens); None if dim is invalid."""
    if dim is None:
        return self.reshape(-1), 0
    wrap = max(self.dim(), 1)
    if not -wrap <= dim < wrap:
        return None
    return (self.reshape(1) if self.dim() == 0 else self), dim % wrap


def repeat_interleave_self_int(self: torch.Tensor, repeats: int, dim: int | None = None,
                               output_size: int | None = None) -> torch.Tensor:
    """``x.repeat_interleave(r, dim)`` with a Python int: no tensor of repeats at all."""
    prepared = _flatten(self, dim)
    if prepared is None or repeats < 0 or _needs_autograd(self) or self.dtype not in SUPPORTED_DTYPES:
        raise Decline("invalid arguments or autograd: the native composite handles it")
    source, dim = prepared
    total = source.shape[dim] * repeats
    if output_size is not None and output_size != total:
        raise Decline("wrong output_size: the native composite raises torch's error")
    shape = list(source.shape)
    shape[dim] = total
    out = torch.empty(shape, dtype=self.dtype, device=self.device)
    if out.numel() and not index_along_dim(out, source, dim, out, False, INDEX_DIVIDE_INT, repeats):
        raise Decline("layout needs more than 2 outer or 2 inner dimensions")
    return out


def repeat_interleave_self_tensor(self: torch.Tensor, repeats: torch.Tensor, dim: int | None = None,
                                  output_size: int | None = None) -> torch.Tensor:
    """``x.repeat_interleave(repeats, dim)`` with a tensor of repeats (one, or one per slice)."""
    prepared = _flatten(self, dim)
    if (prepared is None or _needs_autograd(self) or self.dtype not in SUPPORTED_DTYPES
            or repeats.dtype not in (torch.int32, torch.int64) or repeats.dim() > 1
            or repeats.device != self.device):
        raise Decline("invalid arguments or autograd: the native composite handles it")
    source, dim = prepared
    if repeats.numel() == 1 and source.shape[dim] != 1:
        return _repeat_by_scalar_tensor(source, dim, repeats.reshape(1), output_size)
    if repeats.dim() == 0 or repeats.shape[0] != source.shape[dim]:
        raise Decline("repeats size mismatch: the native composite raises torch's error")
    if source.dim() == 1 and source.shape[0]:
        return _expand(repeats, output_size, source)
    rows = repeat_interleave_tensor(repeats, output_size) if repeats.shape[0] else repeats
    return _gather(source, dim, rows)


def _repeat_by_scalar_tensor(source: torch.Tensor, dim: int, repeats: torch.Tensor,
                             output_size: int | None) -> torch.Tensor:
    """One repeat count held on the device: ``output_size`` given means no sync."""
    if output_size is None or checks.enabled():
        count = int(repeats[0])  # the one sync computing the size needs
        if count < 0:
            raise RuntimeError("repeats can not be negative")
        expected = source.shape[dim] * count
        if output_size is not None and output_size != expected:
            raise RuntimeError("allocated size does not match required size")
        output_size = expected
    shape = list(source.shape)
    shape[dim] = output_size
    out = torch.empty(shape, dtype=source.dtype, device=source.device)
    if out.numel() and not index_along_dim(out, source, dim, repeats, False, INDEX_DIVIDE_TENSOR):
        raise Decline("layout needs more than 2 outer or 2 inner dimensions")
    return out


def _gather(source: torch.Tensor, dim: int, rows: torch.Tensor) -> torch.Tensor:
    shape = list(source.shape)
    shape[dim] = rows.shape[0]
    out = torch.empty(shape, dtype=source.dtype, device=source.device)
    if out.numel() and not index_along_dim(out, source, dim, rows, scatter=False):
        raise Decline("layout needs more than 2 outer or 2 inner dimensions")
    return out
