"""Tuning probe for the GPU: where the time of the slow seed workloads goes.

Not a benchmark of record (``flaggems bench`` is): this times components and
sweeps the tile constants the kernels read from their modules, so a choice in
the code can cite a measured number.

    python benchmarks/probe.py [--json PATH] [--only repeat,group_norm,index]

Beside it: ``probe_common.py`` (the timing helpers and ``RESULTS``) and
``probe_group_norm.py`` (the group_norm, launch and passthrough sections).

Sections:

* ``repeat``: ``repeat_interleave`` at the seed size and larger, kernel time
  (``do_bench``) and host time per call, torch and flaggems.
  ``repeat_stages``: the expand kernel alone from 1 to 854524 rows;
  ``repeat_sweep``: its ``SUB``; ``repeat_host``: how host time leaks into
  ``do_bench``, against a replayed CUDA graph's GPU time; ``repeat_modes``:
  where a slow process's known-size call loses its time (run it in several).
* ``group_norm``: ``F.group_norm`` forward, the native backward and
  forward+backward; per-kernel GPU time from the profiler.
  ``group_norm_sweep``: ``TILE`` x ``NUM_WARPS`` x ``PROGRAMS_PER_SM``;
  ``group_norm_host``: host time per call, with real and with stubbed launches.
* ``launch_args``: host time of one FastLauncher launch against the kernel's
  argument count. ``autograd_launch``: the same launch in autograd's forward
  and backward threads, and a per-call timeline of group_norm forward+backward.
  ``passthrough``: small workloads through a Python kernel that only calls
  torch's own (the floor of any Python-registered implementation).
* ``index``: index_select / index_copy against torch; ``index_sweep``: the
  tile constants of ``flaggems.toolkit.indexing`` (``TILE`` x ``NUM_WARPS``;
  run 3 swept the small-workload ones).
* ``unet``: the model benchmark's UNet steps (fp16 forward, fp32
  forward+backward): GPU time per kernel name, torch and flaggems, and the
  small fp16 group_norm call's kernels and whether it synchronises.
* ``kernel_stats``: registers, spills, shared memory and the resident blocks
  per multiprocessor they allow, for every flaggems kernel compiled so far in
  the process (run it after the sections whose kernels it should list).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812
import triton
import triton.language as tl

import flaggems
from flaggems.toolkit import context

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helper modules beside this script
from probe_common import RESULTS, _policy_sweep, _profile_kernels, both, host_us, kernel_us, ours  # noqa: E402
from probe_group_norm import (  # noqa: E402
    probe_autograd_launch,
    probe_group_norm,
    probe_group_norm_host,
    probe_group_norm_policy,
    probe_group_norm_sweep,
    probe_launch_args,
    probe_passthrough,
)


# --------------------------------------------------------------------------- repeat_interleave
def probe_repeat() -> None:
    for rows, items in ((17096, 854524), (60000, 3_000_000), (17096, 50_000_000), (1000, 20_000_000)):
        repeats = torch.full((rows,), items // rows, dtype=torch.int64, device="cuda")
        repeats[: items % rows] += 1
        x = torch.arange(rows, device="cuda")
        half = torch.randn(rows, device="cuda").to(torch.bfloat16)
        cases = {
            "Tensor": lambda r=repeats, k=items: torch.repeat_interleave(r, output_size=k),
            "values": lambda r=repeats, k=items, v=x: torch.repeat_interleave(v, r, output_size=k),
            "values bf16": lambda r=repeats, k=items, v=half: torch.repeat_interleave(v, r, output_size=k),
        }
        for label, fn in cases.items():
            both(f"repeat {label} known {rows}->{items}", fn)
        both(f"repeat Tensor dynamic {rows}->{items}", lambda r=repeats: torch.repeat_interleave(r))
    y = torch.randn(4096, 64, device="cuda").to(torch.bfloat16)
    both("repeat self_int 4096x64 x4", lambda: y.repeat_interleave(4, dim=0))


def _spin(us: float) -> None:
    """Busy-wait ``us`` µs on the host: a slower host, simulated."""
    end = time.perf_counter_ns() + int(us * 1e3)
    while time.perf_counter_ns() < end:
        pass


def graph_us(fn: Callable[[], object], calls: int = 20, rounds: int = 5) -> float:
    """GPU µs a call, host excluded: a CUDA graph of ``calls`` calls replayed (median of ``rounds``)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def probe_repeat_host() -> None:
    """How host time leaks into ``do_bench``'s kernel time, for the seed repeat_interleave cases.

    Per case and side: do_bench with a busy-wait of 0-80 µs added before each
    call (a slower host), wall time per call, and (known sizes) the GPU time
    of a replayed CUDA graph, which no host speed changes. Then the host cost
    of our known-size call taken apart: routed, called directly, the two
    launches alone, and a pass-through Python kernel of torch's own.
    """
    from flaggems.plugins.generic import repeat_interleave as ri

    rows, items = 17096, 854524
    repeats = torch.full((rows,), items // rows, dtype=torch.int64, device="cuda")
    repeats[: items % rows] += 1
    x = torch.arange(rows, device="cuda")
    y = torch.randn(4096, 64, device="cuda").to(torch.bfloat16)
    cases = {
        "Tensor known": (True, lambda: torch.repeat_interleave(repeats, output_size=items)),
        "values known": (True, lambda: torch.repeat_interleave(x, repeats, output_size=items)),
        "Tensor dynamic": (False, lambda: torch.repeat_interleave(repeats)),
        "values dynamic": (False, lambda: torch.repeat_interleave(x, repeats)),
        "self_int bf16 4096x64 x4": (True, lambda: y.repeat_interleave(4, dim=0)),
    }
    for label, (graphable, fn) in cases.items():
        for side in ("torch", "ours"):
            (flaggems.enable if side == "ours" else flaggems.disable)()
            try:
                row = {f"spin{d}_us": kernel_us(lambda d=d, f=fn: (_spin(d), f())) for d in (0, 20, 40, 60, 80)}
                row["spin_alone_40_us"] = kernel_us(lambda: _spin(40))
                row["wall_us"] = host_us(fn)
                if graphable:
                    row["graph_us"] = graph_us(fn)
            finally:
                flaggems.disable()
            RESULTS[f"repeat host {label} {side}"] = row
            print(f"repeat host {label:28s} {side:5s} " + " ".join(f"{k}={v:.2f}" for k, v in row.items()),
                  flush=True)
    status_words = triton.cdiv(rows, ri._kernels(repeats.device).chunk)
    parts = {
        "routed": lambda: torch.repeat_interleave(repeats, output_size=items),
        "direct function": lambda: ri.repeat_interleave_tensor(repeats, items),
        "torch.empty of the output": lambda: torch.empty(items, dtype=torch.int64, device="cuda"),
        "claim_scratch lookup": lambda: ri.claim_scratch(repeats, status_words),
        "dependent_launch lookup": lambda: ri.dependent_launch(repeats),
    }
    for label, fn in parts.items():
        if label == "routed":
            flaggems.enable()
        RESULTS[f"repeat host part {label}"] = value = host_us(fn, 2000)
        flaggems.disable()
        print(f"repeat host part {label:40s} wall_us={value:.2f}", flush=True)
    from flaggems.binding import NativeKernel

    library = torch.library.Library("aten", "IMPL")
    native = NativeKernel.capture("repeat_interleave.Tensor", "CUDA")
    library.impl("repeat_interleave.Tensor", lambda *a, native=native, **k: native(*a, **k), "CUDA")
    try:
        value = host_us(lambda: torch.repeat_interleave(repeats, output_size=items), 2000)
    finally:
        library._destroy()
    RESULTS["repeat host part pass-through Python kernel"] = value
    print(f"repeat host part {'pass-through Python kernel':40s} wall_us={value:.2f}", flush=True)


def _current_cpu() -> int:
    """The CPU this process last ran on (field 39 of /proc/self/stat)."""
    with open("/proc/self/stat") as handle:
        return int(handle.read().rsplit(")", 1)[1].split()[36])


def probe_repeat_modes() -> None:
    """Why one process's bench of the known-size seed case takes 11 µs and another's 22-33.

    ``do_bench`` three times per side, then 200 calls timed as ``do_bench``
    times them (an L2 flush, a start event, the call, an end event) with an
    event recorded right after the scan's launch and host clocks at the
    launches: whether a slow process loses its time on the GPU (the scan or
    the expand) or waiting for the host to submit the expand.
    """
    from flaggems.plugins.generic import repeat_interleave as ri

    rows, items = 17096, 854524
    repeats = torch.full((rows,), items // rows, dtype=torch.int64, device="cuda")
    repeats[: items % rows] += 1
    fn = lambda: torch.repeat_interleave(repeats, output_size=items)  # noqa: E731
    row: dict[str, object] = {"cpu": _current_cpu()}
    for side in ("torch", "ours"):
        (flaggems.enable if side == "ours" else flaggems.disable)()
        row[f"{side}_do_bench_us"] = [round(kernel_us(fn), 2) for _ in range(3)]
    flaggems.enable()
    scan, marks = ri._scan, {}

    def marked_scan(*args, **kwargs):
        ends = scan(*args, **kwargs)
        marks["host_scan"] = time.perf_counter()
        marks["mid"].record()
        return ends

    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    samples: dict[str, list[float]] = {k: [] for k in ("flush", "to_scan_done", "scan_done_to_end", "total",
                                                         "host_to_scan", "host_scan_to_return")}
    ri._scan = marked_scan
    try:
        for _ in range(220):
            events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            marks["mid"] = events[2]
            events[0].record()
            flush.zero_()
            events[1].record()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            events[3].record()
            events[3].synchronize()
            samples["flush"].append(events[0].elapsed_time(events[1]) * 1e3)
            samples["to_scan_done"].append(events[1].elapsed_time(events[2]) * 1e3)
            samples["scan_done_to_end"].append(events[2].elapsed_time(events[3]) * 1e3)
            samples["total"].append(events[1].elapsed_time(events[3]) * 1e3)
            samples["host_to_scan"].append((marks["host_scan"] - t0) * 1e6)
            samples["host_scan_to_return"].append((t1 - marks["host_scan"]) * 1e6)
    finally:
        ri._scan = scan
        flaggems.disable()
    for key, values in samples.items():
        row[f"{key}_us"] = round(statistics.median(values[20:]), 2)
    row["cpu_after"] = _current_cpu()
    RESULTS["repeat modes"] = row
    print("repeat modes " + " ".join(f"{k}={v}" for k, v in row.items()), flush=True)


def probe_repeat_parts() -> None:
    """The seed's known-size Tensor case taken apart: torch's cumsum, our kernel alone, per-kernel GPU time."""
    from flaggems.plugins.generic import repeat_interleave as ri

    rows, items = 17096, 854524
    repeats = torch.full((rows,), items // rows, dtype=torch.int64, device="cuda")
    repeats[: items % rows] += 1
    ends = torch.cumsum(repeats, 0)
    out = torch.empty(items, dtype=torch.int64, device="cuda")
    kernels = ri._kernels(repeats.device)
    grid = (triton.cdiv(items, kernels.block),)
    both("parts: torch.cumsum alone", lambda: torch.cumsum(repeats, 0), routed=False)
    ours("parts: expand kernel alone", lambda: kernels.expand(False, False, False)(
        grid, ends, out, out, items, rows, kernels.rank_steps(rows), 0, out, 0))
    call = lambda: torch.repeat_interleave(repeats, output_size=items)  # noqa: E731
    for side, routed in (("ours", True), ("torch", False)):
        RESULTS[f"parts: {side} kernels"] = kernels = _profile_kernels(call, routed)
        print(f"   {side} kernels: " + ", ".join(f"{k}={v:.1f}" for k, v in sorted(kernels.items())), flush=True)


def probe_repeat_kernels() -> None:
    """Seed 002's four cases, GPU µs per kernel: torch, flaggems (the active vendor's tuning) and untuned.

    The prefix scan and the expand (which gathers the values itself: there is
    no separate index_select) are reported apart, as the seed asks; run with
    ``FLAGGEMS_VENDOR=hygon`` for the DCU's tuning on this GPU.
    """
    from flaggems.runtime import RUNTIME

    rows, items = 17096, 854524
    repeats = torch.full((rows,), items // rows, dtype=torch.int64, device="cuda")
    repeats[: items % rows] += 1
    values = torch.arange(rows, device="cuda")
    cases = {"values dynamic": lambda: torch.repeat_interleave(values, repeats),
             "values known": lambda: torch.repeat_interleave(values, repeats, output_size=items),
             "Tensor dynamic": lambda: torch.repeat_interleave(repeats),
             "Tensor known": lambda: torch.repeat_interleave(repeats, output_size=items)}
    for name, call in cases.items():
        for side in ("torch", "flaggems", "untuned"):
            scope = RUNTIME.without_vendor_tuning() if side == "untuned" else contextlib.nullcontext()
            with scope:
                kernels = _profile_kernels(call, routed=side != "torch")
            RESULTS[f"repeat kernels {name} {side}"] = kernels
            print(f"repeat kernels {name:15s} {side:8s} total={sum(kernels.values()):.2f} " +
                  ", ".join(f"{k}={v:.2f}" for k, v in sorted(kernels.items())), flush=True)


def _stage_cases(items: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """``items`` outputs from 1 to ``items`` rows: (repeats, their cumsum) by row count."""
    cases = {}
    for rows in (1, 200, 418, 17096, 100_000, items):
        repeats = torch.full((rows,), items // rows, dtype=torch.int64, device="cuda")
        repeats[: items % rows] += 1
        cases[rows] = repeats, torch.cumsum(repeats, 0)
    return cases


def _time_stages(label: str, items: int, cases: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The expand kernel alone on each case, and whether it matches torch."""
    from flaggems.plugins.generic import repeat_interleave as ri

    out = torch.empty(items, dtype=torch.int64, device="cuda")
    kernels = ri._kernels(out.device)
    grid, launch = (triton.cdiv(items, kernels.block),), kernels.expand(False, False, False)
    for rows, (repeats, ends) in cases.items():
        steps = kernels.rank_steps(rows)
        ours(f"{label}{items} items {rows} rows",
             lambda e=ends, r=rows, s=steps: launch(grid, e, out, out, items, r, s, 0, out, 0))
        RESULTS[f"{label}{items} items {rows} rows equal to torch"] = same = bool(torch.equal(
            out, torch.repeat_interleave(repeats, output_size=items)))
        if not same:
            print("   NOT equal to torch", flush=True)


def probe_repeat_stages() -> None:
    """Where the expand kernel's time goes: the same 854524 outputs from 1 to 854524 rows.

    Rows per block and per sub-block set the search steps; ``fill_`` of the
    same output is the store-only floor.
    """
    items = 854524
    out = torch.empty(items, dtype=torch.int64, device="cuda")
    both("stages: fill_ of the output (store floor)", lambda: out.fill_(1), routed=False)
    _time_stages("stages: ", items, _stage_cases(items))


def probe_repeat_sweep() -> None:
    """``sub`` of the expand kernel (tuning key "scan") on the stage cases and 50M items.

    Run 3 swept ``BLOCK`` 1024/2048/4096 x ``SUB`` 16-128 x 4/8 warps: 2048
    and 4 warps were best or within noise on every case. ``SUB`` x a block
    search stopping one step short (removed since): see ``_rank``.
    """
    small, large = _stage_cases(854524), {17096: _stage_cases(50_000_000)[17096]}

    def measure(label: str) -> None:
        _time_stages(f"repeat sweep {label} ", 854524, small)
        _time_stages(f"repeat sweep {label} ", 50_000_000, large)

    _policy_sweep("scan", ("sub",), ((8, 16, 32, 64),), measure)


# --------------------------------------------------------------------------- index family
def _index_cases() -> dict[str, Callable[[], object]]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    cases = {}
    for dtype in (torch.float16, torch.float32):
        name = str(dtype)[6:]
        x = torch.randn(4096, 4096, device="cuda", dtype=dtype)
        idx = torch.randperm(4096, generator=gen, device="cuda")[:2048]
        src1 = torch.randn(4096, 2048, device="cuda", dtype=dtype)
        big = torch.randn(64, 512, 512, device="cuda", dtype=dtype)
        idx3 = torch.randperm(512, generator=gen, device="cuda")[:256]
        src3 = torch.randn(64, 256, 512, device="cuda", dtype=dtype)
        cases[f"index_select dim0 4096^2 {name}"] = lambda x=x, idx=idx: x.index_select(0, idx)
        cases[f"index_select dim1 4096^2 {name}"] = lambda x=x, idx=idx: x.index_select(1, idx)
        cases[f"index_copy dim1 4096^2 {name}"] = lambda x=x, idx=idx, s=src1: x.index_copy(1, idx, s)
        cases[f"index_copy_ dim1 4096^2 {name}"] = lambda x=x, idx=idx, s=src1: x.index_copy_(1, idx, s)
        sorted_idx = idx.sort().values
        cases[f"index_copy_ dim1 4096^2 sorted {name}"] = lambda x=x, idx=sorted_idx, s=src1: x.index_copy_(1, idx, s)
        cases[f"index_copy dim1 64x512x512 {name}"] = lambda b=big, idx=idx3, s=src3: b.index_copy(1, idx, s)
        wide = torch.randn(200, 40999, 3, device="cuda", dtype=dtype)
        idx_wide = torch.randperm(40999, generator=gen, device="cuda")[:20499]
        cases[f"index_select dim1 200x40999x3 {name}"] = lambda w=wide, idx=idx_wide: w.index_select(1, idx)
    small, small_idx = torch.randn(64, 64, device="cuda"), torch.randperm(64, generator=gen, device="cuda")[:32]
    small_src = torch.randn(64, 32, device="cuda")
    cases["index_copy_ dim1 64x64 float32"] = lambda: small.index_copy_(1, small_idx, small_src)
    y = torch.randn(4096, 64, device="cuda").to(torch.bfloat16)
    cases["repeat self_int 4096x64 x4 bf16"] = lambda: y.repeat_interleave(4, dim=0)
    return cases


def probe_index() -> None:
    cases = _index_cases()
    for name, fn in cases.items():
        both(name, fn)


def probe_index_copy_paths() -> None:
    """index_copy_ along the last dimension, random against sorted index: the inverse form and the plain scatter.

    Kernel time (do_bench) and GPU time per kernel (profiler, no L2 flush) of each path.
    """
    from flaggems.plugins.generic import index_copy as ic

    gen = torch.Generator(device="cuda").manual_seed(1)
    for dtype in (torch.float16, torch.float32):
        x = torch.randn(4096, 4096, device="cuda", dtype=dtype)
        src = torch.randn(4096, 2048, device="cuda", dtype=dtype)
        idx = torch.randperm(4096, generator=gen, device="cuda")[:2048]
        for order, index in (("random", idx), ("sorted", idx.sort().values)):
            for path, minimum in (("inverse", ic.INVERSE_MIN_ELEMENTS), ("scatter", 1 << 62)):
                saved, ic.INVERSE_MIN_ELEMENTS = ic.INVERSE_MIN_ELEMENTS, minimum
                try:
                    name = f"paths: index_copy_ dim1 4096^2 {order} {str(dtype)[6:]} {path}"
                    call = lambda i=index, x=x, s=src: x.index_copy_(1, i, s)  # noqa: E731
                    ours(name, call)
                    RESULTS[f"{name} kernels"] = kernels = _profile_kernels(call)
                    print("   " + ", ".join(f"{k}={v:.1f}" for k, v in sorted(kernels.items())), flush=True)
                finally:
                    ic.INVERSE_MIN_ELEMENTS = saved


def probe_index_sweep() -> None:
    """The gather/scatter launch policy (tuning key "gather_scatter") over tile x warps."""
    cases = _index_cases()

    def measure(label: str) -> None:
        for name, fn in cases.items():
            ours(f"index sweep {label} {name}", fn)

    # Run 2 swept tile x max_cols x num_warps with scalar accesses, run 3 the small-workload fields
    # (min_programs 0-2048 x min_tile 512-2048 x elements_per_warp 128/256); run 5 sweeps the tile
    # again now that interior tiles vectorise.
    _policy_sweep("gather_scatter", ("tile", "num_warps"), ((4096, 8192, 16384), (4, 8, 16)), measure)


# --------------------------------------------------------------------------- compiled kernels
#: H200 (sm_90) per-multiprocessor limits: registers, shared memory (bytes), warps, blocks.
SM_REGISTERS, SM_SHARED, SM_WARPS, SM_BLOCKS = 65536, 228 * 1024, 64, 32


def _compiled_kernels() -> Iterator[tuple[str, str, object]]:
    """``(name, cache key, CompiledKernel)`` for every specialisation of every flaggems ``@triton.jit`` function."""
    import sys

    seen = set()
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("flaggems") or module is None:
            continue
        for attr in vars(module).values():
            if not isinstance(attr, triton.runtime.jit.JITFunction) or id(attr) in seen:
                continue
            seen.add(id(attr))
            for caches in attr.device_caches.values():
                for key, kernel in caches[0].items():
                    yield f"{module_name}.{attr.__name__}", str(key), kernel


def _resident_blocks(regs: int, warps: int, shared: int) -> int:
    """Blocks one multiprocessor holds at once (registers allocated per warp in units of 256)."""
    regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256
    limits = [SM_BLOCKS, SM_WARPS // warps, SM_REGISTERS // (regs_per_warp * warps)]
    if shared:
        limits.append(SM_SHARED // shared)
    return min(limits)


def probe_kernel_stats() -> None:
    """Registers, spills, shared memory and occupancy of the kernels compiled in this process."""
    for name, key, kernel in _compiled_kernels():
        kernel._init_handles()
        meta = kernel.metadata
        blocks = _resident_blocks(kernel.n_regs, meta.num_warps, meta.shared)
        row = {"regs": kernel.n_regs, "spills": kernel.n_spills, "warps": meta.num_warps,
               "shared": meta.shared, "blocks_per_sm": blocks, "warps_per_sm": blocks * meta.num_warps,
               "key": key[-400:]}
        RESULTS[f"kernel {name} {meta.hash[:8]}"] = row
        print(f"kernel {name:60s} regs={kernel.n_regs} spills={kernel.n_spills} warps={meta.num_warps} "
              f"shared={meta.shared} blocks/SM={blocks}", flush=True)


@triton.jit
def _int_to_bf16_probe(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src + offs, mask=offs < n)
    tl.store(dst + offs, x.to(tl.float32).to(tl.bfloat16), mask=offs < n)


def probe_int_casts() -> None:
    """Integer -> fp16/bf16/fp32 through flaggems' _to_copy against torch, and the PTX of int -> f32 -> bf16."""
    torch.manual_seed(0)
    out = {}
    for src_dtype in (torch.int32, torch.int64, torch.int16, torch.uint8):
        info = torch.iinfo(src_dtype)
        lo, hi = max(info.min, -2**62), min(info.max, 2**62)
        values = torch.randint(lo, hi, (28474, 40, 2), dtype=torch.int64).to(src_dtype)
        edges = torch.tensor([-1031798784, 1031798784, 2**24 + 1, 2**24 + 3, -(2**24) - 1, 16777217, 33554435,
                              2**31 - 1, -(2**31)], dtype=torch.int64)
        edges = edges[(edges >= info.min) & (edges <= info.max)].to(src_dtype)
        for layout, x in (("contiguous", values.cuda()), ("transposed", values.cuda().transpose(0, 1)),
                          ("edges", edges.cuda())):
            for dst_dtype in (torch.float16, torch.bfloat16, torch.float32):
                expected = x.to(dst_dtype)
                flaggems.enable()
                try:
                    got = x.to(dst_dtype)
                finally:
                    flaggems.disable()
                bad = (got.reshape(-1).float() != expected.reshape(-1).float()) & ~(
                    got.reshape(-1).isnan() & expected.reshape(-1).isnan())
                key = f"{str(src_dtype)[6:]}->{str(dst_dtype)[6:]} {layout}"
                where = bad.nonzero().flatten()[:4].tolist()
                src_flat = x.reshape(-1)
                out[key] = {"mismatches": int(bad.sum()), "of": bad.numel(),
                            "examples": [(int(src_flat[i]), float(got.reshape(-1)[i]), float(expected.reshape(-1)[i]))
                                         for i in where]}
                print(key, out[key], flush=True)
    src = torch.tensor([-1031798784, 16777217], dtype=torch.int32, device="cuda")
    dst = torch.empty(2, dtype=torch.bfloat16, device="cuda")
    kernel = _int_to_bf16_probe[(1,)](src, dst, 2, BLOCK=2)
    ptx = kernel.asm["ptx"]
    out["ptx cvt"] = sorted({line.strip().split()[0] for line in ptx.splitlines() if "cvt" in line})
    out["standalone"] = [float(v) for v in dst.float().tolist()]
    print("ptx cvt:", out["ptx cvt"], "standalone:", out["standalone"], "torch:", src.to(torch.bfloat16).tolist(),
          flush=True)
    RESULTS["int casts"] = out


def probe_unet() -> None:
    from flaggems.bench import models

    device = torch.device("cuda")
    builds = (("unet fp16 fwd", models.build_unet_forward), ("unet fp32 fwd+bwd", models.build_unet_backward))
    for name, build in builds:
        case = build(device, False)
        call = functools.partial(case.step, models.OFF)
        for routed in (False, True):
            kernels = _profile_kernels(call, routed=routed)
            side = "flaggems" if routed else "torch"
            RESULTS[f"{name} kernels {side}"] = kernels
            total = sum(kernels.values())
            top = sorted(kernels.items(), key=lambda kv: -kv[1])[:12]
            print(f"{name} {side}: GPU {total:.1f} µs per step; " + ", ".join(f"{k}={v:.1f}" for k, v in top),
                  flush=True)
    x = torch.randn(2, 64, 16, 16, device=device, dtype=torch.float16)
    w, b = torch.randn(64, device=device, dtype=torch.float16), torch.randn(64, device=device, dtype=torch.float16)
    call = functools.partial(F.group_norm, x, 32, w, b)
    for routed in (False, True):
        RESULTS[f"small group_norm kernels {'flaggems' if routed else 'torch'}"] = kernels = _profile_kernels(
            call, routed=routed)
        print(f"small group_norm {'flaggems' if routed else 'torch'}: {kernels}", flush=True)
    flaggems.enable()
    try:
        call()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            call()
            synced = False
        except RuntimeError:
            synced = True
        finally:
            torch.cuda.set_sync_debug_mode(0)
        RESULTS["small group_norm synchronises"] = synced
        print(f"small group_norm synchronises: {synced}; do_bench {kernel_us(call):.1f} µs", flush=True)
    finally:
        flaggems.disable()


# --------------------------------------------------------------------------- rms_norm backward
RMS_HIDDEN = (896, 1024, 2048, 4096)
#: ``(BLOCK_P, BLOCK_C, DWEIGHT_WARPS, BACKWARD_PROGRAMS_PER_SM, BACKWARD_WARP_ELEMENTS)`` of the generic
#: backward: the shipped one first.
RMS_BACKWARD_KNOBS = ("BLOCK_P", "BLOCK_C", "DWEIGHT_WARPS", "BACKWARD_PROGRAMS_PER_SM", "BACKWARD_WARP_ELEMENTS")
RMS_BACKWARD_CONFIGS = ((256, 16, 8, 2, 256), (128, 32, 8, 2, 256), (64, 64, 8, 2, 256), (32, 64, 4, 1, 256),
                        (256, 16, 8, 1, 256), (256, 16, 8, 2, 512), (256, 16, 8, 2, 1024), (512, 8, 8, 4, 256),
                        (512, 8, 8, 4, 512), (256, 16, 4, 2, 512), (128, 16, 4, 1, 512), (1024, 4, 8, 8, 512))


def probe_rms_norm_backward() -> None:
    """Per-kernel GPU µs of ``F.rms_norm``'s backward against ours (2048 bf16 rows, the bench's 4x512 rows,
    where run 42 measured our fwd+bwd at 0.53-0.63x torch's busy time), and ours over the dweight reduction's
    tile, warps and partial rows (programs per multiprocessor), calling the generic backward directly."""
    from flaggems.plugins.generic import rms_norm as rms

    shipped = tuple(getattr(rms, knob) for knob in RMS_BACKWARD_KNOBS)

    def configure(config: tuple[int, ...]) -> None:
        for knob, value in zip(RMS_BACKWARD_KNOBS, config, strict=True):
            setattr(rms, knob, value)
        rms._BACKWARD.clear()
        rms._target_programs.cache_clear()

    for hidden in RMS_HIDDEN:
        x = torch.randn(4, 512, hidden, device="cuda", dtype=torch.bfloat16)
        w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
        dy = torch.randn_like(x)
        xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)

        def torch_fwd_bwd(xg=xg, wg=wg, dy=dy):
            return torch.autograd.grad(F.rms_norm(xg, (xg.shape[-1],), wg, 1e-6), (xg, wg), dy)

        kernels = _profile_kernels(torch_fwd_bwd, routed=False)
        RESULTS[f"rms bwd {hidden} torch kernels"] = kernels
        print(f"rms H={hidden} torch fwd+bwd: " + ", ".join(f"{k}={v:.1f}" for k, v in sorted(kernels.items())),
              flush=True)
        rstd = torch.rsqrt(x.float().square().mean(-1) + 1e-6)
        dx, dw, y = torch.empty_like(x), torch.empty_like(w), torch.empty_like(x)

        def ours_fwd(x=x, w=w, y=y, rstd=rstd):
            rms.forward(x, None, w, y, None, rstd, 1e-6, 0.0, False)

        kernels = _profile_kernels(ours_fwd, routed=False)
        RESULTS[f"rms fwd {hidden} ours kernels"] = kernels
        print(f"rms H={hidden} ours fwd: " + ", ".join(f"{k}={v:.1f}" for k, v in sorted(kernels.items())), flush=True)
        for config in (shipped, *RMS_BACKWARD_CONFIGS):
            configure(config)

            def ours_bwd(x=x, dy=dy, rstd=rstd, w=w, dx=dx, dw=dw):
                rms.backward(dy, None, x, rstd, w, dx, dw, 0.0, False)

            kernels = _profile_kernels(ours_bwd, routed=False)
            RESULTS[f"rms bwd {hidden} ours {config} kernels"] = kernels
            print(f"rms H={hidden} ours bwd {config}: total {sum(kernels.values()):.1f} "
                  + ", ".join(f"{k}={v:.1f}" for k, v in sorted(kernels.items())), flush=True)
        configure(shipped)


SECTIONS = {
    "repeat": (probe_repeat,), "repeat_parts": (probe_repeat_parts,), "repeat_stages": (probe_repeat_stages,),
    "repeat_sweep": (probe_repeat_sweep,), "repeat_host": (probe_repeat_host,),
    "repeat_modes": (probe_repeat_modes,), "repeat_kernels": (probe_repeat_kernels,),
    "group_norm": (probe_group_norm,), "group_norm_host": (probe_group_norm_host,),
    "group_norm_sweep": (probe_group_norm_sweep,),
    "index": (probe_index,), "index_sweep": (probe_index_sweep,),
    "index_copy_paths": (probe_index_copy_paths,), "launch_args": (probe_launch_args,),
    "autograd_launch": (probe_autograd_launch,), "passthrough": (probe_passthrough,),
    "kernel_stats": (probe_kernel_stats,), "unet": (probe_unet,),
    "group_norm_policy": (probe_group_norm_policy,), "int_casts": (probe_int_casts,),
    "rms_norm_backward": (probe_rms_norm_backward,),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--only", default="repeat,group_norm,index")
    args = parser.parse_args()
    context.reset()  # the GPU default: FLAGGEMS_CHECK_INDICES unset
    torch.backends.cudnn.benchmark = False
    for section in args.only.split(","):
        for probe in SECTIONS[section]:
            try:
                probe()
            except Exception:  # noqa: BLE001 - one failing section must not lose the others
                traceback.print_exc()
            if args.json:
                with open(args.json, "w") as handle:
                    json.dump(RESULTS, handle, indent=1, default=str)


if __name__ == "__main__":
    main()
