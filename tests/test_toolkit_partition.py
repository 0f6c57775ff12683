"""The grouped scatter (toolkit.partition): exact results, the probe's choice, grouping order, routing."""

from __future__ import annotations

import pytest
import torch

import flaggems
from flaggems.binding import native_scope
from flaggems.toolkit import checks
from flaggems.toolkit import partition as part

DEV = torch.device(flaggems.backend().device_type)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def small(monkeypatch):
    """64-pair blocks, 3 programs looping over them, 16-element probe windows, no size threshold."""
    settings = {"BLOCK": 64, "PROGRAMS": 3, "WINDOW": 16, "SCATTER_BLOCK": 32, "MIN_INDICES": 1,
                "MIN_DEST_BYTES": 1, "_LAUNCHERS": {}, "_ENABLED": True}
    for name, value in settings.items():
        monkeypatch.setattr(part, name, value)
    return part


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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("kind", "grouped"), [("random", 1), ("sorted", 0), ("interleaved", 0)])
@pytest.mark.parametrize(("size", "n"), [(4096, 3000), (1000, 999), (777, 5), (2048, 1024)])
def test_exact_and_the_probe_chooses(small, dtype, kind, grouped, size, n):
    gen = torch.Generator().manual_seed(size + n)
    index = make_index(kind, size, n, gen)
    dest = torch.randn(size, generator=gen).to(DEV, dtype)
    source = torch.randn(index.numel(), generator=gen).to(DEV, dtype)
    expected = reference(dest, index, source)
    state = part.grouped_scatter(dest, index, source)
    assert torch.equal(dest, expected)
    if n >= 64:  # a handful of indices touch few regions whatever their order
        assert int(state[0]) == grouped


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


def test_two_passes_group_the_pairs_by_region(small):
    """After both passes the keys' regions never decrease, and every valid pair is there once."""
    size, n = 4096, 3000
    index = torch.randperm(size, generator=torch.Generator().manual_seed(6))[:n].to(DEV)
    index[::97] = -5
    source = torch.arange(float(n), device=DEV)
    shift = part.region_shift(size)
    state = torch.ones(1, dtype=torch.int32, device=DEV)
    counts = torch.empty(part.DIGITS * -(-n // part.BLOCK) + 1, dtype=torch.int32, device=DEV)
    keys = [torch.empty(n, dtype=torch.int32, device=DEV) for _ in range(2)]
    values = [torch.empty(n, device=DEV) for _ in range(2)]
    part._partition(index, source, state, size, shift, counts, keys[0], values[0])
    part._partition(keys[0], values[0], state, size, shift + part.DIGIT_BITS, counts, keys[1], values[1])
    valid = keys[1] >= 0
    regions = keys[1][valid].long() >> shift
    assert bool((regions[1:] >= regions[:-1]).all())
    assert int((~valid).sum()) == int((index < 0).sum())
    order = torch.argsort(values[1][valid])
    assert torch.equal(keys[1][valid][order].long(), index[index >= 0])


def test_applies_to_large_two_byte_scatters_only(monkeypatch):
    monkeypatch.delenv("FLAGGEMS_GROUPED_SCATTER", raising=False)
    monkeypatch.setattr(part, "_ENABLED", None)
    dest = torch.empty(2**28, dtype=torch.float16, device="meta")  # 512 MiB, never allocated
    index = torch.empty(2**22, dtype=torch.int64, device="meta")
    assert part.applies(dest, index)
    assert part.applies(torch.empty(2**27, dtype=torch.bfloat16, device="meta"), index)
    assert not part.applies(torch.empty(2**28, device="meta"), index)  # 4-byte elements
    assert not part.applies(dest, index[: 2**22 - 1])
    assert not part.applies(dest[: 2**27 - 1], index)
    assert not part.applies(torch.empty(2**31, dtype=torch.float16, device="meta"), index)
    monkeypatch.setattr(part, "l2_bytes", lambda device: 60 << 20)  # an H200's: 32 MiB regions fit
    assert part.applies(torch.empty(2**30, dtype=torch.float16, device="meta"), index)
    monkeypatch.setattr(part, "l2_bytes", lambda device: 40 << 20)  # an A100's: they do not
    assert not part.applies(torch.empty(2**30, dtype=torch.float16, device="meta"), index)
    assert part.applies(torch.empty(2**29, dtype=torch.float16, device="meta"), index)  # 16 MiB regions
    monkeypatch.setattr(part, "l2_bytes", lambda device: 0)  # torch does not say: never grouped
    assert not part.applies(dest, index)
    monkeypatch.setattr(part, "l2_bytes", lambda device: None)
    monkeypatch.setenv("FLAGGEMS_GROUPED_SCATTER", "0")
    part.reset()
    assert not part.applies(dest, index)
    part.reset()


@pytest.mark.parametrize("inplace", [True, False])
def test_index_copy_routes_a_large_1d_scatter_through_it(small, monkeypatch, inplace):
    monkeypatch.setattr(checks, "_ENABLED", False)
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
    checks.reset()
    assert calls == [1]
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
