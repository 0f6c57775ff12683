"""Wall time per call of small routed calls: torch, flaggems' compiled entry, flaggems' Python entry.

Back to back, as a model's decode step makes them: per round the device is
synchronised, ``CALLS`` calls are made, the device is synchronised again; the
time per call is the median over interleaved rounds (torch, compiled, python
in turn each round, so drift hits all three). Switching sides re-enables
flaggems, which drops the compiled entry's plans: the first call after a
switch makes the plan and is timed on its own (``first_call_us``), then a few
warm-up calls run before the timed ones, so the rows are the steady state a
model sees. Kernel time (``do_bench``) is reported beside it, and each result
is checked against torch.

    python benchmarks/small_calls.py [--json out.json] [--calls 200] [--rounds 9]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

import flaggems
from flaggems import compiled
from flaggems.runtime import RUNTIME


def workloads(device: str) -> dict[str, Callable[[], Callable[[], torch.Tensor]]]:
    """Name -> factory of a zero-argument call (inputs made once)."""
    def copy_4096():
        src, dst = torch.randn(4096, device=device), torch.empty(4096, device=device)
        return lambda: dst.copy_(src)

    def to_copy_bf16_fp32():
        x = torch.randn(1, 4096, device=device, dtype=torch.bfloat16)
        return lambda: x.to(torch.float32)

    def index_copy_64():
        dst, src = torch.randn(64, 64, device=device), torch.randn(64, 64, device=device)
        index = torch.randperm(64, device=device)
        return lambda: dst.index_copy_(0, index, src)

    def kv_cache_update():
        cache = torch.zeros(1, 8, 256, 128, device=device, dtype=torch.bfloat16)
        new = torch.randn(1, 8, 1, 128, device=device, dtype=torch.bfloat16)
        position = torch.tensor([17], device=device)
        return lambda: cache.index_copy_(2, position, new)

    def index_select_64():
        x = torch.randn(64, 64, device=device)
        index = torch.randint(0, 64, (64,), device=device)
        return lambda: torch.index_select(x, 0, index)

    def repeat_interleave_int():
        x = torch.randn(4096, device=device)
        return lambda: torch.repeat_interleave(x, 64)

    def seed_repeats():
        rows, items = 17096, 854524  # seed 002's case
        repeats = torch.full((rows,), items // rows, dtype=torch.int64, device=device)
        repeats[: items % rows] += 1
        return repeats, items

    def repeat_interleave_known():
        repeats, items = seed_repeats()
        return lambda: torch.repeat_interleave(repeats, output_size=items)

    def repeat_interleave_values_known():
        repeats, items = seed_repeats()
        values = torch.randn(repeats.shape[0], device=device)
        return lambda: torch.repeat_interleave(values, repeats, dim=0, output_size=items)

    def group_norm_small():
        x = torch.randn(2, 64, 16, 16, device=device, dtype=torch.float16)
        w = torch.randn(64, device=device, dtype=torch.float16)
        b = torch.randn(64, device=device, dtype=torch.float16)
        return lambda: torch.nn.functional.group_norm(x, 32, w, b)

    return {
        "copy_ 4096 fp32": copy_4096,
        "_to_copy bf16->fp32 1x4096": to_copy_bf16_fp32,
        "index_copy_ [64,64] dim0": index_copy_64,
        "index_copy_ kv-cache [1,8,256,128] bf16, 1 slot": kv_cache_update,
        "index_select [64,64] dim0": index_select_64,
        "repeat_interleave self_int 4096x64": repeat_interleave_int,
        "group_norm [2,64,16,16] fp16 G=32": group_norm_small,
        "repeat_interleave.Tensor output_size, 17096 -> 854524": repeat_interleave_known,
        "repeat_interleave values output_size, 17096 -> 854524": repeat_interleave_values_known,
    }


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def wall_per_call(call: Callable[[], torch.Tensor], device: str, calls: int) -> float:
    """Microseconds per call over ``calls`` back-to-back calls."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        call()
    _sync(device)
    return (time.perf_counter() - start) / calls * 1e6


def first_call(call: Callable[[], torch.Tensor], device: str, warmup: int = 3) -> float:
    """Microseconds of the first call (a plan miss right after a switch), then ``warmup`` untimed calls."""
    _sync(device)
    start = time.perf_counter()
    call()
    _sync(device)
    elapsed = (time.perf_counter() - start) * 1e6
    for _ in range(warmup):
        call()
    return elapsed


def _use(side: str) -> None:
    """Switch the process to torch, the compiled entry or the Python entry."""
    flaggems.disable()
    if side == "torch":
        return
    os.environ["FLAGGEMS_ENTRY"] = "compiled" if side == "compiled" else "python"
    compiled.reset()
    flaggems.enable()


def kernel_time(call: Callable[[], torch.Tensor], device: str) -> float | None:
    """do_bench median in microseconds (GPU only)."""
    if device != "cuda":
        return None
    import triton.testing

    return triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median") * 1e3


def run(calls: int, rounds: int, only: str | None = None) -> list[dict]:
    """Measure every workload (or those whose name contains ``only``); returns one row per workload."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sides = ("torch", "compiled", "python")
    rows = []
    for name, factory in workloads(device).items():
        if only and only not in name:
            continue
        call = factory()
        _use("torch")
        expected = call().clone()
        times: dict[str, list[float]] = {s: [] for s in sides}
        firsts: dict[str, list[float]] = {s: [] for s in sides}
        kernels: dict[str, float | None] = {}
        ok = True
        for side in sides:
            _use(side)
            for _ in range(3):
                got = call()
            close = torch.equal(got, expected) if got.dtype != torch.float16 else torch.allclose(
                got, expected, rtol=1e-2, atol=1e-2)
            if not close:
                print(f"{name}: {side} differs from torch by {(got.float() - expected.float()).abs().max():.3g}")
            ok &= close
            kernels[side] = kernel_time(call, device)
        stats: dict = {}
        for _ in range(rounds):
            for side in sides:
                _use(side)
                firsts[side].append(first_call(call, device))
                times[side].append(wall_per_call(call, device, calls))
                if side == "compiled":
                    stats = RUNTIME.plan_stats()
        phases = _phases(call, device, calls)
        _use("torch")
        row = {"workload": name, "ok": bool(ok)}
        for side in sides:
            row[f"{side}_wall_us"] = statistics.median(times[side])
            row[f"{side}_kernel_us"] = kernels[side]
            row[f"{side}_first_call_us"] = statistics.median(firsts[side])
        row["compiled_vs_torch"] = row["torch_wall_us"] / row["compiled_wall_us"]
        row["python_vs_torch"] = row["torch_wall_us"] / row["python_wall_us"]
        row["plans"] = {k: v for k, v in stats.items() if v.get("miss")}
        row["phases"] = phases
        rows.append(row)
        print(f"{name:<48} torch {row['torch_wall_us']:7.2f}  compiled {row['compiled_wall_us']:7.2f} "
              f"({row['compiled_vs_torch']:.2f}x)  python {row['python_wall_us']:7.2f} "
              f"({row['python_vs_torch']:.2f}x)  ok={ok}  first call: torch {row['torch_first_call_us']:.0f}, "
              f"compiled {row['compiled_first_call_us']:.0f} µs", flush=True)
        for op, p in phases.items():
            print(f"    {op}: " + "  ".join(f"{k[:-3]} {v:.2f}" for k, v in p.items() if k.endswith("_us"))
                  + " µs per replayed call", flush=True)
    return rows


def _phases(call: Callable[[], torch.Tensor], device: str, calls: int) -> dict[str, dict]:
    """Per op, the compiled entry's own time per replayed call by phase (one extra round, clocks on)."""
    _use("compiled")
    module = compiled.loaded()
    if module is None:
        return {}
    wall_per_call(call, device, calls)  # plans made
    module.set_profiling(True)
    try:
        wall_per_call(call, device, calls)
    finally:
        module.set_profiling(False)
    return {op: row["phases"] for op, row in RUNTIME.plan_stats().items() if "phases" in row}


def main(argv: list[str] | None = None) -> int:
    """Command line entry."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--only", help="measure only the workloads whose name contains this")
    args = parser.parse_args(argv)
    flaggems.backend()
    rows = run(args.calls, args.rounds, args.only)
    if args.json:
        meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if torch.cuda.is_available()
                else "cpu", "date": time.strftime("%Y-%m-%d")}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
