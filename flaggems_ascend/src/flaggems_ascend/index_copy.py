"""``index_copy_`` / ``index_copy`` on Ascend NPUs: torch's semantics from :mod:`flaggems.fronts.index_copy`.

The target is viewed as ``[outer, dim_size, inner]`` (the dimensions before,
at and after ``dim``) and ``source`` as ``[outer, n, inner]``; row ``j`` of
``source`` goes to row ``index[j]``. Two kernels, both looping over their
tiles with a grid capped at the programs the device runs at once: its AI-core
count on an NPU (one program per core; more programs only queue), the
resident programs of its multiprocessors when simulated on a GPU:

* **flat** (``inner <= 4``): one source element per lane, its destination
  computed from its ``(o, j, i)`` coordinates; the block grows with the
  workload (short rows leave a row kernel's lanes mostly idle);
* **rows** (wider suffixes): ``[BLOCK_R, BLOCK_C]`` tiles of whole rows, each
  row's destination found once from ``index``.

Offsets are 64-bit and the sizes and the index's stride are runtime
arguments (no compile per shape; a strided index such as ``base[1::2]`` is
read where its elements are). An index outside ``[0, dim_size)`` is never written (the generic
op's contract: ``FLAGGEMS_CHECK_INDICES=1`` raises torch's IndexError first).
Nothing launches for an empty index or empty rows.

Contract: the target (``self`` in place; the fresh contiguous result out of
place) must be contiguous: a strided ``self`` in place declines to the next
implementation (the generic kernels, which take any layout). A strided
``source`` is first copied dense by the toolkit's copy kernel. float64 never
arrives: the backend declares it unsupported, so the core sends it to torch_npu.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from flaggems import Decline
from flaggems.fronts import index_copy as front
from flaggems.toolkit import context
from flaggems.toolkit.launch import FastLauncher
from flaggems.toolkit.layout import cdiv, next_pow2
from flaggems.toolkit.strided import strided_copy

#: Programs when the backend reports no AI-core count (an Ascend 910B has 24 AI cores).
DEFAULT_CORES = 24
#: Warps per program (on an NPU, Triton-Ascend maps a program to one AI core whatever this says).
WARPS = 4
#: The flat kernel serves rows of at most this many elements.
FLAT_MAX_INNER = 4
#: Flat-kernel block sizes: the workload's elements spread over the cores, within these bounds.
FLAT_MIN_BLOCK, FLAT_MAX_BLOCK = 256, 4096
#: Row-kernel tiles: elements per tile and widest column block.
ROW_TILE, ROW_MAX_COLS = 4096, 1024

#: On a GPU standing in for the NPU, the Ascend kernels serve only in-place calls of at most this many
#: source elements. Measured on an H200: index_copy_ [64, 64] dim 1 (2048 elements) 4.7-5.3 µs against the
#: generic kernels' 5.7; every out-of-place or larger shape of the seed table went faster through the
#: generic ones (1.1-4.5x: their inverse-index gather and L2-grouped scatter are GPU designs).
GPU_INPLACE_MAX = 4096

_SCALARS = ("index_stride", "outer", "n", "inner", "dim_size", "total", "tiles", "col_tiles")


@triton.jit(do_not_specialize=_SCALARS)
def _flat_kernel(dst, src, index, index_stride, outer, n, inner, dim_size, total, tiles, BLOCK: tl.constexpr):
    """``dst[o, index[j], i] = src[o, j, i]`` one element per lane, tiles walked by a grid-stride loop."""
    for tile in range(tl.program_id(0).to(tl.int64), tiles, tl.num_programs(0).to(tl.int64)):  # int64 offsets
        e = tile * BLOCK + tl.arange(0, BLOCK)
        live = e < total
        i = e % inner
        row = e // inner
        j = row % n
        o = row // n
        idx = tl.load(index + j * index_stride, mask=live, other=-1)
        ok = live & (idx >= 0) & (idx < dim_size)
        value = tl.load(src + e, mask=live)
        tl.store(dst + (o * dim_size + idx) * inner + i, value, mask=ok)


@triton.jit(do_not_specialize=_SCALARS)
def _row_kernel(dst, src, index, index_stride, outer, n, inner, dim_size, tiles, col_tiles,
                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """``[BLOCK_R, BLOCK_C]`` tiles of whole source rows; each row's destination row read once."""
    for tile in range(tl.program_id(0).to(tl.int64), tiles, tl.num_programs(0).to(tl.int64)):  # int64 offsets
        rows = (tile // col_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = (tile % col_tiles) * BLOCK_C + tl.arange(0, BLOCK_C)
        live_r = rows < outer * n
        j = rows % n
        o = rows // n
        idx = tl.load(index + j * index_stride, mask=live_r, other=-1)
        ok_r = live_r & (idx >= 0) & (idx < dim_size)
        live_c = cols < inner
        src_at = rows[:, None] * inner + cols[None, :]
        dst_at = (o * dim_size + idx)[:, None] * inner + cols[None, :]
        value = tl.load(src + src_at, mask=live_r[:, None] & live_c[None, :])
        tl.store(dst + dst_at, value, mask=ok_r[:, None] & live_c[None, :])


_LAUNCHERS: dict[tuple, FastLauncher] = context.cache()


def _launcher(kernel: object, **constexprs: int) -> FastLauncher:
    key = (kernel, *sorted(constexprs.items()))
    found = _LAUNCHERS.get(key)
    if found is None:
        found = _LAUNCHERS[key] = FastLauncher(kernel, constexprs, num_warps=WARPS)
    return found


def ai_cores(device: torch.device) -> int:
    """Programs the device runs at once: its AI cores, one program each (device facts; :data:`DEFAULT_CORES`
    when not reported). Simulated on a GPU, the GPU's facts say how many 4-warp programs it keeps resident.
    """
    facts = context.current().facts(device.index or 0)
    return facts.resident_programs(WARPS * facts.warp_size) or DEFAULT_CORES


def flat_block(total: int, cores: int) -> int:
    """The flat kernel's block: the elements spread over ``cores`` programs, a power of two in bounds."""
    return min(max(next_pow2(cdiv(total, cores)), FLAT_MIN_BLOCK), FLAT_MAX_BLOCK)


def row_tile(inner: int) -> tuple[int, int]:
    """``(BLOCK_R, BLOCK_C)`` of the row kernel for rows of ``inner`` elements."""
    block_c = min(next_pow2(inner), ROW_MAX_COLS)
    return max(ROW_TILE // block_c, 1), block_c


def generic_is_faster(device_type: str, inplace: bool, source_numel: int) -> bool:
    """Whether the generic kernels measured faster for such a call on this device (GPUs only, see above).

    On an NPU the Ascend kernels serve every call: on a 910B the seed benchmark completed only with them
    (in place 1.40x torch_npu, out of place 0.99x).
    """
    if device_type != "cuda":
        return False
    return not inplace or source_numel > GPU_INPLACE_MAX


def supports_in_place(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor) -> bool | str:
    """``index_copy_``: every call on an NPU; on a GPU standing in for one, small ones (:data:`GPU_INPLACE_MAX`)."""
    if generic_is_faster(self.device.type, True, source.numel()):
        return f"on a GPU the generic kernels measured faster above {GPU_INPLACE_MAX} source elements"
    return True


def supports_out_of_place(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor) -> bool | str:
    """``index_copy``: every call on an NPU; none on a GPU standing in for one (the generic gather was faster)."""
    if generic_is_faster(self.device.type, False, source.numel()):
        return "on a GPU the generic kernels measured faster out of place"
    return True


def scatter(call: front.Call) -> None:
    """Write ``call.source``'s rows into ``call.target`` (see the module docstring for the contract)."""
    self, dim, index, source, out = call.self, call.dim, call.index, call.source, call.out
    if out is None and not self.is_contiguous():
        raise Decline("self is not contiguous: the Ascend kernels address a dense target (generic serves it)")
    if out is not None and out.numel():
        strided_copy(out, self)
    target = call.target
    shape = target.shape
    outer, dim_size, n = math.prod(shape[:dim]), shape[dim], index.numel()
    inner = math.prod(shape[dim + 1:])
    total = outer * n * inner
    if total == 0:
        return
    src = source if source.is_contiguous() else _dense(source)
    cores = ai_cores(target.device)
    if inner <= FLAT_MAX_INNER:
        block = flat_block(total, cores)
        tiles = cdiv(total, block)
        _launcher(_flat_kernel, BLOCK=block)((min(tiles, cores),), target, src, index, index.stride(0), outer, n,
                                             inner, dim_size, total, tiles)
        return
    block_r, block_c = row_tile(inner)
    col_tiles = cdiv(inner, block_c)
    tiles = cdiv(outer * n, block_r) * col_tiles
    _launcher(_row_kernel, BLOCK_R=block_r, BLOCK_C=block_c)((min(tiles, cores),), target, src, index,
                                                             index.stride(0), outer, n, inner, dim_size, tiles,
                                                             col_tiles)


def _dense(source: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``source`` by the toolkit's copy kernel (no torch op re-entering flaggems)."""
    dense = torch.empty_like(source, memory_format=torch.contiguous_format)
    strided_copy(dense, source)
    return dense


index_copy_, index_copy = front.entries(scatter)
