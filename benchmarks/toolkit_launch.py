"""Measure the kernel toolkit on a GPU: launch host cost and strided_copy bandwidth.

    python benchmarks/toolkit_launch.py [--sweep] [--skip-int64] [--json PATH]

Per-call host cost (4096 floats): torch ``copy_``, ``kernel[grid](...)``,
:class:`FastLauncher`, the compiled kernel's launcher called directly (the
floor of the fast path) and :func:`strided_copy` end to end. Each number is the
median over 7 repeats of the mean wall-clock time of 4000 calls, after warm-up;
the median single-call time is printed beside it.

Bandwidth (``triton.testing.do_bench``, median ms): contiguous 256M floats,
expand (1024,)->(1024,1024), transpose 4096^2, fp32->bf16 and a few more
layouts, torch ``copy_`` beside ``strided_copy``; bytes = read + write, each
element once. Every case is checked against torch before it is timed.
``--sweep`` also times other tile policies; ``--skip-int64`` skips the
2**31-element check (4 GiB of memory).
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import triton

import flaggems

flaggems.backend()

from flaggems.toolkit import ElementwisePolicy, FastLauncher, set_policy, strided, strided_copy  # noqa: E402
from flaggems.toolkit.copy_kernels import copy_flat_kernel  # noqa: E402
from flaggems.toolkit.raw_launch import bind_launch  # noqa: E402

N_SMALL = 4096
BLOCK = 4096


def per_call_us(fn: Callable[[], Any], calls: int = 4000, repeats: int = 7) -> tuple[float, float]:
    """(median over repeats of the mean per-call µs, median single-call µs)."""
    for _ in range(2000):
        fn()
    torch.cuda.synchronize()
    means, singles = [], []
    clock = time.perf_counter_ns
    for _ in range(repeats):
        start = clock()
        for _ in range(calls):
            fn()
        means.append((clock() - start) / calls / 1e3)
        torch.cuda.synchronize()
        for _ in range(200):
            t0 = clock()
            fn()
            singles.append((clock() - t0) / 1e3)
        torch.cuda.synchronize()
    return statistics.median(means), statistics.median(singles)


def launch_costs() -> list[tuple[str, float, float]]:
    """Host µs per call for the ways of launching a 4096-float copy."""
    src = torch.randn(N_SMALL, device="cuda")
    dst = torch.empty_like(src)
    grid = (triton.cdiv(N_SMALL, BLOCK),)
    tiles = grid[0]
    launcher = FastLauncher(copy_flat_kernel, {"BLOCK": BLOCK, "INT64": False}, num_warps=4)
    launcher(grid, dst, src, N_SMALL, tiles)
    kernel = copy_flat_kernel[grid](dst, src, N_SMALL, tiles, BLOCK=BLOCK, INT64=False, num_warps=4)
    run, function, metadata = kernel.run, kernel.function, kernel.packed_metadata
    direct, form = bind_launch(kernel)
    stream = torch.cuda.current_stream().cuda_stream
    dptr, sptr = dst.data_ptr(), src.data_ptr()
    small_src = torch.randn(64, device="cuda")
    expanded = small_src.expand(64, 64)
    small_dst = torch.empty(64, 64, device="cuda")
    transposed = torch.randn(64, 64, device="cuda").t()
    cases = [
        ("torch copy_ (4096 fp32)", lambda: dst.copy_(src)),
        ("kernel[grid](...)", lambda: copy_flat_kernel[grid](dst, src, N_SMALL, tiles, BLOCK=BLOCK, INT64=False,
                                                              num_warps=4)),
        (f"FastLauncher ({launcher.form} form)", lambda: launcher(grid, dst, src, N_SMALL, tiles)),
        ("CompiledKernel.run, args prebuilt",
         lambda: run(1, 1, 1, stream, function, metadata, None, None, None, dptr, sptr, N_SMALL, tiles, BLOCK, False)),
        (f"bind_launch {form} form, args prebuilt (floor)",
         lambda: direct(1, 1, 1, stream, dptr, sptr, N_SMALL, tiles, BLOCK, False)),
        ("strided_copy contiguous", lambda: strided_copy(dst, src)),
        ("torch copy_ expand (64,)->(64,64)", lambda: small_dst.copy_(expanded)),
        ("strided_copy expand (64,)->(64,64)", lambda: strided_copy(small_dst, expanded)),
        ("torch copy_ transpose 64x64", lambda: small_dst.copy_(transposed)),
        ("strided_copy transpose 64x64", lambda: strided_copy(small_dst, transposed)),
        ("torch._C._cuda_getDevice()", torch._C._cuda_getDevice),
        ("torch.cuda.current_device()", torch.cuda.current_device),
        ("_cuda_getCurrentRawStream(0)", lambda: torch._C._cuda_getCurrentRawStream(0)),
    ]
    return [(name, *per_call_us(fn)) for name, fn in cases]


def launcher_source() -> str:
    """The compiled kernel's launcher ``__call__`` of this Triton (for the notes)."""
    src = torch.randn(16, device="cuda")
    kernel = copy_flat_kernel[(1,)](src, src, 16, 1, BLOCK=BLOCK, INT64=False)
    launcher = kernel.run
    sig = inspect.signature(type(launcher).__call__)
    try:
        body = inspect.getsource(type(launcher).__call__)
    except (OSError, TypeError) as exc:
        body = f"<no source: {exc}>"
    return f"{type(launcher).__module__}.{type(launcher).__qualname__}{sig}\n{body}"


def bench_ms(fn: Callable[[], Any]) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def bandwidth_cases() -> list[tuple[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]]]:
    """(name, factory of (dst, src)); every factory allocates fresh tensors."""
    m = 256 * 2**20
    return [
        ("contiguous 256M fp32", lambda: (torch.empty(m, device="cuda"), torch.randn(m, device="cuda"))),
        ("fp32->bf16 256M", lambda: (torch.empty(m, device="cuda", dtype=torch.bfloat16),
                                     torch.randn(m, device="cuda"))),
        ("expand (1024,)->(1024,1024) fp32", lambda: (torch.empty(1024, 1024, device="cuda"),
                                                      torch.randn(1024, device="cuda").expand(1024, 1024))),
        ("expand (8192,)->(8192,8192) fp32", lambda: (torch.empty(8192, 8192, device="cuda"),
                                                      torch.randn(8192, device="cuda").expand(8192, 8192))),
        ("transpose 4096^2 fp32", lambda: (torch.empty(4096, 4096, device="cuda"),
                                           torch.randn(4096, 4096, device="cuda").t())),
        ("transpose 8192^2 fp32", lambda: (torch.empty(8192, 8192, device="cuda"),
                                           torch.randn(8192, 8192, device="cuda").t())),
        ("transpose 8192^2 fp32->bf16", lambda: (torch.empty(8192, 8192, device="cuda", dtype=torch.bfloat16),
                                                 torch.randn(8192, 8192, device="cuda").t())),
        ("channels_last->contiguous fp16 64x256x56x56",
         lambda: (torch.empty(64, 256, 56, 56, device="cuda", dtype=torch.float16),
                  torch.randn(64, 256, 56, 56, device="cuda", dtype=torch.float16)
                  .contiguous(memory_format=torch.channels_last))),
        ("step slice [::2] 128M fp32", lambda: (torch.empty(m // 2, device="cuda"),
                                                torch.randn(m, device="cuda")[::2])),
        ("permute 3D (512,512,256)->(2,0,1) fp32",
         lambda: (torch.empty(256, 512, 512, device="cuda"),
                  torch.randn(512, 512, 256, device="cuda").permute(2, 0, 1))),
    ]


def moved_bytes(dst: torch.Tensor, src: torch.Tensor) -> int:
    """Bytes read plus written, each distinct source element read once."""
    unique_src = src.as_strided([s for s, st in zip(src.shape, src.stride(), strict=True) if st != 0],
                                [st for st in src.stride() if st != 0]).numel() if src.dim() else 1
    return dst.numel() * dst.element_size() + unique_src * src.element_size()


def bandwidth(policy: ElementwisePolicy | None = None, names: set[str] | None = None,
              with_torch: bool = True) -> list[dict[str, Any]]:
    """Check then time each case (torch and strided_copy); GB/s counts read + write bytes."""
    set_policy(policy or ElementwisePolicy())
    rows = [time_case(name, *make(), with_torch) for name, make in bandwidth_cases()
            if names is None or name in names]
    set_policy(None)
    return rows


def time_case(name: str, dst: torch.Tensor, src: torch.Tensor, with_torch: bool) -> dict[str, Any]:
    """Check ``strided_copy`` against torch on poisoned output, then time both."""
    expected = torch.empty_like(dst).copy_(src)
    dst.fill_(float("nan") if dst.dtype.is_floating_point else 0)
    strided_copy(dst, src)
    torch.cuda.synchronize()
    ok = torch.equal(dst, expected)
    del expected
    plan = strided.plan_copy(dst.shape, dst.stride(), src.stride(), strided.elementwise_policy())
    kernel = getattr(plan, "kernel", type(plan).__name__)
    nbytes = moved_bytes(dst, src)
    torch_ms = bench_ms(lambda: dst.copy_(src)) if with_torch else float("nan")
    ours_ms = bench_ms(lambda: strided_copy(dst, src))
    torch.cuda.empty_cache()
    return {"case": name, "kernel": kernel, "correct": ok, "torch_ms": torch_ms, "ours_ms": ours_ms,
            "torch_gbs": nbytes / torch_ms / 1e6, "ours_gbs": nbytes / ours_ms / 1e6}


#: Alternatives to the default policy (block 1024, tile 4096, transpose 64x64, 4 warps, no CTA cap).
SWEEP = [
    ("block 4096 w4", ElementwisePolicy(block_size=4096)),
    ("block 2048 w8", ElementwisePolicy(block_size=2048, num_warps=8)),
    ("tile 8192 w8", ElementwisePolicy(tile=8192, num_warps=8)),
    ("transpose 32x32 w4", ElementwisePolicy(transpose_tile=(32, 32))),
    ("transpose 128x64 w8", ElementwisePolicy(transpose_tile=(128, 64), num_warps=8)),
    ("max_ctas 528 (4/SM)", ElementwisePolicy(max_ctas=528)),
]
SWEEP_CASES = {"contiguous 256M fp32", "fp32->bf16 256M", "expand (8192,)->(8192,8192) fp32",
               "transpose 8192^2 fp32", "channels_last->contiguous fp16 64x256x56x56", "step slice [::2] 128M fp32"}


def int64_check() -> list[dict[str, Any]]:
    """Copies spanning more than 2**31 elements (the 64-bit indexed variants)."""
    n = 2**31 + 4099
    rows = []
    src = torch.randint(-128, 127, (n,), device="cuda", dtype=torch.int8)
    dst = torch.zeros(n, device="cuda", dtype=torch.uint8)
    strided_copy(dst, src)
    rows.append({"case": "flat int8->uint8 2**31+4099", "correct": torch.equal(dst, src.to(torch.uint8))})
    half = n // 2 + 1
    dst2 = dst[: 2 * half - 2].view(2, half - 1)
    src2 = src[: 2 * half - 2].view(half - 1, 2).t()
    strided_copy(dst2, src2)
    rows.append({"case": "strided (2, 2**30+2049) from transposed", "correct": torch.equal(dst2, src2.to(torch.uint8))})
    del src, dst
    torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="also time other tile policies")
    parser.add_argument("--skip-int64", action="store_true", help="skip the 2**31-element check")
    parser.add_argument("--json", help="write all numbers to this file")
    args = parser.parse_args()
    env = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(0),
           "torch": torch.__version__, "triton": triton.__version__, "python": sys.version.split()[0]}
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    print(launcher_source())
    report: dict[str, Any] = {"env": env}
    if not args.skip_int64:
        report["int64"] = int64_check()
        for row in report["int64"]:
            print(f"int64 check: {row['case']}: {'ok' if row['correct'] else 'WRONG'}")
    report["launch"] = [{"case": c, "mean_us": m, "single_us": s} for c, m, s in launch_costs()]
    print("\n| launch (4096 fp32) | µs/call (mean) | µs (median single) |\n|---|---|---|")
    for row in report["launch"]:
        print(f"| {row['case']} | {row['mean_us']:.2f} | {row['single_us']:.2f} |")
    report["bandwidth"] = bandwidth()
    print("\n| copy | kernel | ok | torch ms | ours ms | torch GB/s | ours GB/s |\n|---|---|---|---|---|---|---|")
    for r in report["bandwidth"]:
        print(f"| {r['case']} | {r['kernel']} | {'yes' if r['correct'] else 'NO'} | {r['torch_ms']:.3f} | "
              f"{r['ours_ms']:.3f} | {r['torch_gbs']:.0f} | {r['ours_gbs']:.0f} |")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)
    if args.sweep:
        report["sweep"] = {}
        for label, policy in SWEEP:
            rows = report["sweep"][label] = bandwidth(policy, SWEEP_CASES, with_torch=False)
            print(f"sweep {label}: " + "; ".join(f"{r['case']} {r['ours_gbs']:.0f} GB/s" for r in rows))
        if args.json:
            with open(args.json, "w") as out:
                json.dump(report, out, indent=1)
    bad = [r for r in report["bandwidth"] + report.get("int64", []) if not r["correct"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
