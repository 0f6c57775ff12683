"""Grouped scatter: a large random 1-D scatter, partitioned by destination region before it is written.

``dest[index[j]] = source[j]`` with ``2**29`` random indices into a 2 GiB
``dest`` writes one partial 32-byte sector per store. The sectors leave the L2
cache before their neighbours arrive, so each store costs DRAM traffic; torch
and the plain scatter both take 34 ms on an H200 (fp16). The same pairs
grouped by destination region (random inside each region) take 9.1-12.0 ms
for 2-32 MiB regions: a region fits in the L2 cache, which merges the partial
sectors before writing them back. So grouping pays where each sector takes
several stores (``min_sector_stores``): ``2**29`` random pairs into a
``[2**30]`` destination in place take 20.8 ms against torch's 34.0 (fp16) and
28.7 against 34.4 (fp32), partition included (H200; the measurements are in
benchmarks/RESULTS.md).

:func:`grouped_scatter` groups the pairs into ``4 ** bits`` regions on the
device (``bits`` from ``DIGIT_BITS``: the fewest whose regions fit the L2
cache), as a two-pass least-significant-digit radix partition, then scatters:

1. **probe** (one program): samples ``windows`` windows of the index and
   counts the regions each touches. A sorted or local index touches few, and
   the plain scatter already writes it in order: the flag it writes says so,
   and the partition launches do nothing.
2. **two passes, each: count, then partition** by one ``bits``-wide digit of
   the region (the low digit first; the second pass keeps the first's order
   within a digit, so the result is grouped by the whole region). The count
   stores, per block of ``block`` pairs, how many have each digit;
   ``torch.cumsum`` turns the counts into each (digit, block)'s first slot.
   The partition ranks each pair among the block's pairs with its digit and
   writes (index as int32, value) there. The rank is an exclusive prefix
   count, several digits packed in the fields of an int32 word.
3. **scatter** (one program per ``scatter_block`` slots, in slot order, so the
   stores in flight fall in one or two regions): writes ``dest`` from the
   grouped pairs, or, where the probe said "local", straight from
   ``index``/``source``.

Full blocks load without masks, which lets the loads vectorise (fp16 [2^30]:
both passes 9.8 ms against 13.9 with masked loads; a sorted index's scatter
1.55 against 2.09 ms).

Why two passes of few digits rather than one of 64 regions (fp16 [2^30]):
one pass ranks 64 regions for 9 ms of compute beyond its 2.5 ms of
memory traffic, and its writes, spread over 64 regions in 256-pair chunks,
leave partial lines open in every region and cost 11 ms more (22.9 ms in all).

Blocks, warps and thresholds are a typed launch policy
(:class:`~.tuning.GroupedScatterPolicy`, tuning key ``grouped_scatter``).

No host synchronisation. Out-of-range indices travel as key -1 and are not
written, as by the plain scatter. Duplicate indices: one of the candidates
wins, unspecified. Workspace, allocated per call: two sets of ``n`` int32
keys and ``n`` values (6 GiB for the fp16 ``2**29`` case).
"""

# ruff: noqa: N803 - constexpr parameters are UPPER_CASE, as in every Triton kernel
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import context, tuning
from .launch import FastLauncher
from .layout import SECTOR_BYTES, cdiv


def policy() -> tuning.GroupedScatterPolicy:
    """Blocks, warps and thresholds (tuning key ``grouped_scatter``; measured defaults documented there)."""
    return tuning.policy("grouped_scatter")


def min_indices() -> int:
    """The fewest indices :func:`applies` can take (a cheap first test for callers: cached per context)."""
    found = _MIN_INDICES.get("n")
    if found is None:
        p = policy()
        found = _MIN_INDICES["n"] = p.min_dest_bytes // SECTOR_BYTES * p.min_sector_stores
    return found


_MIN_INDICES: dict[str, int] = context.cache()

#: Width of a rank field, by digit bits: a block's counts (up to the policy's ``block``, below 1024)
#: stay below ``2**width``. Measured ([2^30], both passes): 3 bits (fp16) 9.37 ms with 16-bit fields
#: (4 sums), 9.99 with 10-bit ones (3 sums); 4 bits (fp32) 13.01 with 16-bit (8 sums), 12.27 with 10-bit
#: (6 sums).
FIELD_BITS = {3: 16, 4: 10}
#: Bits of the region a pass sorts by (two passes: ``4 ** bits`` regions): the fewest whose regions
#: fit the L2 cache (``L2_SHARE``). More bits cost partition time ([2^30] fp16: both
#: passes 9.8 ms with 3 bits, 15.0 with 4).
DIGIT_BITS = (3, 4)
#: Keys, counts and slots are int32.
INT32_LIMIT = 2**31 - (1 << 24)
#: Element sizes grouped: those measured faster. 8-byte elements were measured only at
#: two stores a sector (0.87x).
ELEMENT_SIZES = (1, 2, 4)
#: A region must fit in this share of the device's L2 cache, where merging its partial sectors
#: is what grouping buys (H200, a 60 MB L2: 32 MiB regions scatter in 11.3 ms, 128 MiB regions in
#: 30.6 against 34.7 ungrouped). GPUs with a smaller L2 keep the plain scatter.
L2_SHARE = 2 / 3


@triton.jit(do_not_specialize=("n", "size", "shift", "min_spread"))
def _probe_kernel(index, state, n, index_stride, size, shift, min_spread,
                  WINDOWS: tl.constexpr, WINDOW: tl.constexpr, REGIONS: tl.constexpr):
    """``state[0] = 1`` where the sampled windows touch more than ``min_spread`` regions in all, else 0."""
    lanes = tl.arange(0, WINDOW)
    last_start = tl.maximum(n - WINDOW, 0).to(tl.int64)
    spread = 0
    for window in range(WINDOWS):
        j = last_start * window // (WINDOWS - 1) + lanes
        _, region, valid, _ = _digits(index, j, n, index_stride, size, shift, REGIONS)
        spread += tl.sum((_histogram(region, valid, REGIONS) > 0).to(tl.int32))
    tl.store(state, (spread > min_spread).to(tl.int32))


@triton.jit
def _digits(index, j, n, index_stride, size, shift, BINS: tl.constexpr, FULL: tl.constexpr = False):
    """Each ``index[j]``, its digit ``(index >> shift) % BINS`` (0 where invalid), in range, below ``n``.

    ``FULL``: every ``j`` is below ``n``, and the load is unmasked (a mask by a
    runtime length keeps loads scalar; unmasked ones vectorise).
    """
    if FULL:
        live = tl.full(j.shape, 1, tl.int1)
        d = tl.load(index + j * index_stride)
    else:
        live = j < n
        d = tl.load(index + j * index_stride, mask=live, other=-1)
    valid = live & (d >= 0) & (d < size)
    return d, tl.where(valid, (d >> shift) & (BINS - 1), 0).to(tl.int32), valid, live


@triton.jit
def _histogram(digit, counted, BINS: tl.constexpr):
    """How many ``counted`` elements have each digit (the others have digit 0: taken off again)."""
    others = tl.sum(tl.where(counted, 0, 1))
    return tl.histogram(digit, BINS) - tl.where(tl.arange(0, BINS) == 0, others, 0)


@triton.jit(do_not_specialize=("n", "size", "shift", "blocks"))
def _count_kernel(index, state, counts, n, index_stride, size, shift, blocks,
                  BINS: tl.constexpr, BLOCK: tl.constexpr):
    """``counts[1 + g * blocks + b]``: block ``b``'s pairs (out-of-range ones as digit 0) with digit ``g``.

    The programs loop over the full blocks; program 0 also counts the partial
    last one and writes ``counts[0] = 0``.
    """
    if tl.load(state) != 0:
        pid = tl.program_id(0)
        lanes = tl.arange(0, BLOCK).to(tl.int64)  # int64 offsets: j * index_stride may pass 2**31
        by_digit = tl.arange(0, BINS) * blocks
        for block in range(pid, n // BLOCK, tl.num_programs(0)):
            _count_block(index, counts, block, n, index_stride, size, shift, lanes, by_digit, BINS, BLOCK, True)
        if pid == 0:
            tl.store(counts, 0)
            if n % BLOCK != 0:
                _count_block(index, counts, n // BLOCK, n, index_stride, size, shift, lanes, by_digit, BINS, BLOCK,
                             False)


@triton.jit
def _count_block(index, counts, block, n, index_stride, size, shift, lanes, by_digit, BINS: tl.constexpr,
                 BLOCK: tl.constexpr, FULL: tl.constexpr):
    _, digit, _, live = _digits(index, block * BLOCK + lanes, n, index_stride, size, shift, BINS, FULL)
    tl.store(counts + 1 + by_digit + block, _histogram(digit, live, BINS))


@triton.jit(do_not_specialize=("n", "size", "shift", "blocks"))
def _partition_kernel(index, source, state, slots, keys, values, n, index_stride, source_stride, size, shift,
                      blocks, BINS: tl.constexpr, BLOCK: tl.constexpr, FIELD_BITS: tl.constexpr,
                      STAGES: tl.constexpr):
    """Writes block ``b``'s pairs with digit ``g`` from ``slots[g * blocks + b]`` on, in order (key -1: invalid).

    The programs loop over the full blocks; program 0 also takes the partial last one.
    """
    if tl.load(state) != 0:
        pid = tl.program_id(0)
        lanes = tl.arange(0, BLOCK).to(tl.int64)
        by_digit = tl.arange(0, BINS) * blocks
        for block in tl.range(pid, n // BLOCK, tl.num_programs(0), num_stages=STAGES):
            _partition_block(index, source, slots, keys, values, block, n, index_stride, source_stride, size, shift,
                             lanes, by_digit, BINS, BLOCK, FIELD_BITS, True)
        if (pid == 0) & (n % BLOCK != 0):
            _partition_block(index, source, slots, keys, values, n // BLOCK, n, index_stride, source_stride, size,
                             shift, lanes, by_digit, BINS, BLOCK, FIELD_BITS, False)


@triton.jit
def _partition_block(index, source, slots, keys, values, block, n, index_stride, source_stride, size, shift, lanes,
                     by_digit, BINS: tl.constexpr, BLOCK: tl.constexpr, FIELD_BITS: tl.constexpr,
                     FULL: tl.constexpr):
    j = block * BLOCK + lanes
    d, digit, valid, live = _digits(index, j, n, index_stride, size, shift, BINS, FULL)
    slot = tl.gather(tl.load(slots + by_digit + block), digit, 0) + _rank_in_digit(digit, live, BINS, FIELD_BITS)
    key = tl.where(valid, d, -1).to(tl.int32)
    if FULL:
        tl.store(keys + slot, key)
        tl.store(values + slot, tl.load(source + j * source_stride))
    else:
        tl.store(keys + slot, key, mask=live)
        tl.store(values + slot, tl.load(source + j * source_stride, mask=live), mask=live)


@triton.jit
def _rank_in_digit(digit, live, BINS: tl.constexpr, FIELD_BITS: tl.constexpr):
    """For each live element, how many live elements before it share its digit (fewer than ``2**FIELD_BITS``).

    Digit ``g`` is field ``g % FIELDS`` (``FIELD_BITS`` wide) of int32 word
    ``g // FIELDS``: one prefix sum per word counts ``FIELDS`` digits at once,
    and a field's count stays below ``2**FIELD_BITS``, so fields never carry
    into each other. (Four int32 sums take 12.5 ms for both passes, two int64
    sums 15.9: fp16 [2^30] on an H200.)
    """
    FIELDS: tl.constexpr = 32 // FIELD_BITS
    field = (digit % FIELDS) * FIELD_BITS
    one = tl.full(digit.shape, 1, tl.int32) << field
    rank = tl.zeros(digit.shape, tl.int32)
    for word in tl.static_range((BINS + FIELDS - 1) // FIELDS):
        mine = live & (digit // FIELDS == word)
        ones = tl.where(mine, one, 0)
        before = tl.cumsum(ones, 0) - ones
        rank = tl.where(mine, (before >> field) & ((1 << FIELD_BITS) - 1), rank)
    return rank


@triton.jit(do_not_specialize=("n", "size"))
def _scatter_kernel(state, keys, values, index, source, dest, n, index_stride, source_stride, dest_stride, size,
                    BLOCK: tl.constexpr):
    """``dest[k] = v`` for the grouped pairs (key -1: skipped), or straight from ``index`` and ``source``."""
    pid = tl.program_id(0).to(tl.int64)
    j = pid * BLOCK + tl.arange(0, BLOCK)
    grouped = tl.load(state) != 0
    if (pid + 1) * BLOCK <= n:
        _scatter_block(grouped, keys, values, index, source, dest, j, n, index_stride, source_stride, dest_stride,
                       size, True)
    else:
        _scatter_block(grouped, keys, values, index, source, dest, j, n, index_stride, source_stride, dest_stride,
                       size, False)


@triton.jit
def _scatter_block(grouped, keys, values, index, source, dest, j, n, index_stride, source_stride, dest_stride, size,
                   FULL: tl.constexpr):
    if grouped:
        if FULL:
            k = tl.load(keys + j)
            v = tl.load(values + j)
        else:
            k = tl.load(keys + j, mask=j < n, other=-1)
            v = tl.load(values + j, mask=j < n)
        tl.store(dest + k.to(tl.int64) * dest_stride, v, mask=k >= 0)
    else:
        d, _, valid, _ = _digits(index, j, n, index_stride, size, 0, 1, FULL)
        if FULL:
            v = tl.load(source + j * source_stride)
        else:
            v = tl.load(source + j * source_stride, mask=j < n)
        tl.store(dest + d * dest_stride, v, mask=valid)


_LAUNCHERS: dict[tuple[str, int], FastLauncher] = context.cache()  # launchers hold the policy's blocks and warps


def _launcher(name: str, bits: int = 0) -> FastLauncher:
    launcher = _LAUNCHERS.get((name, bits))
    if launcher is None:
        kernel, constexprs, warps = _kernel_spec(name, bits)
        launcher = _LAUNCHERS[(name, bits)] = FastLauncher(kernel, constexprs, num_warps=warps)
    return launcher


def _kernel_spec(name: str, bits: int) -> tuple[triton.JITFunction, dict[str, int], int]:
    """A launch's kernel, constexprs and warps (``bits``-wide digits)."""
    digits, p = 1 << bits, policy()
    if name == "probe":
        return _probe_kernel, {"WINDOWS": p.windows, "WINDOW": p.window, "REGIONS": digits * digits}, 4
    if name == "count":
        return _count_kernel, {"BINS": digits, "BLOCK": p.block}, p.count_warps
    if name == "partition":
        constexprs = {"BINS": digits, "BLOCK": p.block, "FIELD_BITS": FIELD_BITS[bits],
                      "STAGES": p.partition_stages}
        return _partition_kernel, constexprs, p.partition_warps
    return _scatter_kernel, {"BLOCK": p.scatter_block}, p.scatter_warps


def region_shift(size: int, bits: int) -> int:
    """The smallest ``shift`` with ``4 ** bits`` regions of ``2 ** shift`` destinations covering ``size``."""
    return max(0, (cdiv(size, 1 << 2 * bits) - 1).bit_length())


def enabled() -> bool:
    """``FLAGGEMS_GROUPED_SCATTER``, as the kernel context carries it."""
    return context.current().grouped_scatter


def l2_bytes(device: torch.device) -> int | None:
    """The L2 cache size of ``device`` from the backend's device facts (0: not reported); None on the CPU."""
    if device.type == "cpu":
        return None
    found = context.current().facts(device.index or 0).l2_bytes
    return 0 if found is None and device.type == "cuda" else found


def digit_bits(dest: torch.Tensor) -> int | None:
    """The fewest ``DIGIT_BITS`` whose regions of ``dest`` fit ``L2_SHARE`` of its device's L2 cache.

    None where none fits (or torch does not know the L2 size). Devices without
    an L2 size (the interpreter's CPU) take the fewest bits.
    """
    l2 = l2_bytes(dest.device)
    for bits in DIGIT_BITS:
        span = (1 << region_shift(dest.numel(), bits)) * dest.stride(0) * dest.element_size()
        if l2 is None or span <= l2 * L2_SHARE:
            return bits
    return None


def applies(dest: torch.Tensor, index: torch.Tensor) -> bool:
    """Whether :func:`grouped_scatter` takes this scatter.

    A destination of ``min_dest_bytes`` or more whose sectors take at least
    ``min_sector_stores`` stores each on average (the policy's), small enough for int32 keys
    and slots, an element size in ``ELEMENT_SIZES``, regions that fit the L2
    cache (:func:`digit_bits`), and ``FLAGGEMS_GROUPED_SCATTER`` on.
    """
    n, size, p = index.numel(), dest.numel(), policy()
    span = size * dest.stride(0) * dest.element_size()
    return (dest.element_size() in ELEMENT_SIZES and n < INT32_LIMIT and size < INT32_LIMIT
            and span >= p.min_dest_bytes and n * SECTOR_BYTES >= p.min_sector_stores * span and enabled()
            and digit_bits(dest) is not None)


def _partition(index: torch.Tensor, source: torch.Tensor, state: torch.Tensor, size: int, bits: int, shift: int,
               counts: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """One pass: the pairs grouped by digit ``(index >> shift) % 2**bits`` into ``keys``/``values``, in order."""
    n, p = index.numel(), policy()
    blocks = cdiv(n, p.block)
    programs = (min(blocks, p.programs),)
    _launcher("count", bits)(programs, index, state, counts, n, index.stride(0), size, shift, blocks)
    slots = torch.cumsum(counts, 0, dtype=torch.int32)
    _launcher("partition", bits)(programs, index, source, state, slots, keys, values, n, index.stride(0),
                                 source.stride(0), size, shift, blocks)


def grouped_scatter(dest: torch.Tensor, index: torch.Tensor, source: torch.Tensor,
                    bits: int | None = None) -> torch.Tensor | None:
    """``dest[index[j]] = source[j]`` (1-D tensors, any strides, int index), grouped by region when random.

    Callers check :func:`applies` first; ``bits`` (default:
    :func:`digit_bits`) sets the region count, ``4 ** bits``. Out-of-range
    indices are not written; no host synchronisation. Returns the probe's
    device-side flag (one int32: 1 where the pairs were grouped, 0 where
    scattered straight), or None, with nothing done, when the workspace cannot
    be allocated.
    """
    n, size = index.numel(), dest.numel()
    bits = bits or digit_bits(dest) or DIGIT_BITS[-1]
    try:  # all of it before the first launch: running out of memory leaves the scatter to the caller
        state = dest.new_empty(1, dtype=torch.int32)
        counts = dest.new_empty((1 << bits) * cdiv(n, policy().block) + 1, dtype=torch.int32)
        keys = (dest.new_empty(n, dtype=torch.int32), dest.new_empty(n, dtype=torch.int32))
        values = (dest.new_empty(n), dest.new_empty(n))
    except torch.OutOfMemoryError:
        return None
    shift = region_shift(size, bits)
    p = policy()
    regions = min(1 << 2 * bits, cdiv(size, 1 << shift), p.window)
    _launcher("probe", bits)((1,), index, state, n, index.stride(0), size, shift, p.windows * regions // p.spread_share)
    _partition(index, source, state, size, bits, shift, counts, keys[0], values[0])
    _partition(keys[0], values[0], state, size, bits, shift + bits, counts, keys[1], values[1])
    _launcher("scatter")((cdiv(n, p.scatter_block),), state, keys[1], values[1], index, source, dest, n,
                         index.stride(0), source.stride(0), dest.stride(0), size)
    return state
