"""``aten::index_copy_`` and ``aten::index_copy``: scatter rows along a dimension.

``self[..., index[j], ...] = source[..., j, ...]`` through the toolkit's
gather/scatter kernel, which addresses ``self`` and ``source`` with their real
strides (a transposed or sliced tensor is written in place, never through a
copy: the known peer implementation derived offsets from the source's storage
offset and was silently wrong there). The out-of-place form copies ``self``
with the toolkit's strided copy (a flat kernel when dense), then scatters.

Small out-of-place calls take one launch instead (``_by_search``): a gather
over the destination in which each row looks itself up in the index
(``INDEX_SEARCH``), writing ``source``'s row where found and ``self``'s
elsewhere. It applies while rows x index entries stay within
``SEARCH_MAX_PAIRS``, the bound below which it is faster: on an H200, GPU
time of a CUDA graph replay per call 1.75-3.01 µs against 2.65-3.50 for the
copy and scatter and 2.67-4.09 for torch (11 shapes); host time per call
17.0-27.6 µs against 24.7-34.1 (torch 21.3-28.3). At 2**21 pairs the search
is slower on the GPU (4.16 against 2.82 µs).

Large workloads turn the scatter around (``_by_inverse``): a small kernel
records, for each position ``d`` along ``dim``, the ``j`` with ``index[j] == d``
(the inverse index), then a gather runs in the destination's order. Out of
place it writes every destination element once, ``source[..., j, ...]`` where
``d`` is indexed and ``self``'s element elsewhere: no separate copy of ``self``
(``2 x size`` bytes moved instead of ``2 x (size + indexed)``). In place it is
used for narrow rows (under 32 bytes, a partial sector each) and writes only
the indexed positions, in order, whatever the index's order (reading and
rewriting the other positions too would cost twice the time on a sorted
index: [4096, 4096] dim 1 fp16 on an H200, 73 against 39 µs). An index that
never decreases writes in order through the plain scatter too, which is
faster there (18.0 against 32.9 µs; a random index: 119.4 against 44.2).
The inverse kernel flags a decreasing index, and one launch
(:func:`~flaggems.toolkit.indexing.scatter_or_gather`) takes the scatter or
the gather on the device: no host synchronisation, no launch left empty.
The measurements are in benchmarks/RESULTS.md.

torch's semantics (argument checks that decline to the native kernel, which
raises torch's exact error; dim wrapping; overlap declines; the index range
check; the contiguous out-of-place result) live in the public front
:mod:`flaggems.fronts.index_copy`, which a vendor's kernel uses too. Out-of-range indices: see
:mod:`flaggems.toolkit.checks` (IndexError when checking; masked otherwise).
Duplicate indices: one of the candidates wins, unspecified (as in torch).
Empty index or source: no kernel launch.
"""

# ruff: noqa: N803 - constexpr parameters are UPPER_CASE, as in every Triton kernel
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from flaggems import Decline
from flaggems.fronts import index_copy as index_copy_front
from flaggems.toolkit import cdiv, partition
from flaggems.toolkit.indexing import INDEX_SEARCH, index_along_dim, scatter_or_gather
from flaggems.toolkit.launch import FastLauncher
from flaggems.toolkit.layout import SECTOR_BYTES
from flaggems.toolkit.strided import strided_copy

#: The inverse-index form is used from this many destination elements on (below, the extra launch
#: of the inverse shows), when ``dim`` has at most 1/``INVERSE_DIM_SHARE`` of them (the inverse
#: costs 4 bytes a position along ``dim``: a 1-D scatter keeps the plain form).
INVERSE_MIN_ELEMENTS = 1 << 20
INVERSE_DIM_SHARE = 8
#: Out of place, the scatter runs as one gather that searches the index (``_by_search``) while the
#: rows (positions outside the inner dimensions) times the index length are at most this. On an H200,
#: at 2**20 pairs it was faster on the GPU in all 6 shapes measured; at 2**21 and beyond, slower.
SEARCH_MAX_PAIRS = 1 << 20
#: In place, the inverse form is used for rows narrower than one memory sector (``SECTOR_BYTES``),
#: which the plain scatter writes as partial sectors in the index's order; the gather writes them
#: in order.
INVERT_BLOCK = 1024
#: Up to this many positions plus indices, one program builds the inverse (fill, then scatter): a
#: launch less, which is what a mid-size call's time is made of on a slow host (index_copy
#: [4096, 4096] dim 0 took 43 µs on one host, 81 on another, with a separate fill).
ONE_PROGRAM_LIMIT = 1 << 17


@triton.jit(do_not_specialize=("n", "size", "stride"))
def _invert_kernel(index, inverse, n, size, stride, BLOCK: tl.constexpr, ONE_PROGRAM: tl.constexpr,
                   ORDER: tl.constexpr):
    """``inverse[index[j]] = j`` for every in-range ``index[j]`` (duplicates: one ``j`` wins, unspecified).

    ``ONE_PROGRAM``: a single program first fills ``inverse`` with -1, then
    (after a barrier, which orders the two within the program) scatters every
    ``j``: no separate fill launch. Otherwise program ``p`` scatters block ``p``
    into an ``inverse`` filled beforehand. ``ORDER``: also set
    ``inverse[size]`` to 1 where ``index`` decreases somewhere (one program:
    it writes 0 otherwise; by blocks, the fill's -1 stays).
    """
    lanes = tl.arange(0, BLOCK)
    if ONE_PROGRAM:
        for start in range(0, size, BLOCK):
            tl.store(inverse + start + lanes, tl.full((BLOCK,), -1, tl.int32), mask=start + lanes < size)
        tl.debug_barrier()
        decreases = 0
        for start in range(0, n, BLOCK):
            decreases |= _scatter_positions(index, inverse, start + lanes, n, size, stride, ORDER)
        if ORDER:
            tl.store(inverse + size, decreases)
    else:
        decreases = _scatter_positions(index, inverse, tl.program_id(0) * BLOCK + lanes, n, size, stride, ORDER)
        if ORDER:
            if decreases:
                tl.atomic_max(inverse + size, 1)


@triton.jit
def _scatter_positions(index, inverse, j, n, size, stride, ORDER: tl.constexpr):
    """``inverse[index[j]] = j`` for the positions ``j`` below ``n`` whose index is in ``[0, size)``.

    Returns 1 where ``ORDER`` and some ``index[j - 1] > index[j]`` (0 otherwise).
    """
    live = j < n
    offsets = j.to(tl.int64) * stride
    d = tl.load(index + offsets, mask=live, other=-1)
    tl.store(inverse + d, j, mask=live & (d >= 0) & (d < size))
    decreases = 0
    if ORDER:
        before = tl.load(index + offsets - stride, mask=live & (j > 0), other=-(2**62))
        decreases = tl.max((before > d).to(tl.int32), 0)
    return decreases


_INVERT: dict[tuple[bool, bool], FastLauncher] = {}


def _inverse(index: torch.Tensor, size: int, order: bool = False) -> torch.Tensor:
    """int32 ``[size]``: the ``j`` with ``index[j] == d`` at each ``d``, ``-1`` where none.

    One launch up to ``ONE_PROGRAM_LIMIT`` positions and indices together;
    beyond, a fill and a launch with one program per block of indices. With
    ``order``, one element more: positive where ``index`` decreases
    somewhere (read on the device, never by the host).
    """
    n = index.numel()
    one_program = size + n <= ONE_PROGRAM_LIMIT
    launch = _INVERT.get((one_program, order))
    if launch is None:
        launch = _INVERT[(one_program, order)] = FastLauncher(
            _invert_kernel, {"BLOCK": INVERT_BLOCK, "ONE_PROGRAM": one_program, "ORDER": order}, num_warps=4)
    length = size + 1 if order else size
    if one_program:
        inverse = torch.empty(length, dtype=torch.int32, device=index.device)
        grid = (1,)
    else:
        inverse = torch.full((length,), -1, dtype=torch.int32, device=index.device)
        grid = (cdiv(n, INVERT_BLOCK),)
    launch(grid, index, inverse, n, size, index.stride(0) if index.dim() else 0)
    return inverse


def _by_inverse(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor,
                out: torch.Tensor | None) -> bool:
    """The scatter as a gather over the destination, when it pays (see the module docstring).

    In place (``out`` None) only the indexed positions of ``self`` are
    written, by the plain scatter where the index never decreases (chosen on
    the device); else ``out`` gets ``self``'s values at the others (only when
    ``out`` has ``self``'s strides). Returns False (nothing done) when the
    plain scatter is the better form.
    """
    numel = self.numel()
    if numel < INVERSE_MIN_ELEMENTS:  # first: the one test a small call pays
        return False
    size = self.shape[dim]
    if (source.dim() != self.dim() or size * INVERSE_DIM_SHARE > numel or index.numel() >= 2**31
            or (out is not None and out.stride() != self.stride())):
        return False
    if out is not None:
        return index_along_dim(out, source, dim, _inverse(index, size), scatter=False, fallback=self)
    if math.prod(self.shape[dim + 1:]) * self.element_size() >= SECTOR_BYTES:
        return False  # in place, wide rows already scatter whole sectors, and only the indexed ones
    inverse = _inverse(index, size, order=True)  # the gather reads only its first ``size`` elements
    return (scatter_or_gather(self, source, dim, index, inverse)
            or index_along_dim(self, source, dim, inverse, scatter=False, fallback=self))


def _by_search(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor, out: torch.Tensor) -> bool:
    """Out of place, a short index: one gather over ``out`` that searches ``index`` for each position.

    ``out[..., d, ...]`` is ``source[..., k, ...]`` for the last ``k`` with
    ``index[k] == d``, else ``self[..., d, ...]``: every element written once,
    in one launch instead of a copy and a scatter. Only where the comparisons
    (rows x ``len(index)``) stay few (``SEARCH_MAX_PAIRS``) and ``out`` has
    ``self``'s strides (``self``'s element is read at ``out``'s offset).
    Returns False (nothing done) otherwise.
    """
    n = index.numel()
    if self.numel() * n > SEARCH_MAX_PAIRS and self.numel() // math.prod(self.shape[dim + 1:]) * n > SEARCH_MAX_PAIRS:
        return False  # (the first test spares most small calls the product)
    if out.stride() != self.stride():
        return False
    return index_along_dim(out, source, dim, index, scatter=False, mode=INDEX_SEARCH, divisor=n, fallback=self)


def _grouped(target: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor) -> bool:
    """A large scatter of single elements (every other dimension of size 1): grouped by region first.

    See :mod:`flaggems.toolkit.partition` (1-, 2- and 4-byte elements;
    ``partition.applies`` says where it pays). Returns False (nothing done)
    for any other workload, or when its workspace cannot be allocated.
    """
    if index.numel() < partition.min_indices() or target.numel() != target.shape[dim]:
        return False  # the one test most calls pay: no view made
    flat = target.view(-1)
    return partition.applies(flat, index) and partition.grouped_scatter(flat, index, source.view(-1)) is not None


def scatter_rows(call: index_copy_front.Call) -> None:
    """The generic kernels for one validated call (:mod:`flaggems.fronts.index_copy`).

    Out of place, ``call.out`` receives a copy of ``call.self`` with the
    indexed rows replaced.
    """
    self, dim, index, source, out = call.self, call.dim, call.index, call.source, call.out
    if source.numel() and out is not None and _by_search(self, dim, index, source, out):
        return
    if source.numel() and _by_inverse(self, dim, index, source, out):
        return
    target = self
    if out is not None:
        if out.numel():
            strided_copy(out, self)
        target = out
    if source.numel() and _grouped(target, dim, index, source):
        return
    if source.numel() and not index_along_dim(source, target, dim, index, scatter=True):
        raise Decline("layout needs more than 2 outer or 2 inner dimensions")


index_copy_, index_copy = index_copy_front.entries(scatter_rows)
