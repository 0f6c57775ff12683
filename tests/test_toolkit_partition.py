"""The grouped scatter (toolkit.partition): exact results, the probe's choice, grouping order, routing."""

from __future__ import annotations

import pytest
import torch
from conftest import set_kernel_context

import flaggems
from flaggems.binding import native_scope
from flaggems.toolkit import context
from flaggems.toolkit import partition as part

DEV = torch.device(flaggems.backend().device_type)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def small(monkeypatch):
    """64-pair blocks, 3 programs looping over them, 16-element probe windows, no size threshold."""
    use_small_policy(monkeypatch)
    return part


def use_small_policy(monkeypatch, **changes) -> None:
    values = {"block": 64, "programs": 3, "window": 16, "scatter_block": 32, "min_dest_bytes": 1, **changes}
    set_kernel_context(monkeypatch, grouped_scatter=True,
                       tuning=lambda key: values if key == "grouped_scatter" else {})


def reference(dest: torch.Tensor, index: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    expected = dest.clone()
    valid = (index >= 0) & (index < dest.numel())
    with native_scope():
        expected[index[valid]] = source[valid]
    return expected


def make_index(kind: str, size: int, n: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "random":
        return torch.randperm(size, generator=gen)[:n].to(DEV)
    if kind == "sorted":
        return torch.arange(size // 4, size // 4 + n, device=DEV)
    assert kind == "interleaved"  # two sorted streams, alternating: local, despite the jumps
    return torch.stack([torch.arange(n // 2), torch.arange(n // 2) + size // 2], 1).reshape(-1).to(DEV)


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("kind", "grouped"), [("random", 1), ("sorted", 0), ("interleaved", 0)])
@pytest.mark.parametrize(("size", "n"), [(4096, 3000), (1000, 999), (777, 5), (2048, 1024)])
def test_exact_and_the_probe_chooses(small, bits, dtype, kind, grouped, size, n):
    """Sizes with a partial last block and with only full ones (1024 pairs: 16 blocks of 64)."""
    gen = torch.Generator().manual_seed(size + n)
    index = make_index(kind, size, n, gen)
    dest = torch.randn(size, generator=gen).to(DEV, dtype)
    source = torch.randn(index.numel(), generator=gen).to(DEV, dtype)
    expected = reference(dest, index, source)
    state = part.grouped_scatter(dest, index, source, bits)
    assert torch.equal(dest, expected)
    # A handful of indices touch few regions whatever their order; regions smaller than a window
    # (4 elements at 4 bits for 1000) make even a local index touch many.
    if n >= 64 and (grouped or 1 << part.region_shift(size, bits) >= part.policy().window):
        assert int(state[0]) == grouped


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.bool, torch.int16, torch.int32])
@pytest.mark.parametrize(("size", "n"), [(4096, 3000), (2048, 1024)])
def test_exact_for_integer_and_bool_elements(small, dtype, size, n):
    gen = torch.Generator().manual_seed(size + n)
    index = make_index("random", size, n, gen)
    dest = torch.randint(0, 2 if dtype == torch.bool else 100, (size,), generator=gen).to(DEV, dtype)
    source = torch.randint(0, 2 if dtype == torch.bool else 100, (n,), generator=gen).to(DEV, dtype)
    expected = reference(dest, index, source)
    assert int(part.grouped_scatter(dest, index, source)[0]) == 1
    assert torch.equal(dest, expected)


@pytest.mark.parametrize(("bits", "digit"), [(3, 1), (3, 6), (3, 7), (4, 2), (4, 14), (4, 15)])
def test_a_block_of_one_digit_ranks_without_carries(small, monkeypatch, bits, digit):
    """Every pair of every full-size block in one digit: its rank field counts up to BLOCK - 1.

    The digits are the top field of a word, or the last word's (16-bit fields
    for 3 bits, 10-bit ones for 4).
    """
    use_small_policy(monkeypatch, block=512)
    size, blocks = 1 << 14, 3
    shift = part.region_shift(size, bits)
    n = blocks * part.policy().block
    gen = torch.Generator().manual_seed(digit)
    index = ((torch.randint(0, 1 << bits, (n,), generator=gen) << (shift + bits)) + (digit << shift)
             + torch.randint(0, 1 << shift, (n,), generator=gen)).to(DEV)
    source = torch.arange(float(n), device=DEV)
    keys, values = torch.empty(n, dtype=torch.int32, device=DEV), torch.empty(n, device=DEV)
    counts = torch.empty((1 << bits) * blocks + 1, dtype=torch.int32, device=DEV)
    state = torch.ones(1, dtype=torch.int32, device=DEV)
    part._partition(index, source, state, size, bits, shift, counts, keys, values)
    assert torch.equal(values, source)  # one digit: the pass keeps the order
    assert torch.equal(keys.long(), index)


def test_out_of_range_indices_are_not_written(small):
    size, n = 2000, 1500
    index = torch.randperm(size, generator=torch.Generator().manual_seed(3))[:n].to(DEV)
    index[::37] = size
    index[5::41] = -1
    index[7::53] = 2**40  # wraps to an in-range int32 if the key were cut without the check
    dest = torch.zeros(size, device=DEV)
    source = torch.arange(1.0, n + 1, device=DEV)
    expected = reference(dest, index, source)
    assert int(part.grouped_scatter(dest, index, source)[0]) == 1
    assert torch.equal(dest, expected)


def test_duplicates_write_one_of_their_candidates(small):
    size, n = 333, 2000
    index = torch.randint(0, size, (n,), generator=torch.Generator().manual_seed(4)).to(DEV)
    dest = torch.full((size,), -1.0, device=DEV)
    source = torch.arange(float(n), device=DEV)
    assert int(part.grouped_scatter(dest, index, source)[0]) == 1
    for d in range(size):
        candidates = source[index == d]
        assert (dest[d] == -1) if candidates.numel() == 0 else bool((candidates == dest[d]).any())


def test_strided_dest_index_and_source(small):
    size, n = 1500, 1000
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(size * 3, generator=gen).to(DEV)
    dest = base[1::3]
    index = torch.stack([torch.randperm(size, generator=gen)[:n], torch.zeros(n, dtype=torch.int64)], 1).to(DEV)[:, 0]
    source = torch.randn(2 * n, generator=gen).to(DEV)[::2]
    expected_base = base.clone()
    expected_base[1::3] = reference(dest, index, source)
    assert int(part.grouped_scatter(dest, index, source)[0]) == 1
    assert torch.equal(base, expected_base)  # the elements between dest's never change


@pytest.mark.parametrize("bits", [3, 4])
def test_two_passes_group_the_pairs_by_region(small, bits):
    """After both passes the keys' regions never decrease, and every valid pair is there once."""
    size, n = 4096, 3000
    index = torch.randperm(size, generator=torch.Generator().manual_seed(6))[:n].to(DEV)
    index[::97] = -5
    source = torch.arange(float(n), device=DEV)
    shift = part.region_shift(size, bits)
    state = torch.ones(1, dtype=torch.int32, device=DEV)
    counts = torch.empty((1 << bits) * -(-n // part.policy().block) + 1, dtype=torch.int32, device=DEV)
    keys = [torch.empty(n, dtype=torch.int32, device=DEV) for _ in range(2)]
    values = [torch.empty(n, device=DEV) for _ in range(2)]
    part._partition(index, source, state, size, bits, shift, counts, keys[0], values[0])
    part._partition(keys[0], values[0], state, size, bits, shift + bits, counts, keys[1], values[1])
    valid = keys[1] >= 0
    regions = keys[1][valid].long() >> shift
    assert bool((regions[1:] >= regions[:-1]).all())
    assert int((~valid).sum()) == int((index < 0).sum())
    order = torch.argsort(values[1][valid])
    assert torch.equal(keys[1][valid][order].long(), index[index >= 0])


def meta(size: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.empty(size, dtype=dtype, device="meta")  # never allocated


def test_applies_where_sectors_take_several_stores(monkeypatch):
    monkeypatch.delenv("FLAGGEMS_GROUPED_SCATTER", raising=False)
    context.reset()
    monkeypatch.setattr(part, "l2_bytes", lambda device: 60 << 20)  # an H200's
    index = meta(2**29, torch.int64)
    for dtype in (torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.int32):
        assert part.applies(meta(2**30, dtype), index)  # the seed case: 16, 8 or 4 stores a sector
    assert not part.applies(meta(2**30, torch.float64), index)  # 2 a sector (and 8-byte elements)
    assert not part.applies(meta(2**28, torch.int64), index)  # 8-byte elements
    assert part.applies(meta(2**25), index[: 2**23])  # 64 MiB, 4 stores a sector
    assert not part.applies(meta(2**25), index[: 2**23 - 1])
    assert not part.applies(meta(2**25 - 1), index[: 2**23])  # below 64 MiB
    assert not part.applies(meta(2**28), index[: 2**22])  # a quarter store a sector
    assert part.applies(meta(2**26, torch.float32)[::2], index[: 2**25])  # the span counts: 4 a sector
    assert not part.applies(meta(2**26, torch.float32)[::2], index[: 2**24])  # 2 a sector
    assert not part.applies(meta(2**31), meta(2**31, torch.int64))  # beyond int32 keys
    monkeypatch.setattr(part, "l2_bytes", lambda device: 0)  # torch does not say: never grouped
    assert not part.applies(meta(2**30), index)
    monkeypatch.setattr(part, "l2_bytes", lambda device: None)
    monkeypatch.setenv("FLAGGEMS_GROUPED_SCATTER", "0")
    context.reset()
    assert not part.applies(meta(2**30), index)
    context.reset()


def test_digit_bits_are_the_fewest_whose_regions_fit_the_l2_cache(monkeypatch):
    monkeypatch.setattr(part, "l2_bytes", lambda device: 60 << 20)  # an H200's: 40 MB for a region
    assert part.digit_bits(meta(2**30)) == 3  # 32 MiB regions
    assert part.digit_bits(meta(2**30, torch.float32)) == 4  # 64 MiB at 3 bits; 16 MiB at 4
    assert part.digit_bits(meta(2**31, torch.float32)) == 4  # 32 MiB
    assert part.digit_bits(meta(2**30, torch.float32)[::4]) == 4  # the span counts: 16 MiB
    assert part.digit_bits(meta(2**32, torch.float32)) is None  # 64 MiB even at 4 bits
    monkeypatch.setattr(part, "l2_bytes", lambda device: 40 << 20)  # an A100's: 26.7 MB
    assert part.digit_bits(meta(2**30)) == 4  # 8 MiB
    assert part.digit_bits(meta(2**29)) == 3  # 16 MiB
    monkeypatch.setattr(part, "l2_bytes", lambda device: 0)
    assert part.digit_bits(meta(2**20)) is None
    monkeypatch.setattr(part, "l2_bytes", lambda device: None)  # no L2 size to respect
    assert part.digit_bits(meta(2**31, torch.float32)) == 3


@pytest.mark.parametrize("inplace", [True, False])
def test_index_copy_routes_a_large_1d_scatter_through_it(small, monkeypatch, inplace):
    set_kernel_context(monkeypatch, checks=False)
    calls = []
    real = part.grouped_scatter
    monkeypatch.setattr(part, "grouped_scatter", lambda *a: calls.append(1) or real(*a))
    size, n = 3000, 2000
    gen = torch.Generator().manual_seed(7)
    dest = torch.randn(size, generator=gen).to(DEV, torch.float16).reshape(1, size, 1)
    index = torch.randperm(size, generator=gen)[:n].to(DEV)
    source = torch.randn(1, n, 1, generator=gen).to(DEV, torch.float16)
    with native_scope():
        expected = dest.index_copy(1, index, source)
    with flaggems.enabled():
        out = dest.index_copy_(1, index, source) if inplace else torch.index_copy(dest, 1, index, source)
    context.reset()
    assert calls == [1]
    assert torch.equal(out, expected)


def test_index_copy_leaves_a_sparse_scatter_to_the_plain_kernel(small, monkeypatch):
    """Under ``MIN_SECTOR_STORES`` stores a sector, grouping costs more than it merges."""
    set_kernel_context(monkeypatch, checks=False)
    monkeypatch.setattr(part, "grouped_scatter", lambda *a: pytest.fail("grouped a sparse scatter"))
    size, n = 3000, 300  # 1.6 stores a sector
    gen = torch.Generator().manual_seed(11)
    dest = torch.randn(size, generator=gen).to(DEV, torch.float16)
    index = torch.randperm(size, generator=gen)[:n].to(DEV)
    source = torch.randn(n, generator=gen).to(DEV, torch.float16)
    with native_scope():
        expected = dest.index_copy(0, index, source)
    with flaggems.enabled():
        out = torch.index_copy(dest, 0, index, source)
    context.reset()
    assert torch.equal(out, expected)


@CUDA
def test_no_host_sync_and_a_cuda_graph_replays_new_indices(small):
    size, n = 1 << 16, 40000
    gen = torch.Generator().manual_seed(8)
    dest = torch.zeros(size, device="cuda", dtype=torch.float16)
    index = torch.randperm(size, generator=gen)[:n].cuda()
    source = torch.randn(n, generator=gen).cuda().half()
    part.grouped_scatter(dest, index, source)  # compiles outside the checks below
    torch.cuda.set_sync_debug_mode("error")
    try:
        part.grouped_scatter(dest, index, source)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        state = part.grouped_scatter(dest, index, source)
    for seed in (9, 10):
        index.copy_(torch.randperm(size, generator=torch.Generator().manual_seed(seed))[:n])
        dest.zero_()
        graph.replay()
        assert int(state[0]) == 1
        assert torch.equal(dest, reference(torch.zeros_like(dest), index, source))


@CUDA
def test_the_l2_size_is_read_from_the_device():
    size = part.l2_bytes(torch.device("cuda"))
    assert size == torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size > 0
