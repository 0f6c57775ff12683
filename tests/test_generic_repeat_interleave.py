"""repeat_interleave end to end: the expand and the scan, their state, bad repeats in bounds, no host sync and
CUDA graphs with a known output size, outputs past 2**31."""

from __future__ import annotations

import pytest
import torch
from conftest import set_kernel_context

import flaggems
from flaggems.binding import native_scope
from flaggems.toolkit import context
from flaggems.toolkit.dependent_launch import dependent_launch
from flaggems.toolkit.workspace import zeroed_scratch

DEV = torch.device(flaggems.backend().device_type)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def seed_repeats(rows: int, items: int, dev=DEV) -> torch.Tensor:
    r = torch.full((rows,), items // rows, dtype=torch.int64, device=dev)
    r[: items % rows] += 1
    return r


def native_repeat_interleave(*args, **kwargs) -> torch.Tensor:
    """torch's own kernel: on a machine without a GPU flaggems routes CPU tensors too."""
    with native_scope():
        return torch.repeat_interleave(*args, **kwargs)


@pytest.fixture
def small_tiles(monkeypatch):
    """The repeat_interleave kernels with 8-element blocks of 2-element sub-blocks and a 4-way search,
    scanned 4 rows a chunk with a look-back of 2 chunks a step and 2 blocks a tile.

    Many programs, every one of the expand's three searches takes several steps,
    and the scan's look-back walks several windows.
    """
    from flaggems.plugins.generic import repeat_interleave as ri

    scan = {"block": 8, "sub": 2, "fanout": 4, "chunk": 4, "lookback": 2, "tile": 2}
    set_kernel_context(monkeypatch, tuning=lambda key: scan if key == "scan" else {})
    kernels = ri._kernels(torch.empty(0, device=DEV).device)  # the op's calls use this object (cuda:0, not cuda)
    sizes = (kernels.block, kernels.sub, kernels.fanout, kernels.chunk, kernels.lanes, kernels.tile)
    assert sizes == (8, 2, 4, 4, 2, 2)
    return kernels


EXPAND_PATTERNS = {
    "seed-like": [3, 2] * 20,
    "zeros inside and at both ends": [0, 0, 5, 0, 1, 0, 0, 9, 0, 2, 0, 0],
    "one long row": [0, 1, 37, 1, 0],
    "all ones": [1] * 29,
    "single row": [13],
    "zero rows past the last output": [4, 4] + [0] * 70,
}


@pytest.mark.parametrize("pattern", EXPAND_PATTERNS, ids=list(EXPAND_PATTERNS))
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_expand_matches_torch(pattern, dtype, unchecked, small_tiles):
    repeats = torch.tensor(EXPAND_PATTERNS[pattern], dtype=dtype, device=DEV)
    total = int(repeats.sum())
    expected = native_repeat_interleave(repeats.cpu())
    assert torch.equal(torch.repeat_interleave(repeats, output_size=total).cpu(), expected)
    assert torch.equal(torch.repeat_interleave(repeats).cpu(), expected)
    for values in (torch.arange(100, 100 + repeats.numel(), device=DEV),
                   torch.randn(repeats.numel(), device=DEV).to(torch.bfloat16),
                   torch.randn(2 * repeats.numel(), dtype=torch.float64, device=DEV)[::2]):  # strided values
        actual = torch.repeat_interleave(values, repeats, output_size=total)
        assert torch.equal(actual.cpu(), values.cpu()[expected.long()])


def test_expand_many_sparse_rows(unchecked):
    """More rows than FANOUT**2 (a three-step search), most of them empty, at the real block size."""
    gen = torch.Generator().manual_seed(0)
    repeats = (torch.rand(70_000, generator=gen) < 0.05).long() * torch.randint(1, 4, (70_000,), generator=gen)
    expected = native_repeat_interleave(repeats)
    actual = torch.repeat_interleave(repeats.to(DEV), output_size=expected.numel())
    assert torch.equal(actual.cpu(), expected)


@pytest.mark.parametrize("rows", [1, 4, 5, 37, 300])
def test_scan_leaves_its_state_zeroed(rows, unchecked, small_tiles):
    """The scan's status words (a look-back over up to 75 chunks of 4 rows) end zeroed by the expand.

    Rows with several block starts each (repeats over the 8-element block)
    take the scan's tiled first-row search; the others one store a row.
    """
    gen = torch.Generator().manual_seed(rows)
    for high in (3, 40):
        repeats = torch.randint(0, high, (rows,), generator=gen).to(DEV)
        expected = native_repeat_interleave(repeats.cpu())
        actual = torch.repeat_interleave(repeats, output_size=expected.numel())
        assert torch.equal(actual.cpu(), expected), (rows, high)
        assert not bool(zeroed_scratch(repeats, 1).any())


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_scan_reads_strided_repeats(dtype, unchecked, small_tiles):
    """The scan reads ``repeats`` through its stride: every third element of a longer tensor."""
    gen = torch.Generator().manual_seed(7)
    repeats = torch.randint(0, 12, (90,), generator=gen).to(dtype).to(DEV)[::3]
    expected = native_repeat_interleave(repeats.cpu())
    values = torch.arange(30.0, device=DEV)
    assert torch.equal(torch.repeat_interleave(repeats, output_size=expected.numel()).cpu(), expected)
    assert torch.equal(torch.repeat_interleave(values, repeats, output_size=expected.numel()).cpu(),
                       values.cpu()[expected.long()])


def _fail_the_expand(small_tiles, monkeypatch, sized: bool) -> None:
    """``repeat_interleave(repeats)`` (``sized``: given its ``output_size``) whose expand raises after the scan
    ran (a compile error, say): no status word stays set, and the next call is served."""
    repeats = torch.tensor([3, 0, 4, 2, 5, 1, 1, 7, 2], device=DEV)
    size = {"output_size": int(repeats.sum())} if sized else {}

    def failing_launcher(gather, table, dependent):
        def launch(*args):
            raise RuntimeError("expand failed")
        return launch

    with monkeypatch.context() as patch:
        patch.setattr(small_tiles, "expand", failing_launcher)
        with pytest.raises(RuntimeError, match="expand failed"):
            torch.repeat_interleave(repeats, **size)
    assert not bool(zeroed_scratch(repeats, 1).any())
    assert torch.equal(torch.repeat_interleave(repeats, **size).cpu(), native_repeat_interleave(repeats.cpu()))


def test_scan_state_is_zeroed_when_the_expand_fails(unchecked, small_tiles, monkeypatch):
    """An expand that raises after the scan ran (a compile error, say) must not leave status words set."""
    _fail_the_expand(small_tiles, monkeypatch, sized=True)


@pytest.mark.parametrize("known_size", [True, False], ids=["output_size", "dynamic"])
def test_another_thread_between_scan_and_expand_waits(known_size, unchecked, small_tiles, monkeypatch):
    """Two threads on one stream: a call of the other thread must not run its scan between this
    thread's scan and expand (Triton's launch releases the GIL), or it would read status words still
    set. The first thread pauses after its scan until the second finishes, at most 1 s: the second
    must wait for the first's expand instead: the launches come in pairs, and both results are right.
    (Without the lock the results alone would catch only the dynamic case in the interpreter, which
    runs a scan's chunks in order, each publishing before the next looks back; the order catches both.)
    """
    import threading

    first = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3], device=DEV)  # 3 chunks of 4 rows
    second = torch.tensor([2, 7, 1, 8, 2, 8, 1, 8, 2], device=DEV)
    sizes = {"first": int(first.sum()), "second": int(second.sum())}
    from flaggems.plugins.generic import repeat_interleave as ri

    real_scan, real_launcher = ri._scan, small_tiles.expand
    first_scanned, second_done = threading.Event(), threading.Event()
    results: dict[str, torch.Tensor] = {}
    launches: list[tuple[str, str]] = []

    def logged_launcher(*key):
        launch = real_launcher(*key)

        def logged(*args):
            launches.append(("expand", threading.current_thread().name))
            return launch(*args)
        return logged

    def scan_then_pause(*args, **kwargs):
        ends = real_scan(*args, **kwargs)
        launches.append(("scan", threading.current_thread().name))
        if threading.current_thread().name == "first":
            first_scanned.set()
            second_done.wait(timeout=1.0)
        return ends

    def call(name: str, repeats: torch.Tensor) -> None:
        if name == "second":
            first_scanned.wait(timeout=10.0)
        size = sizes[name] if known_size else None
        results[name] = torch.repeat_interleave(repeats, output_size=size)
        if name == "second":
            second_done.set()

    monkeypatch.setattr(ri, "_scan", scan_then_pause)
    monkeypatch.setattr(small_tiles, "expand", logged_launcher)
    threads = [threading.Thread(target=call, args=(name, repeats), name=name)
               for name, repeats in (("first", first), ("second", second))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert launches == [("scan", "first"), ("expand", "first"), ("scan", "second"), ("expand", "second")]
    assert torch.equal(results["first"].cpu(), native_repeat_interleave(first.cpu()))
    assert torch.equal(results["second"].cpu(), native_repeat_interleave(second.cpu()))
    assert not bool(zeroed_scratch(first, 1).any())


@pytest.mark.parametrize("rows", [1, 5, 37, 130])
def test_dynamic_size_scan_summary(rows, unchecked, small_tiles):
    """Without output_size the scan also writes the total and the smallest negative repeat (many chunks);
    a negative repeat in any chunk raises torch's error, and the status words end zeroed either way.
    """
    gen = torch.Generator().manual_seed(rows)
    values = torch.arange(rows, device=DEV) * 10
    for high in (1, 3, 12):
        repeats = torch.randint(0, high, (rows,), generator=gen).to(DEV)
        expected = native_repeat_interleave(repeats.cpu())
        assert torch.equal(torch.repeat_interleave(repeats).cpu(), expected), (rows, high)
        assert torch.equal(torch.repeat_interleave(values, repeats).cpu(), values.cpu()[expected]), (rows, high)
        assert not bool(zeroed_scratch(repeats, 1).any())
    for at in sorted({0, rows // 2, rows - 1}):
        repeats = torch.randint(0, 5, (rows,), generator=gen)
        repeats[at] = -1
        with pytest.raises(RuntimeError, match="repeats can not be negative"):
            torch.repeat_interleave(repeats.to(DEV))
        assert not bool(zeroed_scratch(values, 1).any()), at


def test_dynamic_size_scan_state_is_zeroed_when_the_expand_fails(unchecked, small_tiles, monkeypatch):
    """Without output_size: an expand that raises after the scan and the sync must not leave status set."""
    _fail_the_expand(small_tiles, monkeypatch, sized=False)


@pytest.mark.parametrize("size_error", [-5, 7])
def test_expand_wrong_output_size_stays_in_bounds(size_error, unchecked, small_tiles):
    """Whatever output_size says, only [0, output_size) is written, with row ids in [0, n)."""
    repeats = torch.tensor([3, 0, 4, 2, 5], device=DEV)
    total = int(repeats.sum()) + size_error
    buffer = torch.full((total + 4,), -7, dtype=torch.int64, device=DEV)
    out = buffer[2:-2]  # launched on a view: its neighbours must stay -7
    small_tiles.expand(False, False, False)((-(-total // 8),), torch.cumsum(repeats, 0), out, out, total, 5,
                                            small_tiles.rank_steps(5), 0, out, 0)
    assert buffer[:2].tolist() == [-7, -7] and buffer[-2:].tolist() == [-7, -7]
    assert bool(((out >= 0) & (out < 5)).all())
    exact = native_repeat_interleave(repeats.cpu())
    common = min(total, exact.numel())
    assert torch.equal(out[:common].cpu(), exact[:common])
    through_op = torch.repeat_interleave(repeats, output_size=total)  # and through the op
    assert through_op.shape == (total,) and bool(((through_op >= 0) & (through_op < 5)).all())


def test_expand_negative_repeats_stay_in_bounds(unchecked, small_tiles):
    values = torch.arange(6.0, device=DEV)
    out = torch.repeat_interleave(values, torch.tensor([2, -3, 4, 1, 0, 5], device=DEV), output_size=12)
    assert out.shape == (12,) and bool(((out >= 0) & (out < 6)).all())


def test_expand_invalid_repeats_write_every_position_in_range(unchecked, small_tiles):
    """Negative repeats (non-monotonic ends): every output position is written, with a row in [0, n).

    Launched on a buffer of -7s, whatever the ends say (a variant that wrote
    short rows by tiles needed this check, run 5); both ways of finding a
    block's first row: searched, and read from the scan's table (whose
    entries such ends may leave unwritten: here filled with garbage first).
    """
    from flaggems.plugins.generic import repeat_interleave as ri

    gen = torch.Generator().manual_seed(3)
    for _ in range(60):
        repeats = torch.randint(-3, 6, (9,), generator=gen).to(DEV)
        total = 24
        for table in (False, True):
            out = torch.full((total,), -7, dtype=torch.int64, device=DEV)
            chunks, status = (3, zeroed_scratch(repeats, 3)) if table else (0, out)
            dependent = table and dependent_launch(repeats)
            if table:
                ends = ri._scan(small_tiles, repeats, total, status, dependent)
                ends[9:] = torch.randint(-(2**40), 2**40, (3,), generator=gen).to(DEV).where(
                    torch.rand(3, generator=gen).to(DEV) < 0.5, ends[9:])
            else:
                ends = torch.cumsum(repeats, 0)
            expand = small_tiles.expand(False, table, dependent)
            expand((3,), ends, out, out, total, 9, small_tiles.rank_steps(9), 0, status, chunks)
            assert bool(((out >= 0) & (out < 9)).all()), (repeats.tolist(), table, out.tolist())
            assert not bool(status[:chunks].any()), "the expand left the scan's status set"


def test_composite_overloads_keep_autograd():
    x = torch.randn(3, 4, device=DEV, requires_grad=True)
    with flaggems.enabled():
        y = x.repeat_interleave(2, dim=0)
        z = x.repeat_interleave(torch.tensor([1, 2, 0], device=DEV), dim=0)
        (y.sum() + z.sum()).backward()
    # d/dx: 2 copies each from y, plus 1, 2, 0 copies from z
    assert torch.equal(x.grad, torch.tensor([3.0, 4, 2], device=DEV)[:, None].expand(3, 4))


@pytest.fixture
def gpu_default_checks(monkeypatch):
    """The GPU default: no synchronous checks (the suite runs with FLAGGEMS_CHECK_INDICES=1)."""
    set_kernel_context(monkeypatch, checks=False)
    yield
    context.reset()


@CUDA
@pytest.mark.parametrize("case", ["values_known", "tensor_known", "scalar_tensor_known", "self_int"])
def test_known_output_size_has_no_host_sync(case, gpu_default_checks):
    rows, items = 17096, 854524
    r = seed_repeats(rows, items, "cuda")
    x = torch.arange(rows, device="cuda")
    three = torch.tensor(3, device="cuda")  # built before the check: a host-to-device copy synchronises
    run = {
        "values_known": lambda: torch.repeat_interleave(x, r, output_size=items),
        "tensor_known": lambda: torch.repeat_interleave(r, output_size=items),
        "scalar_tensor_known": lambda: x.repeat_interleave(three, output_size=3 * rows),
        "self_int": lambda: x.repeat_interleave(4, output_size=4 * rows),
    }[case]
    with flaggems.enabled():
        expected = run().clone()  # warm-up compiles outside the sync check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            actual = run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(actual, expected)


@CUDA
def test_known_output_size_captures_in_cuda_graph(gpu_default_checks):
    rows, items = 17096, 854524
    r = seed_repeats(rows, items, "cuda")
    x = torch.arange(rows, device="cuda")
    with flaggems.enabled():
        reference = torch.repeat_interleave(x, r, output_size=items).clone()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch.repeat_interleave(x, r, output_size=items)  # warm up on the capture stream
            torch.repeat_interleave(r, output_size=items)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            values = torch.repeat_interleave(x, r, output_size=items)
            rows_out = torch.repeat_interleave(r, output_size=items)
        r.copy_(seed_repeats(rows, items, "cuda").flip(0))
        graph.replay()
        torch.cuda.synchronize()
    flipped = seed_repeats(rows, items, "cuda").flip(0)
    assert torch.equal(values, torch.repeat_interleave(x, flipped, output_size=items))
    assert torch.equal(rows_out, torch.repeat_interleave(flipped, output_size=items))
    assert not torch.equal(values, reference)


@CUDA
@pytest.mark.parametrize("dependent", ["1", "0"], ids=["dependent-launch", "stream-order"])
def test_back_to_back_known_size_calls_see_their_own_scan(dependent, gpu_default_checks, monkeypatch):
    """Many calls queued without a sync, each expand launched to overlap its scan where the GPU allows.

    An expand that read its scan's ends before they were written (a missing
    wait) would show here as wrong rows in some of the 40 outputs.
    """
    from flaggems.plugins.generic import repeat_interleave as ri
    from flaggems.toolkit import dependent_launch as dl

    monkeypatch.setenv("FLAGGEMS_DEPENDENT_LAUNCH", dependent)
    context.reset()
    gen = torch.Generator().manual_seed(8)
    rows, items = 17096, 854524
    repeats = [seed_repeats(rows, items, "cuda")[torch.randperm(rows, generator=gen).cuda()] for _ in range(40)]
    values = torch.randn(rows, device="cuda")
    try:
        with flaggems.enabled():
            torch.cuda.synchronize()
            outs = [torch.repeat_interleave(values, r, output_size=items) if i % 2 else
                    torch.repeat_interleave(r, output_size=items) for i, r in enumerate(repeats)]
        overlapped = dl.dependent_launch(repeats[0])
        expands = set(ri._kernels(repeats[0].device)._expand)  # the launchers the calls built
    finally:
        context.reset()
    assert overlapped == (dependent == "1" and torch.version.hip is None
                          and torch.cuda.get_device_capability(0)[0] >= 9)
    assert ((False, True, True) in expands) or not overlapped
    for i, (r, out) in enumerate(zip(repeats, outs, strict=True)):
        rows_out = native_repeat_interleave(r, output_size=items)
        assert torch.equal(out, values[rows_out] if i % 2 else rows_out), i


@CUDA
def test_known_output_size_graph_replays_track_new_repeats(gpu_default_checks):
    """Replayed again and again, the scan (which resets its own state) follows the repeats' new values."""
    rows, items = 70_000, 2_000_000
    gen = torch.Generator().manual_seed(5)
    r = seed_repeats(rows, items, "cuda")
    with flaggems.enabled():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch.repeat_interleave(r, output_size=items)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = torch.repeat_interleave(r, output_size=items)
        for _ in range(5):
            r.copy_(seed_repeats(rows, items, "cuda")[torch.randperm(rows, generator=gen).cuda()])
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, native_repeat_interleave(r, output_size=items))


@CUDA
def test_known_output_size_on_two_streams_at_once(gpu_default_checks):
    """Each stream has its own scan state: calls running concurrently on two streams stay correct."""
    gen = torch.Generator().manual_seed(6)
    first = ((torch.rand(300_000, generator=gen) < 0.2).long() * torch.randint(1, 60, (300_000,), generator=gen))
    second = torch.randint(0, 100, (17_096,), generator=gen)
    cases = [(r.cuda(), int(r.sum())) for r in (first, second)]
    expected = [native_repeat_interleave(r, output_size=total) for r, total in cases]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()
    results = []
    with flaggems.enabled():
        for _ in range(30):
            for stream, (r, total) in zip(streams, cases):
                with torch.cuda.stream(stream):
                    results.append(torch.repeat_interleave(r, output_size=total))
    torch.cuda.synchronize()
    for i, out in enumerate(results):
        assert torch.equal(out, expected[i % 2])


@CUDA
def test_repeat_interleave_beyond_2_31_outputs():
    """int32 rows past 2**31 outputs: 64-bit positions in the search and the stores (8 GB)."""
    repeats = torch.tensor([2**30, 0, 2**30 + 100], dtype=torch.int32, device="cuda")
    with flaggems.enabled():
        out = torch.repeat_interleave(repeats, output_size=2**31 + 100)
    assert out.dtype == torch.int32 and out.numel() == 2**31 + 100
    assert out[2**30 - 2:2**30 + 2].tolist() == [0, 0, 2, 2]
    assert out[-3:].tolist() == [2, 2, 2] and int(out[:2**30].max()) == 0 and int(out[2**30:].min()) == 2
