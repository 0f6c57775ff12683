"""flaggems-hygon: sync-free ``repeat_interleave`` with ``output_size`` and ``index_select`` on a DCU (seed 002).

The DCU runs the generic kernels; the plugin supplies configuration: the
wavefront width, through the device facts that size the shared scan. These
tests run wherever the ``hygon`` backend is active: simulated
on the CPU interpreter (``tox -e hygon``) or on a GPU
(``FLAGGEMS_VENDOR=hygon``), and on a DCU. The GPU-only ones prove what the
interpreter cannot: no host synchronisation, and CUDA-graph capture.
"""

from __future__ import annotations

import pytest
import torch
from conftest import set_kernel_context

import flaggems
from flaggems.binding import native_scope
from flaggems.toolkit import context
from flaggems.toolkit.context import DeviceFacts
from flaggems.toolkit.launch import FastLauncher

pytestmark = pytest.mark.skipif(flaggems.backend().name != "hygon",
                                reason="the hygon backend is not active (FLAGGEMS_VENDOR=hygon)")
DEV = torch.device(flaggems.backend().device_type)
GPU = pytest.mark.skipif(DEV.type != "cuda", reason="needs a GPU (synchronisation and graphs)")
ROUTED = ("repeat_interleave.Tensor", "repeat_interleave.self_Tensor", "repeat_interleave.self_int", "index_select")


def _seed_case(rows: int = 17096, items: int = 854524) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The seed's repeats (``items // rows`` each, the remainder spread over the first rows) and values."""
    repeats = torch.full((rows,), items // rows, dtype=torch.int64)
    repeats[: items % rows] += 1
    return repeats.to(DEV), torch.arange(rows).to(DEV), items


def _expected(repeats: torch.Tensor, values: torch.Tensor | None = None) -> torch.Tensor:
    with native_scope():
        cpu = repeats.cpu()
        return torch.repeat_interleave(cpu) if values is None else torch.repeat_interleave(values.cpu(), cpu)


@pytest.fixture
def ri():
    """flaggems enabled; the generic repeat_interleave module (whose kernels the DCU runs)."""
    from flaggems.plugins.generic import repeat_interleave

    with flaggems.enabled():
        yield repeat_interleave


@pytest.fixture
def launches(monkeypatch) -> list[str]:
    """Names of the kernels launched through the toolkit while planning in Python (first calls of a key)."""
    seen: list[str] = []
    original = FastLauncher.__call__

    def spy(self, grid, *args):
        seen.append(getattr(self.fn, "fn", self.fn).__name__)
        return original(self, grid, *args)

    monkeypatch.setattr(FastLauncher, "__call__", spy)
    return seen


def test_the_generic_kernels_serve_the_dcu(ri):
    chosen = {r["op"]: r["chosen"] for r in flaggems.routes() if r["op"] in ROUTED}
    assert chosen == dict.fromkeys(ROUTED, "generic")
    assert flaggems.tuning("scan") == {}  # the generic scan policy; the wavefront width comes from the facts


def test_a_64_wide_wavefront_sizes_the_scan(ri, monkeypatch):
    """Device facts of a DCU: two wavefronts a program (128 threads), a 64-chunk look-back; exact over windows."""
    current = context.current()
    set_kernel_context(monkeypatch, facts_source=lambda index: DeviceFacts(warp_size=64),
                       tuning=lambda key: {"chunk": 4, "block": 8, "sub": 2, "tile": 2}
                       if key == "scan" else current.tuning(key))
    kernels = ri._kernels(torch.empty(0, device=DEV).device)
    assert (kernels.lanes, kernels.warps) == (64, 2)
    set_kernel_context(monkeypatch, checks=False)  # the known-size path as on a device (no validation sync)
    gen = torch.Generator().manual_seed(4)
    repeats = torch.randint(0, 6, (300,), generator=gen).to(DEV)  # 75 chunks: two look-back windows
    values = torch.randn(300, generator=gen).to(DEV)
    total = int(repeats.sum())
    assert torch.equal(torch.repeat_interleave(repeats, output_size=total).cpu(), _expected(repeats))
    assert torch.equal(torch.repeat_interleave(values, repeats, output_size=total).cpu(), _expected(repeats, values))
    assert torch.equal(torch.repeat_interleave(repeats).cpu(), _expected(repeats))


def test_output_size_reaches_the_implementation_and_nothing_is_read_back(ri, monkeypatch):
    """Both APIs with a known size: the implementation gets output_size and never takes the dynamic path."""
    set_kernel_context(monkeypatch, checks=False)
    sizes: list[int | None] = []
    real_expand = ri._expand

    def expand(repeats, output_size, values):
        sizes.append(output_size)
        return real_expand(repeats, output_size, values)

    def forbidden(*args, **kwargs):
        raise AssertionError("a known-size call read its size back from the device")

    monkeypatch.setattr(ri, "_expand", expand)
    monkeypatch.setattr(ri, "_expand_dynamic", forbidden)
    monkeypatch.setattr(ri, "_checked_output_size", forbidden)
    repeats, values, items = _seed_case(1709, 85452)
    tensor_api = torch.repeat_interleave(repeats, output_size=items)
    values_api = torch.repeat_interleave(values, repeats, output_size=items)
    assert sizes == [items, items]
    assert torch.equal(tensor_api.cpu(), _expected(repeats))
    assert torch.equal(values_api.cpu(), _expected(repeats, values))


def test_the_values_api_is_a_scan_and_a_gathering_expand_and_index_select_one_gather(ri, launches, monkeypatch):
    """No index_select launch and no range-check pass on the values path; index_select alone is one launch."""
    set_kernel_context(monkeypatch, checks=False)
    repeats, values, items = _seed_case(1709, 85452)
    torch.repeat_interleave(values, repeats, output_size=items)
    assert launches == ["_scan_kernel", "_expand_kernel"], launches
    launches.clear()
    rows = torch.randint(0, 1709, (4096,)).to(DEV)
    torch.index_select(values, 0, rows)
    assert len(launches) == 1 and "index" in launches[0], launches


def test_invalid_repeats_follow_the_contract_without_a_check_on_the_known_size_path(ri, monkeypatch):
    repeats = torch.tensor([3, -2, 4], device=DEV)
    set_kernel_context(monkeypatch, checks=True)  # checking on (FLAGGEMS_CHECK_INDICES=1): torch's errors
    with pytest.raises(RuntimeError, match="repeats can not be negative"):
        torch.repeat_interleave(repeats, output_size=5)
    with pytest.raises(RuntimeError, match="allocated size does not match required size"):
        torch.repeat_interleave(repeats.abs(), output_size=8)
    set_kernel_context(monkeypatch, checks=False)  # as on a device by default: no sync, in-bounds values only
    out = torch.repeat_interleave(repeats, output_size=5)
    assert out.shape == (5,) and bool(((out >= 0) & (out < 3)).all())


@GPU
def test_known_size_paths_never_synchronise(ri, monkeypatch):
    set_kernel_context(monkeypatch, checks=False)
    repeats, values, items = _seed_case()
    calls = (lambda: torch.repeat_interleave(repeats, output_size=items),
             lambda: torch.repeat_interleave(values, repeats, output_size=items),
             lambda: torch.index_select(values, 0, repeats))
    for call in calls:
        call()  # compile and plan first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        results = [call() for call in calls for _ in range(3)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(results[0].cpu(), _expected(repeats))
    assert torch.equal(results[3].cpu(), _expected(repeats, values))


@GPU
def test_known_size_paths_capture_in_a_cuda_graph(ri, monkeypatch):
    set_kernel_context(monkeypatch, checks=False)
    repeats, values, items = _seed_case()
    torch.repeat_interleave(values, repeats, output_size=items)  # compile outside the capture
    torch.repeat_interleave(repeats, output_size=items)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        rows = torch.repeat_interleave(repeats, output_size=items)
        gathered = torch.repeat_interleave(values, repeats, output_size=items)
    torch.cuda.current_stream().wait_stream(stream)
    repeats.copy_(repeats.flip(0))  # new data, same total: the replay must see it
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(rows.cpu(), _expected(repeats))
    assert torch.equal(gathered.cpu(), _expected(repeats, values))

