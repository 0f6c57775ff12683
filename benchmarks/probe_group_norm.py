"""The group_norm sections of ``benchmarks/probe.py``, and the launch and host costs measured on group_norm.

``group_norm``, ``group_norm_host``, ``group_norm_sweep``, ``launch_args``, ``autograd_launch``,
``passthrough`` and ``group_norm_policy``: the module docstring of ``probe.py`` describes them.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F  # noqa: N812
import triton
import triton.language as tl
from probe_common import RESULTS, _policy_sweep, _profile_kernels, both, host_us, kernel_us, ours

import flaggems

# --------------------------------------------------------------------------- group_norm
GN_CONFIGS = (
    ((8, 256, 64, 64), 32, torch.float32, True),
    ((2, 320, 64, 64), 32, torch.float32, False),
    ((2, 320, 64, 64), 32, torch.float32, True),
    ((4, 512, 128, 128), 32, torch.bfloat16, False),
    ((2, 64, 16, 32, 32), 32, torch.float32, False),
)


def _gn_inputs(shape, groups, dtype, channels_last):
    x = torch.randn(shape, device="cuda", dtype=dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    C = shape[1]
    w = 1 + 0.1 * torch.randn(C, device="cuda", dtype=dtype)
    b = 0.1 * torch.randn(C, device="cuda", dtype=dtype)
    dy = torch.randn(shape, device="cuda", dtype=dtype)
    return x, w, b, dy


def _gn_label(shape, groups, dtype, channels_last) -> str:
    return f"{'CL' if channels_last else 'contig'} {'x'.join(map(str, shape))} G{groups} {str(dtype)[6:]}"


def _gn_calls(shape, groups, dtype, channels_last):
    x, w, b, dy = _gn_inputs(shape, groups, dtype, channels_last)
    N, C = shape[0], shape[1]
    HxW = x.numel() // (N * C)
    xc = x.contiguous()
    flaggems.disable()
    _, mean, rstd = torch.ops.aten.native_group_norm(xc, w, b, N, C, HxW, groups, 1e-5)
    dyc = dy.contiguous()
    xl, wl, bl = (t.detach().clone().requires_grad_(True) for t in (x, w, b))
    dyl = dy.contiguous(memory_format=torch.channels_last) if channels_last else dy

    def fwd():
        return F.group_norm(x, groups, w, b, 1e-5)

    def fwd_contig():
        return torch.ops.aten.native_group_norm(xc, w, b, N, C, HxW, groups, 1e-5)

    def bwd():
        return torch.ops.aten.native_group_norm_backward(dyc, xc, mean, rstd, w, N, C, HxW, groups,
                                                        [True, True, True])

    def fwd_bwd():
        y = F.group_norm(xl, groups, wl, bl, 1e-5)
        return torch.autograd.grad(y, (xl, wl, bl), dyl)

    return {"fwd": fwd, "native fwd contiguous x": fwd_contig, "bwd": bwd, "fwd+bwd": fwd_bwd}


def probe_group_norm() -> None:
    for config in GN_CONFIGS:
        label = _gn_label(*config)
        calls = _gn_calls(*config)
        for part, fn in calls.items():
            both(f"gn {label} {part}", fn)
        for part in ("fwd", "bwd", "fwd+bwd"):
            kernels = _profile_kernels(calls[part])
            RESULTS[f"gn {label} {part} kernels"] = kernels
            print(f"   kernels {part}: " + ", ".join(f"{k}={v:.1f}" for k, v in sorted(kernels.items())), flush=True)


def _noop(*args: object) -> None:
    return None


@contextlib.contextmanager
def _gn_raw_launches(make_raw: Callable[[object, Callable], Callable]) -> Iterator[None]:
    """Replace the bound raw launch of every group_norm launcher with ``make_raw(launcher, raw)``.

    Launchers enter a generated function directly (``FastLauncher`` docs), so
    launches are stubbed or timed at their raw call; plans must exist (call
    the workload once first).
    """
    from flaggems.plugins.generic import group_norm as gn

    launchers = {}
    for plans in (gn._FORWARD_PLANS, gn._BACKWARD_PLANS):
        for plan in plans.values():
            for name in ("stats", "finalize", "normalize", "reduce", "dx"):
                entry = getattr(plan, name, None)
                if entry is not None:
                    launchers[id(entry[0])] = entry[0]
    saved = {key: dict(launcher._bound) for key, launcher in launchers.items()}
    for launcher in launchers.values():
        for key, (raw, prefix) in list(launcher._bound.items()):
            launcher._bound[key] = (make_raw(launcher, raw), prefix)
    try:
        yield
    finally:
        for key, launcher in launchers.items():
            launcher._bound.clear()
            launcher._bound.update(saved[key])


def _gn_split_launches() -> None:
    """Forward+backward through autograd with only the forward's, or only the backward's, launches real."""
    from flaggems.plugins.generic import group_norm as gn

    forward_kernels = {gn._stats_kernel, gn._finalize_kernel, gn._normalize_kernel}
    calls = _gn_calls(*GN_CONFIGS[1])

    def direct() -> tuple:
        return calls["native fwd contiguous x"](), calls["bwd"]()

    for label, stub_forward in (("backward stubbed", False), ("forward stubbed", True)):
        def partial(launcher, raw, stub_forward=stub_forward):
            return _noop if (launcher.fn in forward_kernels) == stub_forward else raw
        flaggems.enable()
        try:
            calls["fwd+bwd"]()
            with _gn_raw_launches(partial):
                value = host_us(calls["fwd+bwd"], 500)
        finally:
            flaggems.disable()
        RESULTS[f"gn host split fwd+bwd {label}"] = value
        print(f"gn host contig 2x320 fwd+bwd, {label}: {value:.1f}", flush=True)
    for routed in (False, True):
        if routed:
            flaggems.enable()
        try:
            value = host_us(direct, 500)
        finally:
            flaggems.disable()
        RESULTS[f"gn host direct fwd then bwd {'ours' if routed else 'torch'}"] = value
        print(f"gn host contig 2x320 direct native fwd then bwd (no autograd), {'ours' if routed else 'torch'}: "
              f"{value:.1f}", flush=True)


def probe_group_norm_host() -> None:
    """Host µs per call (torch, ours, ours with every Triton launch stubbed) and a profile of ours.

    The forward+backward rows of the bench are host-bound on both sides: this
    says how much of ours is the route, the launches and the GPU.
    """
    import cProfile
    import io
    import pstats

    for config in GN_CONFIGS:
        label = _gn_label(*config)
        for part, fn in _gn_calls(*config).items():
            flaggems.disable()
            row = {"torch": host_us(fn, 500)}
            flaggems.enable()
            row["ours"] = host_us(fn, 500)
            try:
                with _gn_raw_launches(lambda launcher, raw: _noop):  # group_norm's launches (not copy_'s)
                    row["ours, launches stubbed"] = host_us(fn, 500)
            finally:
                flaggems.disable()
            RESULTS[f"gn host {label} {part}"] = row
            print(f"gn host {label:34s} {part:26s} " + " ".join(f"{k}={v:.1f}" for k, v in row.items()), flush=True)
    _gn_split_launches()
    fn = _gn_calls(*GN_CONFIGS[1])["fwd+bwd"]
    flaggems.enable()
    try:
        fn()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(2000):
            fn()
        profiler.disable()
        torch.cuda.synchronize()
    finally:
        flaggems.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    RESULTS["gn host profile fwd+bwd"] = text.getvalue()
    print(text.getvalue(), flush=True)


@triton.jit
def _launch_probe_1(p0):
    if tl.program_id(0) < 0:
        tl.store(p0, 1)


@triton.jit(do_not_specialize=[f"a{i}" for i in range(8)])
def _launch_probe_8(p0, a0, a1, a2, a3, a4, a5, a6, a7):
    if tl.program_id(0) < 0:
        tl.store(p0, a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7)


@triton.jit(do_not_specialize=[f"a{i}" for i in range(24)])
def _launch_probe_24(p0, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17,
                     a18, a19, a20, a21, a22, a23):
    if tl.program_id(0) < 0:
        tl.store(p0, a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11 + a12 + a13 + a14 + a15 + a16
                 + a17 + a18 + a19 + a20 + a21 + a22 + a23)


@triton.jit(do_not_specialize=[f"a{i}" for i in range(24)])
def _launch_probe_6p24(p0, p1, p2, p3, p4, p5, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14,
                       a15, a16, a17, a18, a19, a20, a21, a22, a23):
    if tl.program_id(0) < 0:
        tl.store(p0, a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11 + a12 + a13 + a14 + a15 + a16
                 + a17 + a18 + a19 + a20 + a21 + a22 + a23)
        tl.store(p1, 1)
        tl.store(p2, 1)
        tl.store(p3, 1)
        tl.store(p4, 1)
        tl.store(p5, 1)


def probe_launch_args() -> None:
    """Host µs per FastLauncher launch of an empty kernel against its argument count (int64 scalars)."""
    from flaggems.toolkit.launch import FastLauncher

    buf = torch.zeros(8, dtype=torch.int64, device="cuda")
    big = 2**40  # int64 arguments, as the group_norm kernels pass
    cases = {
        "1 pointer": (FastLauncher(_launch_probe_1), (buf,)),
        "1 pointer + 8 ints": (FastLauncher(_launch_probe_8), (buf, *[big + i for i in range(8)])),
        "1 pointer + 24 ints": (FastLauncher(_launch_probe_24), (buf, *[big + i for i in range(24)])),
        "6 pointers + 24 ints": (FastLauncher(_launch_probe_6p24), (*[buf] * 6, *[big + i for i in range(24)])),
    }
    for name, (launcher, args) in cases.items():
        value = host_us(lambda launcher=launcher, args=args: launcher((1,), *args), 4000)
        RESULTS[f"launch {name}"] = value
        print(f"launch {name:30s} host_us={value:.2f}", flush=True)
    value = host_us(lambda: buf.add_(1), 4000)
    RESULTS["launch torch add_ (reference)"] = value
    print(f"launch torch add_ (reference)       host_us={value:.2f}", flush=True)


def _launch_name(launcher: object) -> str:
    fn = getattr(launcher, "fn", None)
    return getattr(getattr(fn, "fn", fn), "__name__", "?")


def _timeline(fn: Callable[[], object], iterations: int = 400) -> dict[str, float]:
    """Median µs between the marks of one call of ``fn``: its start, each launch's start and end, its end.

    Marks are labelled by thread (main or autograd worker) and kernel, so the
    gaps say where a call's host time goes: before, between or inside launches.
    """
    import threading

    marks: list[tuple[str, int]] = []

    def timed(launcher, raw):
        name = _launch_name(launcher)

        def launch(*args):
            thread = "main" if threading.current_thread() is threading.main_thread() else "worker"
            marks.append((f"{thread}:{name}>", time.perf_counter_ns()))
            raw(*args)
            marks.append((f"{thread}:{name}<", time.perf_counter_ns()))
        return launch

    from flaggems.plugins.generic import group_norm as gn

    def marked(fn: Callable, label: str) -> Callable:
        def wrapper(*args, **kwargs):
            thread = "main" if threading.current_thread() is threading.main_thread() else "worker"
            marks.append((f"{thread}:{label}{{", time.perf_counter_ns()))
            try:
                return fn(*args, **kwargs)
            finally:
                marks.append((f"{thread}:{label}}}", time.perf_counter_ns()))
        return wrapper

    originals = gn.native_group_norm, gn.native_group_norm_backward
    gn.native_group_norm = marked(originals[0], "fwd")  # resolved by name when enable() binds
    gn.native_group_norm_backward = marked(originals[1], "bwd")
    flaggems.enable()
    gn.native_group_norm, gn.native_group_norm_backward = originals
    gaps: dict[str, list[float]] = {}
    try:
        fn()
        torch.cuda.synchronize()
        with _gn_raw_launches(timed):
            _collect_gaps(fn, marks, gaps, iterations)
    finally:
        flaggems.disable()
    return {k: statistics.median(v) for k, v in gaps.items()}


def _collect_gaps(fn: Callable[[], object], marks: list, gaps: dict, iterations: int) -> None:
    """Call ``fn`` ``iterations`` times, collecting the gaps between consecutive marks."""
    for _ in range(iterations):
        marks.clear()
        marks.append(("start", time.perf_counter_ns()))
        fn()
        marks.append(("end", time.perf_counter_ns()))
        for (a, ta), (b, tb) in zip(marks, marks[1:]):
            gaps.setdefault(f"{a} -> {b}", []).append((tb - ta) / 1e3)
        gaps.setdefault("total", []).append((marks[-1][1] - marks[0][1]) / 1e3)
        torch.cuda.synchronize()


def _python_kernel_cost(calls: dict[str, Callable[[], object]]) -> None:
    """Host µs of torch's own group_norm kernels called through a pass-through Python kernel.

    No flaggems code runs: the override just calls the captured native
    kernel. What this adds over native, in direct calls and in the autograd
    flow, is the price of any Python kernel (torch's dispatcher and autograd).
    """
    from flaggems.binding import NativeKernel

    flaggems.disable()
    direct = calls["native fwd contiguous x"], calls["bwd"]
    flows = {"fwd+bwd autograd": calls["fwd+bwd"], "fwd then bwd direct": lambda: (direct[0](), direct[1]())}
    for flow, fn in flows.items():
        RESULTS[f"python kernel cost {flow} native"] = host_us(fn, 500)
    library = torch.library.Library("aten", "IMPL")
    for op in ("native_group_norm", "native_group_norm_backward"):
        native = NativeKernel.capture(op, "CUDA")
        library.impl(op, lambda *args, native=native: native(*args), "CUDA")
    try:
        for flow, fn in flows.items():
            RESULTS[f"python kernel cost {flow} pass-through"] = host_us(fn, 500)
    finally:
        library._destroy()
    for flow in flows:
        print(f"python kernel cost, contig 2x320 {flow}: native={RESULTS[f'python kernel cost {flow} native']:.1f} "
              f"pass-through={RESULTS[f'python kernel cost {flow} pass-through']:.1f}", flush=True)


def _passthrough_cases() -> dict[str, tuple[str, Callable[[], object]]]:
    """Small host-bound seed workloads: (overload its route overrides, the call)."""
    torch.manual_seed(0)
    repeats = torch.randint(0, 100, (17096,), device="cuda")
    total = int(repeats.sum())
    table = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    rows = torch.randint(0, 4096, (2048,), device="cuda")
    src, dst = torch.randn(4096, device="cuda"), torch.empty(4096, device="cuda")
    return {
        "repeat_interleave Tensor output_size 17096 rows": (
            "repeat_interleave.Tensor", lambda: torch.repeat_interleave(repeats, output_size=total)),
        "index_select [4096x4096] dim0 idx2048 fp16": ("index_select", lambda: torch.index_select(table, 0, rows)),
        "copy_ contiguous 4096 fp32": ("copy_", lambda: dst.copy_(src)),
    }


def probe_passthrough() -> None:
    """Kernel time (do_bench) of small workloads: torch, a pass-through Python kernel, and ours.

    The pass-through override calls torch's own kernel and nothing else, so
    its time is the floor of any Python-registered implementation of a
    host-bound call: what torch's dispatcher charges to enter Python.
    """
    from flaggems.binding import NativeKernel

    for label, (op, fn) in _passthrough_cases().items():
        flaggems.disable()
        row = {"torch_us": kernel_us(fn)}
        library = torch.library.Library("aten", "IMPL")
        native = NativeKernel.capture(op, "CUDA")
        library.impl(op, lambda *args, native=native, **kwargs: native(*args, **kwargs), "CUDA")
        try:
            row["passthrough_us"] = kernel_us(fn)
        finally:
            library._destroy()
        flaggems.enable()
        try:
            row["ours_us"] = kernel_us(fn)
        finally:
            flaggems.disable()
        RESULTS[f"passthrough {label}"] = row
        print(f"passthrough {label:50s} " + " ".join(f"{k}={v:.2f}" for k, v in row.items()), flush=True)


def probe_autograd_launch() -> None:
    """Where the host time of group_norm forward+backward goes, and what a launch costs inside autograd.

    Run 3 measured that our six launches cost 112-152 µs more in the autograd
    flow than stubbed, against ~50 µs in direct calls. Here: (1) the same empty
    launch timed in a custom autograd Function's forward (main thread) and
    backward (autograd's device thread); (2) a per-call timeline of the real
    flow (contiguous 2x320x64x64 fp32), autograd and direct.
    """
    import threading

    from flaggems.toolkit.launch import FastLauncher

    buf = torch.zeros(8, dtype=torch.int64, device="cuda")
    launcher = FastLauncher(_launch_probe_6p24)
    args = (*[buf] * 6, *[2**40 + i for i in range(24)])
    spent: dict[str, list[float]] = {"forward": [], "backward": []}
    threads: set[str] = set()
    count = {"launches": 6}

    def launches(side: str) -> None:
        threads.add(f"{side}:{threading.current_thread().name}")
        start = time.perf_counter_ns()
        for _ in range(count["launches"]):
            launcher((1,), *args)
        if count["launches"]:
            spent[side].append((time.perf_counter_ns() - start) / 1e3 / count["launches"])

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            launches("forward")
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            launches("backward")
            return g

    x = torch.randn(64, device="cuda", requires_grad=True)
    g = torch.randn(64, device="cuda")
    for n in (0, 6):
        count["launches"] = n
        spent["forward"].clear()
        spent["backward"].clear()
        value = host_us(lambda: torch.autograd.grad(Probe.apply(x), x, g), 2000)
        row = {"call_us": value}
        if n:
            row["launch_us_forward"] = statistics.median(spent["forward"])
            row["launch_us_backward"] = statistics.median(spent["backward"])
        RESULTS[f"autograd probe {n} launches per side"] = row
        print(f"autograd probe {n} launches per side: " + " ".join(f"{k}={v:.2f}" for k, v in row.items()),
              flush=True)
    RESULTS["autograd probe threads"] = sorted(threads)
    print("threads:", sorted(threads), flush=True)
    calls = _gn_calls(*GN_CONFIGS[1])
    _python_kernel_cost(calls)
    direct = calls["native fwd contiguous x"], calls["bwd"]
    for label, fn in (("autograd", calls["fwd+bwd"]), ("direct", lambda: (direct[0](), direct[1]()))):
        line = _timeline(fn)
        RESULTS[f"gn timeline {label}"] = line
        print(f"gn timeline contig 2x320 fp32 {label}:", flush=True)
        for k, v in line.items():
            print(f"   {v:8.2f}  {k}", flush=True)


def probe_group_norm_sweep() -> None:
    """group_norm's launch policy (tuning key "group_norm") over tile x warps x programs per SM."""
    def measure(label: str) -> None:
        for config in GN_CONFIGS:
            calls = _gn_calls(*config)
            for part in ("fwd", "bwd"):
                ours(f"gn sweep {label} {_gn_label(*config)} {part}", calls[part])

    _policy_sweep("group_norm", ("tile", "num_warps", "programs_per_sm"), ((2048, 4096, 8192), (4, 8), (2, 4)),
                  measure)


def probe_group_norm_policy() -> None:
    """fwd+bwd of channels_last inputs that need grad: torch, our node (in place), torch's composite on our kernels."""
    from flaggems.plugins.generic import group_norm_op

    shapes = (((2, 320, 64, 64), torch.float32), ((8, 256, 64, 64), torch.float32),
              ((2, 320, 128, 128), torch.float32), ((4, 512, 128, 128), torch.bfloat16),
              ((8, 256, 128, 128), torch.float32))
    saved = group_norm_op.in_place_grad
    try:
        for shape, dtype in shapes:
            x, w, b, dy = _gn_inputs(shape, 32, dtype, True)
            xl, wl, bl = (t.detach().clone().requires_grad_(True) for t in (x, w, b))
            dyl = dy.contiguous(memory_format=torch.channels_last)

            def step(xl=xl, wl=wl, bl=bl, dyl=dyl):
                return torch.autograd.grad(F.group_norm(xl, 32, wl, bl, 1e-5), (xl, wl, bl), dyl)

            mib = x.numel() * x.element_size() >> 20
            label = f"gn policy CL {'x'.join(map(str, shape))} {str(dtype)[6:]} ({mib} MiB)"
            row = {"torch_us": kernel_us(step), "torch_wall_us": host_us(step, 100)}
            for side, node in (("node", True), ("composite", False)):
                group_norm_op.in_place_grad = lambda input, node=node: node
                flaggems.enable()
                try:
                    row[f"{side}_us"], row[f"{side}_wall_us"] = kernel_us(step), host_us(step, 100)
                finally:
                    flaggems.disable()
            RESULTS[label] = row
            print(label + ": " + ", ".join(f"{k}={v:.1f}" for k, v in row.items()), flush=True)
    finally:
        group_norm_op.in_place_grad = saved

