"""``aten::repeat_interleave``: the ``.Tensor``, ``.self_Tensor`` and ``.self_int`` overloads.

* **output_size honoured**: when it is given, no overload reads anything back
  from the device (no ``.item()``, no host synchronisation), so the call can be
  captured in a CUDA graph. Without it, exactly one synchronisation reads the
  total and the smallest repeat together.
* **Load-balanced**: every program expands one block of ``BLOCK`` output
  elements, whatever the repeats (not one program per repeats element with a
  serial loop). A program needs the row ends (the running sum of
  ``repeats``) and its block's first row. With ``output_size`` known, one
  launch of our own scan (``_scan_kernel``: chunks of rows, each adding its
  predecessors' sums by a decoupled look-back) writes both: the ends, and a
  table of each block's first row (a row stores its own number at the first
  block starting inside it). Without, the same scan gives the ends, the
  total and the smallest repeat (read in the one sync), and a program
  finds its first and last rows by a ``FANOUT``-ary search
  (``FANOUT`` ends compared per step: two steps for 65536 rows). Then the
  rows of each ``SUB``-element sub-block's ends are found among the block's
  rows, then each element's row among its sub-block's few (int32 offsets,
  cache-resident ends).

  Why our own scan: one launch that also tables the blocks' first rows
  spares cub's two-kernel scan (``torch.cumsum``) and a first-row search in
  every expand program. On an H200, seed case (17096 rows -> 854524 items,
  ``output_size`` given): scan 2.34 µs + expand 4.83 µs of GPU time, 12.0 µs
  for the op (do_bench), against torch's 0.75 + 2.21 + 3.49 µs, 12.8 µs. The
  scan orders its chunks by program id (no ticket atomic) and computes a
  chunk's running sum while its predecessors publish theirs. The designs
  measured slower than this one (a whole-array search per element, one fused
  scan-and-expand launch, a ``tl.histogram`` of a block's row ends,
  row-by-row tile stores) are in benchmarks/RESULTS.md.
* **Dependent launch** (:mod:`flaggems.toolkit.dependent_launch`, NVIDIA
  sm_90+): the expand is launched to overlap the scan's end, and waits for
  its writes on the device: in a CUDA graph replay of the seed case, row ids
  take 7.56 µs of GPU time a call against 8.03 without it (torch 7.44).
* **Scan state**: the scan's status words live in
  :func:`flaggems.toolkit.workspace.claim_scratch` (one buffer per stream, so
  concurrent streams do not share it). The expand zeroes them again, and the
  output is allocated before the scan, so nothing between the two launches can
  fail and leave them set; a CUDA graph of the pair replays correctly. The
  stream's lock is held from the scan's launch to the expand's: a call of
  another thread on the same stream waits rather than scanning in between,
  where it would find the words set.
* **Never out of bounds**: a wrong ``output_size`` or a negative repeat can
  only produce unspecified values inside the output. With checks on (CPU
  interpreter, ``FLAGGEMS_CHECK_INDICES=1``) the front raises torch's
  RuntimeError first.
* Scalar-tensor repeats (one element) with ``output_size`` known: the
  gather reads the repeat count on the device.

torch's semantics (argument checks that decline to the native kernel or
composite, autograd declines, ``dim=None`` flattening, the scalar-tensor
repeats' sync, the checks of ``output_size``, the output's allocation, empty
repeats) live in the public front :mod:`flaggems.fronts.repeat_interleave`;
this module supplies its two kernels: the expand (:func:`_expand`) and the
gather along a dim (:func:`_gather`, the toolkit's ``index_along_dim``).
"""

# ruff: noqa: N803 - constexpr parameters are UPPER_CASE, as in every Triton kernel
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flaggems import Decline
from flaggems.fronts import repeat_interleave as front
from flaggems.fronts.repeat_interleave import check_output_size as _checked_output_size  # noqa: F401 - tests patch it
from flaggems.toolkit import cdiv, context, tuning
from flaggems.toolkit.dependent_launch import dependent_launch, gdc_launch_dependents, gdc_wait
from flaggems.toolkit.indexing import INDEX_DIVIDE_INT, INDEX_DIVIDE_TENSOR, index_along_dim
from flaggems.toolkit.launch import FastLauncher
from flaggems.toolkit.recording import host_values
from flaggems.toolkit.workspace import claim_scratch

#: The expand's row offsets are int32: repeats of this many rows or more decline (the front's ``max_rows``).
MAX_ROWS = 2**31

#: Sizes, warps and look-back lanes come from the typed launch policy ``Tuning("scan", ...)``
#: (:class:`flaggems.toolkit.tuning.ScanPolicy`, its measured defaults there) and the device's
#: warp or wavefront width (the kernel context's device facts), resolved once per device.


class _Kernels:
    """The scan policy on one device: its sizes, warps and look-back lanes, and the launchers built from them."""

    def __init__(self, policy: tuning.ScanPolicy, warp_size: int) -> None:
        self.block, self.sub, self.fanout, self.chunk, self.tile = (policy.block, policy.sub, policy.fanout,
                                                                    policy.chunk, policy.tile)
        self.lanes, self.warps = policy.lanes(warp_size), policy.warps(warp_size)
        self._expand: dict[tuple[bool, bool, bool], FastLauncher] = {}
        self._scan: dict[tuple[bool, bool], FastLauncher] = {}

    def expand(self, gather: bool, table: bool, dependent: bool) -> FastLauncher:
        """The expand's launcher; ``dependent``: launched to overlap the scan before it (``launch_pdl``)."""
        launcher = self._expand.get((gather, table, dependent))
        if launcher is None:
            options = {"launch_pdl": True} if dependent else {}
            launcher = self._expand[gather, table, dependent] = FastLauncher(
                _expand_kernel, {"BLOCK": self.block, "SUB": self.sub, "FANOUT": self.fanout, "GATHER": gather,
                                 "TABLE": table, "DEPENDENT": dependent}, num_warps=self.warps, **options)
        return launcher

    def scan(self, dependent: bool, summary: bool) -> FastLauncher:
        """The scan's launcher (``summary``: the output size is unknown, see ``_scan_kernel``)."""
        launcher = self._scan.get((dependent, summary))
        if launcher is None:
            launcher = self._scan[dependent, summary] = FastLauncher(
                _scan_kernel, {"CHUNK": self.chunk, "BLOCK": self.block, "LOOKBACK": self.lanes, "TILE": self.tile,
                               "DEPENDENT": dependent, "SUMMARY": summary}, num_warps=self.warps)
        return launcher

    def rank_steps(self, n: int) -> int:
        """Steps of the ``fanout``-ary search over ``n`` ends: ``ceil(log_fanout(n + 1))``."""
        steps, reach = 1, self.fanout
        while reach < n + 1:
            steps, reach = steps + 1, reach * self.fanout
        return steps


_KERNELS: dict[int | None, _Kernels] = context.cache()  # a new context: new tuning or device facts


def _kernels(device: torch.device) -> _Kernels:
    """The scan policy resolved for ``device`` (cached per device until the kernel context changes)."""
    found = _KERNELS.get(device.index)
    if found is None:
        warp_size = context.current().facts(device.index or 0).warp_size
        found = _KERNELS[device.index] = _Kernels(tuning.policy("scan"), warp_size)
    return found


@triton.jit
def _rank(ends, n, targets, steps, FANOUT: tl.constexpr):
    """For each target, the first row whose end exceeds it (``n`` if none): a ``FANOUT``-ary search.

    ``ends`` is non-decreasing for valid repeats; for invalid ones the result
    is still in ``[0, n]`` and every load in bounds. Each of ``steps``
    (``ceil(log_FANOUT(n + 1))``, from the host) samples ``FANOUT`` ends of the
    live range and keeps the gap the target falls in. Fixed trip counts: a
    ``while`` on a block-wide condition costs a reduction per step. Stopping
    one step short and leaving the rest to the sub-block search was tried
    (H200, kernel alone): 10.2 against 10.6 µs on the seed case (noise), 166
    against 144 µs at 17096 rows -> 50M items.
    """
    lo = targets * 0
    hi = lo + n
    lanes = tl.arange(0, FANOUT)
    for _ in range(steps):
        width = hi - lo
        live = width > 0
        at = lo[:, None] + (lanes[None, :] * width[:, None]) // FANOUT
        ok = live[:, None] & (at < n)
        below = ok & (tl.load(ends + at, mask=ok, other=0) <= targets[:, None])
        count = tl.sum(below.to(tl.int64), 1)
        new_hi = tl.where(count < FANOUT, lo + (count * width) // FANOUT, hi)
        new_lo = tl.where(count > 0, lo + ((count - 1) * width) // FANOUT + 1, lo)
        lo = tl.where(live, new_lo, lo)
        hi = tl.where(live, tl.maximum(new_hi, new_lo), hi)
    return lo


@triton.jit
def _halvings(width):
    """Halvings that shrink a search interval of ``width`` rows to none: the bit length of ``width``."""
    steps = width * 0
    while width > 0:
        width = width // 2
        steps += 1
    return steps


@triton.jit
def _bisect(ends, lo, hi, targets, steps, live):
    """For each target, the first row in ``[lo, hi)`` whose end exceeds it (``hi`` if none).

    ``steps`` must be at least the bit length of ``hi - lo``; every load stays
    in ``[lo, hi)``, so invalid (non-monotonic) ends give a row in range.
    """
    for _ in range(steps):
        mid = (lo + hi) // 2
        open_ = mid < hi
        right = tl.load(ends + mid, mask=live & open_, other=0) <= targets
        lo = tl.where(right & open_, mid + 1, lo)
        hi = tl.where(right, hi, mid)
    return lo


@triton.jit(do_not_specialize=("total", "n", "rank_steps", "values_stride", "chunks"))
def _expand_kernel(ends, out, values, total: tl.int64, n, rank_steps, values_stride: tl.int64, status, chunks,
                   BLOCK: tl.constexpr, SUB: tl.constexpr, FANOUT: tl.constexpr, GATHER: tl.constexpr,
                   TABLE: tl.constexpr, DEPENDENT: tl.constexpr):
    """``out[p]`` = the row ``i`` with ``ends[i-1] <= p < ends[i]`` (or ``values[i]`` when gathering).

    Three searches, each narrower: the block's first and last rows among all
    ``n``, each sub-block's first and last rows among those, then each
    element's row among its sub-block's. With ``TABLE`` the block's first rows
    are read from the table the scan wrote after ``ends`` (``_scan_kernel``),
    otherwise searched (``_rank``). Rows are int32 offsets from the block's
    first row (the host declines ``n >= 2**31``): the per-element search is
    most of the kernel's instructions. The programs also zero the scan's
    ``chunks`` status words, which the scan left set (none: ``chunks`` 0). With
    ``DEPENDENT`` (a programmatic dependent launch after the scan) it waits
    for the scan's writes before touching memory.
    """
    if DEPENDENT:
        gdc_wait()
    block = tl.program_id(0)
    p0 = block.to(tl.int64) * BLOCK
    # int64 bounds: past 2**21 programs, block * BLOCK overflows int32 (and once wrote below status).
    for start in range(p0, chunks, tl.num_programs(0).to(tl.int64) * BLOCK):
        words = start + tl.arange(0, BLOCK)
        tl.store(status + words, tl.zeros((BLOCK,), dtype=tl.int64), mask=words < chunks)
    if TABLE:
        # Entries are unspecified only for a wrong output_size: clamped, they keep every load in bounds.
        table = ends + n
        first = tl.minimum(tl.maximum(tl.load(table + block), 0), n - 1)
        after = tl.load(table + block + 1, mask=block + 1 < tl.cdiv(total, BLOCK), other=n - 1)
        span = (tl.minimum(tl.maximum(after, first), n - 1) - first).to(tl.int32)
    else:
        edge = tl.arange(0, 2)
        rows = _rank(ends, n, tl.where(edge == 0, p0, tl.minimum(p0 + BLOCK, total) - 1), rank_steps, FANOUT)
        first = tl.sum(tl.where(edge == 0, rows, 0), 0)
        span = (tl.maximum(tl.sum(tl.where(edge == 1, rows, 0), 0), first) - first).to(tl.int32)
    base = ends + first
    sub_p0 = p0 + tl.arange(0, BLOCK // SUB) * SUB
    sub_live = sub_p0 < total
    none = tl.zeros((BLOCK // SUB,), dtype=tl.int32)
    steps = _halvings(span)
    sub_lo = _bisect(base, none, none + span, sub_p0, steps, sub_live)
    sub_hi = _bisect(base, none, none + span, tl.minimum(sub_p0 + SUB, total) - 1, steps, sub_live)
    sub_hi = tl.maximum(sub_hi, sub_lo)
    p = sub_p0[:, None] + tl.arange(0, SUB)[None, :]
    live = p < total
    flat = tl.zeros((1, SUB), dtype=tl.int32)
    offset = _bisect(base, sub_lo[:, None] + flat, sub_hi[:, None] + flat, p,
                     _halvings(tl.max(sub_hi - sub_lo, 0)), live)
    row = tl.minimum(first + offset, n - 1)  # p beyond ends[-1] (a wrong output_size) stays in bounds
    if GATHER:
        result = tl.load(values + row * values_stride, mask=live)
    else:
        result = row.to(out.dtype.element_ty)
    if p0 + BLOCK <= total:  # a full block: no mask, so the stores vectorise (total is not specialised)
        tl.store(out + p, result)
    else:
        tl.store(out + p, result, mask=live)


#: Status of a scan chunk: its sum in the low 60 bits (two's complement), what the sum covers in the
#: two bits above. The sign bit stays clear, so every word is a positive int64 constant.
_VALUE_BITS: tl.constexpr = tl.constexpr(60)
_VALUE_MASK: tl.constexpr = tl.constexpr((1 << 60) - 1)
#: The chunk's own rows (published first, so that later chunks need not wait for its look-back).
_AGGREGATE: tl.constexpr = tl.constexpr(1 << 60)
#: The chunk's rows and every row before them.
_INCLUSIVE: tl.constexpr = tl.constexpr(2 << 60)


@triton.jit
def _publish(status, flag, value):
    """Store ``value`` with ``flag`` in one word, so a reader never sees one without the other."""
    tl.atomic_xchg(status, (value & _VALUE_MASK) | flag, sem="relaxed")


@triton.jit
def _rows_before(status, chunk, LOOKBACK: tl.constexpr):
    """The sum of every chunk before ``chunk``: a decoupled look-back over their status words.

    Reads ``LOOKBACK`` predecessors at a time, nearest first, and adds their
    sums down to the nearest inclusive one; an unpublished word in the way
    means reading again. Positions before chunk 0 read as an inclusive zero,
    so the walk ends there at the latest. Chunks start in program-id order,
    so every predecessor is running or done: the wait ends.
    """
    lanes = tl.arange(0, LOOKBACK)
    before = chunk.to(tl.int64) * 0
    end = chunk.to(tl.int64)
    while end > 0:
        at = end - 1 - lanes
        word = tl.load(status + at, mask=at >= 0, other=_INCLUSIVE, volatile=True)
        flag = word >> _VALUE_BITS
        nearest_inclusive = tl.min(tl.where(flag == 2, lanes, LOOKBACK), 0)
        nearest_unpublished = tl.min(tl.where(flag == 0, lanes, LOOKBACK), 0)
        usable = (nearest_inclusive < nearest_unpublished) | (nearest_unpublished == LOOKBACK)
        value = (word << (64 - _VALUE_BITS)) >> (64 - _VALUE_BITS)
        before += tl.where(usable, tl.sum(tl.where(lanes <= nearest_inclusive, value, 0), 0), 0)
        done = usable & (nearest_inclusive < LOOKBACK)
        end = tl.where(done, 0, tl.where(usable, end - LOOKBACK, end))
    return before


@triton.jit
def _mark_first_rows(ends, table, rows, row_ends, counts, live, chunk_start, chunk_rows, before, total_here,
                     n_blocks, BLOCK: tl.constexpr, TILE: tl.constexpr):
    """``table[b]`` = the row holding output element ``b * BLOCK``, for the blocks starting in this chunk.

    Each row writes the first block starting inside it (one masked store). A
    row holding several block starts (repeats over ``BLOCK``) makes the chunk
    search every block's row among its ends instead, ``TILE`` blocks at a time.
    """
    starts = row_ends - counts
    block = (starts + BLOCK - 1) // BLOCK
    owns = live & (starts >= 0) & (block * BLOCK < row_ends) & (block < n_blocks)
    tl.store(table + block, rows, mask=owns)
    block_starts = tl.where(owns, (row_ends + BLOCK - 1) // BLOCK - block, 0)
    if tl.max(block_starts, 0) > 1:
        tl.debug_barrier()  # this chunk's ends, just stored, are read back by other threads
        lo = tl.maximum((before + BLOCK - 1) // BLOCK, 0)
        hi = tl.minimum((before + total_here + BLOCK - 1) // BLOCK, n_blocks)
        none = tl.zeros((TILE,), dtype=tl.int32)
        steps = _halvings(chunk_rows)
        for tile in range(lo, hi, TILE):
            blocks = tile + tl.arange(0, TILE)
            wanted = blocks < hi
            at = _bisect(ends + chunk_start, none, none + chunk_rows, blocks * BLOCK, steps, wanted)
            tl.store(table + blocks, chunk_start + at, mask=wanted & (at < chunk_rows))


@triton.jit(do_not_specialize=("repeats_stride", "n", "total"))
def _scan_kernel(repeats, repeats_stride, ends, status, n, total: tl.int64,
                 CHUNK: tl.constexpr, BLOCK: tl.constexpr, LOOKBACK: tl.constexpr, TILE: tl.constexpr,
                 DEPENDENT: tl.constexpr, SUMMARY: tl.constexpr):
    """``ends`` = the running sum of ``repeats``, and after it the table of each output block's first row.

    One launch, ``CHUNK`` rows a program: a chunk publishes its sum, adds its
    predecessors' sums by a look-back, then writes its ends and the first rows
    of the blocks starting in it (``total`` output elements, ``BLOCK`` per
    block). Chunks wait only on chunks of lower program id, which the GPU
    starts first (the assumption cub's scans make too), so the wait ends.
    ``status`` (a word per chunk) is zero at the start; the expand kernel
    that follows zeroes it again (the ``zeroed_scratch`` contract), so no
    memset precedes the launch and a CUDA graph can replay the pair. With
    ``DEPENDENT`` it lets the expand start at once: the expand's programs
    wait (``gdc_wait``) for this launch to complete, resident on SMs that
    this launch's few programs leave free. With ``SUMMARY`` (the output
    size unknown: ``total`` is 0 and no table is written) the two words after
    the chunks' receive the sum of ``repeats`` (from the last chunk) and the
    smallest negative repeat (0 if none), for the host to read in one copy.
    """
    if DEPENDENT:
        gdc_launch_dependents()
    chunk = tl.program_id(0)
    chunk_start = chunk.to(tl.int64) * CHUNK
    rows = chunk_start + tl.arange(0, CHUNK)
    live = rows < n
    counts = tl.load(repeats + rows * repeats_stride, mask=live, other=0).to(tl.int64)
    total_here = tl.sum(counts, 0)
    _publish(status + chunk, _AGGREGATE, total_here)
    local_ends = tl.cumsum(counts, 0)  # while the predecessors publish
    before = _rows_before(status, chunk, LOOKBACK)
    _publish(status + chunk, _INCLUSIVE, before + total_here)
    if SUMMARY:
        summary = status + tl.num_programs(0)
        if chunk == tl.num_programs(0) - 1:
            tl.store(summary, before + total_here)
        smallest = tl.min(counts, 0)
        if smallest < 0:
            tl.atomic_min(summary + 1, smallest, sem="relaxed")
    row_ends = before + local_ends
    tl.store(ends + rows, row_ends, mask=live)
    chunk_rows = tl.minimum(n - chunk_start, CHUNK).to(tl.int32)
    _mark_first_rows(ends, ends + n, rows, row_ends, counts, live, chunk_start, chunk_rows, before, total_here,
                     tl.cdiv(total, BLOCK), BLOCK, TILE)


def _scan(kernels: _Kernels, repeats: torch.Tensor, total: int, status: torch.Tensor, dependent: bool,
          summary: bool = False) -> torch.Tensor:
    """Row ends, then each of the ``cdiv(total, block)`` output blocks' first rows: one launch, no sync.

    Leaves ``status`` set: the expand launched next zeroes it. ``summary``
    (with ``total`` 0): also the sum and the smallest negative repeat, in the
    two status words after the chunks' (``_scan_kernel``).
    """
    n = repeats.shape[0]
    ends = torch.empty(n + cdiv(total, kernels.block), dtype=torch.int64, device=repeats.device)
    kernels.scan(dependent, summary)((cdiv(n, kernels.chunk),), repeats, repeats.stride(0), ends, status, n, total)
    return ends


def _expand_dynamic(repeats: torch.Tensor, values: torch.Tensor | None) -> torch.Tensor:
    """:func:`_expand` without ``output_size``: our scan, then the one sync that reads its summary.

    The scan writes the ends and, in two more status words, the total and the
    smallest negative repeat; one copy reads both. Against ``torch.cumsum``
    plus a separate minimum, that is one launch instead of four before the
    sync. The expand (searching each block's first row: no table without the
    total) zeroes the status words, summary included; a failure in between
    zeroes them here.
    """
    n, kernels = repeats.shape[0], _kernels(repeats.device)
    chunks = cdiv(n, kernels.chunk)
    words = chunks + 2
    status, lock = claim_scratch(repeats, words)
    source = repeats if values is None else values
    with lock:
        ends = _scan(kernels, repeats, 0, status, False, summary=True)
        try:
            total, smallest = host_values(status[chunks:words])
            out = front.expanded(source, total, smallest)
            if not total:
                status[:words].zero_()
                return out
            gather = values is not None
            kernels.expand(gather, False, False)((cdiv(total, kernels.block),), ends, out,
                                                 values if gather else out, total, n, kernels.rank_steps(n),
                                                 values.stride(0) if gather else 0, status, words)
        except BaseException:  # the scan's status words must not outlive it
            status[:words].zero_()
            raise
    return out


def _expand(repeats: torch.Tensor, output_size: int | None, values: torch.Tensor | None) -> torch.Tensor:
    """The front's ``expand``: row ids (or ``values`` gathered by them) repeated ``repeats`` times each.

    With ``output_size`` (never 0 here) the ends come from :func:`_scan` with
    the blocks' first rows (two launches in all, the output allocated before
    them, so that nothing between them can fail and leave the scan's status
    set); without, see :func:`_expand_dynamic`.
    """
    if output_size is None:
        return _expand_dynamic(repeats, values)
    total, n = output_size, repeats.shape[0]
    out = front.expanded(repeats if values is None else values, total)
    gather, kernels = values is not None, _kernels(repeats.device)
    chunks = cdiv(n, kernels.chunk)
    status, lock = claim_scratch(repeats, chunks)
    dependent = dependent_launch(repeats)
    with lock:
        ends = _scan(kernels, repeats, total, status, dependent)
        try:
            kernels.expand(gather, True, dependent)((cdiv(total, kernels.block),), ends, out,
                                                    values if gather else out, total, n, 0,
                                                    values.stride(0) if gather else 0, status, chunks)
        except BaseException:  # e.g. the expand failed to compile: the scan's status words must not outlive it
            status[:chunks].zero_()
            raise
    return out


def _expand_entry(repeats: torch.Tensor, output_size: int | None, values: torch.Tensor | None) -> torch.Tensor:
    """:func:`_expand`, looked up per call (a test or probe may replace it)."""
    return _expand(repeats, output_size, values)


def _gather(out: torch.Tensor, source: torch.Tensor, dim: int, rows: torch.Tensor | None,
            repeat: int | torch.Tensor | None) -> None:
    """The front's ``gather``: the toolkit's gather along ``dim``, by row ids or dividing by the repeat."""
    if rows is not None:
        served = index_along_dim(out, source, dim, rows, scatter=False)
    elif isinstance(repeat, int):
        served = index_along_dim(out, source, dim, out, False, INDEX_DIVIDE_INT, repeat)
    else:
        served = index_along_dim(out, source, dim, repeat, False, INDEX_DIVIDE_TENSOR)
    if not served:
        raise Decline("layout needs more than 2 outer or 2 inner dimensions")


repeat_interleave_tensor, repeat_interleave_self_tensor, repeat_interleave_self_int = front.entries(
    _expand_entry, _gather, max_rows=MAX_ROWS)
