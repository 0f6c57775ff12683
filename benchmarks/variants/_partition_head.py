"""Grouped scatter: a large random 1-D scatter, partitioned by destination region before it is written.

``dest[index[j]] = source[j]`` with ``2**29`` random indices into a 2 GiB
``dest`` writes one partial 32-byte sector per store. The sectors leave the L2
cache before their neighbours arrive, so each store costs DRAM traffic; torch
and the plain scatter both take 34 ms on an H200 (fp16). The same pairs
grouped by destination region (random inside each region) take 9.1-12.0 ms
for 2-32 MiB regions: a region fits in the L2 cache, which merges the partial
sectors before writing them back (benchmarks/RESULTS.md, runs 7 and 11).

:func:`grouped_scatter` groups the pairs into ``DIGITS ** 2`` regions on the
device, as a two-pass least-significant-digit radix partition, then scatters:

1. **probe** (one program): samples ``WINDOWS`` windows of the index and
   counts the regions each touches. A sorted or local index touches few, and
   the plain scatter already writes it in order: the flag it writes says so,
   and the partition launches do nothing.
2. **two passes, each: count, then partition** by one base-``DIGITS`` digit
   of the region (the low digit first; the second pass keeps the first's
   order within a digit, so the result is grouped by the whole region). The
   count stores, per block of ``BLOCK`` pairs, how many have each digit;
   ``torch.cumsum`` turns the counts into each (digit, block)'s first slot.
   The partition ranks each pair among the block's pairs with its digit and
   writes (index as int32, value) there. The rank is an exclusive prefix
   count, two digits packed in 16-bit fields of an int32 word.
3. **scatter** (one program per ``SCATTER_BLOCK`` slots, in slot order, so the
   stores in flight fall in one or two regions): writes ``dest`` from the
   grouped pairs, or, where the probe said "local", straight from
   ``index``/``source``.

Why two passes of few digits rather than one of 64 regions (run 11, fp16
[2^30]): one pass ranks 64 regions for 9 ms of compute beyond its 2.5 ms of
memory traffic, and its writes, spread over 64 regions in 256-pair chunks,
leave partial lines open in every region and cost 11 ms more (22.9 ms in all).

No host synchronisation. Out-of-range indices travel as key -1 and are not
written, as by the plain scatter. Duplicate indices: one of the candidates
wins, unspecified. Workspace, allocated per call: two sets of ``n`` int32
keys and ``n`` values (6 GiB for the fp16 ``2**29`` case).
"""

# ruff: noqa: N803 - constexpr parameters are UPPER_CASE, as in every Triton kernel
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import config
from .launch import FastLauncher
from .layout import cdiv

#: Pairs a program counts and partitions at once; exclusive counts below 2**16 fit 16-bit fields.
#: Run 11 (fp16 [2^30], both partition passes): 2048 pairs with 8 warps 34.8 ms, 1024 with 8
#: warps 19.4, 512 with 4 warps 14.3 (with 2 warps 15.3, with 1 14.4), 256 with 1 warp 15.0.
BLOCK = 512
PARTITION_WARPS = 4
PARTITION_STAGES = 2
#: Digit values per pass (two passes: DIGITS**2 regions).
DIGIT_BITS = 3
DIGITS = 1 << DIGIT_BITS
#: Slots a scatter program writes; small, so the stores in flight stay within about one region.
SCATTER_BLOCK = 1024
#: Programs of the count and partition launches, which loop over blocks: an index the probe calls
#: local leaves them nothing to do, and this many programs finding that out cost little. Run 11
#: (fp16 [2^30], all launches): 2048 programs 26.5 ms, 4096 25.6, 8192 25.1.
PROGRAMS = 8192
#: The probe: windows sampled, elements per window.
WINDOWS = 16
WINDOW = 256
#: The index is grouped when its windows touch, on average, more than 1/SPREAD_SHARE of the
#: regions (a random index touches nearly all of them; a sorted one, one or two).
SPREAD_SHARE = 4
#: The plan is used from these sizes on. Only the 2 GiB destination of the seed case was
#: measured (run 11); 256 MiB (five L2 caches of an H200) and 4M indices are a chosen lower
#: bound, not a measured break-even.
MIN_DEST_BYTES = 256 << 20
MIN_INDICES = 1 << 22
#: Keys, counts and slots are int32.
INT32_LIMIT = 2**31 - (1 << 24)
#: A region must fit in this share of the device's L2 cache, where merging its partial sectors
#: is what grouping buys (run 11, H200 with a 60 MB L2: 32 MiB regions scatter in 11.3 ms; run 7:
#: 128 MiB regions 30.6 against 34.7 ungrouped). GPUs with a smaller L2 keep the plain scatter.
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
def _digits(index, j, n, index_stride, size, shift, BINS: tl.constexpr):
    """Each ``index[j]``, its digit ``(index >> shift) % BINS`` (0 where invalid), in range, below ``n``."""
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
    """``counts[1 + g * blocks + b]``: block ``b``'s pairs (out-of-range ones as digit 0) with digit ``g``."""
    if tl.load(state) != 0:
        pid = tl.program_id(0)
        lanes = tl.arange(0, BLOCK).to(tl.int64)  # int64 offsets: j * index_stride may pass 2**31
        by_digit = tl.arange(0, BINS) * blocks
        for block in range(pid, blocks, tl.num_programs(0)):
            _, digit, _, live = _digits(index, block * BLOCK + lanes, n, index_stride, size, shift, BINS)
            tl.store(counts + 1 + by_digit + block, _histogram(digit, live, BINS))
        if pid == 0:
            tl.store(counts, 0)


@triton.jit(do_not_specialize=("n", "size", "shift", "blocks"))
def _partition_kernel(index, source, state, slots, keys, values, n, index_stride, source_stride, size, shift,
                      blocks, BINS: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Writes block ``b``'s pairs with digit ``g`` from ``slots[g * blocks + b]`` on, in order (key -1: invalid)."""
    if tl.load(state) != 0:
        lanes = tl.arange(0, BLOCK).to(tl.int64)
        by_digit = tl.arange(0, BINS) * blocks
        # Two stages let the next block's loads start while this one is ranked (run 11: both passes
        # 15.9 -> 11.6 ms; three stages, 11.8).
        for block in tl.range(tl.program_id(0), blocks, tl.num_programs(0), num_stages=STAGES):
            j = block * BLOCK + lanes
            d, digit, valid, live = _digits(index, j, n, index_stride, size, shift, BINS)
            slot = tl.gather(tl.load(slots + by_digit + block), digit, 0) + _rank_in_digit(digit, live, BINS)
            tl.store(keys + slot, tl.where(valid, d, -1).to(tl.int32), mask=live)
            tl.store(values + slot, tl.load(source + j * source_stride, mask=live), mask=live)


@triton.jit
def _rank_in_digit(digit, live, BINS: tl.constexpr):
    """For each live element, how many live elements before it share its digit (blocks below 2**16).

    Digit ``g`` is field ``g % 2`` (16 bits) of int32 word ``g // 2``: one
    prefix sum per word counts two digits at once, and a field's exclusive
    count stays below 2**16, so fields never carry into each other. (Run 11:
    four int32 sums took 12.5 ms for both passes, two int64 sums 15.9.)
    """
    field = (digit % 2) * 16
    one = tl.full(digit.shape, 1, tl.int32) << field
    rank = tl.zeros(digit.shape, tl.int32)
    for word in tl.static_range(BINS // 2):
        mine = live & (digit // 2 == word)
        ones = tl.where(mine, one, 0)
        before = tl.cumsum(ones, 0) - ones
        rank = tl.where(mine, (before >> field) & 0xFFFF, rank)
    return rank


@triton.jit(do_not_specialize=("n", "size"))
def _scatter_kernel(state, keys, values, index, source, dest, n, index_stride, source_stride, dest_stride, size,
                    BLOCK: tl.constexpr):
    """``dest[k] = v`` for the grouped pairs (key -1: skipped), or straight from ``index`` and ``source``."""
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if tl.load(state) != 0:
        k = tl.load(keys + j, mask=j < n, other=-1)
        valid = k >= 0
        tl.store(dest + k.to(tl.int64) * dest_stride, tl.load(values + j, mask=valid), mask=valid)
    else:
        d, _, valid, _ = _digits(index, j, n, index_stride, size, 0, 1)
        tl.store(dest + d * dest_stride, tl.load(source + j * source_stride, mask=valid), mask=valid)


_LAUNCHERS: dict[str, FastLauncher] = {}


def _launcher(name: str) -> FastLauncher:
    launcher = _LAUNCHERS.get(name)
    if launcher is None:
        kernel, constexprs, warps = {
            "probe": (_probe_kernel, {"WINDOWS": WINDOWS, "WINDOW": WINDOW, "REGIONS": DIGITS * DIGITS}, 4),
            "count": (_count_kernel, {"BINS": DIGITS, "BLOCK": BLOCK}, 8),
            "partition": (_partition_kernel, {"BINS": DIGITS, "BLOCK": BLOCK, "STAGES": PARTITION_STAGES},
                          PARTITION_WARPS),
            "scatter": (_scatter_kernel, {"BLOCK": SCATTER_BLOCK}, 4),
        }[name]
        launcher = _LAUNCHERS[name] = FastLauncher(kernel, constexprs, num_warps=warps)
    return launcher


def region_shift(size: int) -> int:
    """The smallest ``shift`` with ``DIGITS ** 2`` regions of ``2 ** shift`` destinations covering ``size``."""
    return max(0, (cdiv(size, DIGITS * DIGITS) - 1).bit_length())


_ENABLED: bool | None = None


def enabled() -> bool:
    """``FLAGGEMS_GROUPED_SCATTER`` (read once; :func:`reset` re-reads)."""
    global _ENABLED
    if _ENABLED is None:
        _ENABLED = bool(config.get("FLAGGEMS_GROUPED_SCATTER"))
    return _ENABLED


def reset() -> None:
    """Forget the cached setting (after changing ``FLAGGEMS_GROUPED_SCATTER``)."""
    global _ENABLED
    _ENABLED = None


def l2_bytes(device: torch.device) -> int | None:
    """The L2 cache size of a CUDA (or HIP) device, 0 when torch does not say; None for other devices."""
    if device.type != "cuda":
        return None
    return _cuda_l2_bytes(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=64)
def _cuda_l2_bytes(index: int) -> int:
    return int(getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 0))


def applies(dest: torch.Tensor, index: torch.Tensor) -> bool:
    """Whether :func:`grouped_scatter` takes this scatter.

    Large enough (see ``MIN_DEST_BYTES``), int32 keys and slots suffice,
    2-byte elements (the 64 regions of a 4-byte [2^30] destination are 64 MiB,
    more than the L2 cache holds; run 11: fp32 took 44.5 against torch's
    35.0 ms), a region within ``L2_SHARE`` of the L2 cache (checked on CUDA
    devices; the interpreter has none), and ``FLAGGEMS_GROUPED_SCATTER`` on.
    """
    n, size = index.numel(), dest.numel()
    if not (dest.element_size() == 2 and MIN_INDICES <= n < INT32_LIMIT and size < INT32_LIMIT
            and size * dest.stride(0) * 2 >= MIN_DEST_BYTES and enabled()):
        return False
    l2 = l2_bytes(dest.device)
    return l2 is None or (1 << region_shift(size)) * dest.stride(0) * 2 <= l2 * L2_SHARE


def _partition(index: torch.Tensor, source: torch.Tensor, state: torch.Tensor, size: int, shift: int,
               counts: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """One pass: the pairs grouped by digit ``(index >> shift) % DIGITS`` into ``keys``/``values``, in order."""
    n = index.numel()
    blocks = cdiv(n, BLOCK)
    programs = (min(blocks, PROGRAMS),)
    _launcher("count")(programs, index, state, counts, n, index.stride(0), size, shift, blocks)
    slots = torch.cumsum(counts, 0, dtype=torch.int32)
    _launcher("partition")(programs, index, source, state, slots, keys, values, n, index.stride(0),
                           source.stride(0), size, shift, blocks)


def grouped_scatter(dest: torch.Tensor, index: torch.Tensor, source: torch.Tensor) -> torch.Tensor | None:
    """``dest[index[j]] = source[j]`` (1-D tensors, any strides, int index), grouped by region when random.

    Callers check :func:`applies` first. Out-of-range indices are not
    written; no host synchronisation. Returns the probe's device-side flag
    (one int32: 1 where the pairs were grouped, 0 where scattered straight),
    or None, with nothing done, when the workspace cannot be allocated.
    """
    n, size = index.numel(), dest.numel()
    try:  # all of it before the first launch: running out of memory leaves the scatter to the caller
        state = dest.new_empty(1, dtype=torch.int32)
        counts = dest.new_empty(DIGITS * cdiv(n, BLOCK) + 1, dtype=torch.int32)
        keys = (dest.new_empty(n, dtype=torch.int32), dest.new_empty(n, dtype=torch.int32))
        values = (dest.new_empty(n), dest.new_empty(n))
    except torch.OutOfMemoryError:
        return None
    shift = region_shift(size)
    regions = min(DIGITS * DIGITS, cdiv(size, 1 << shift), WINDOW)
    _launcher("probe")((1,), index, state, n, index.stride(0), size, shift, WINDOWS * regions // SPREAD_SHARE)
    _partition(index, source, state, size, shift, counts, keys[0], values[0])
    _partition(keys[0], values[0], state, size, shift + DIGIT_BITS, counts, keys[1], values[1])
    _launcher("scatter")((cdiv(n, SCATTER_BLOCK),), state, keys[1], values[1], index, source, dest, n,
                         index.stride(0), source.stride(0), dest.stride(0), size)
    return state
