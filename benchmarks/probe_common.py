"""Shared timing helpers of ``benchmarks/probe.py`` (and its sections in ``probe_group_norm.py``).

``RESULTS`` collects every section's numbers; ``probe.py`` writes it to ``--json``.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable

import torch
import triton

import flaggems

RESULTS: dict[str, object] = {}


def kernel_us(fn: Callable[[], object]) -> float:
    """Median ``do_bench`` time in µs (L2 flushed between calls)."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def host_us(fn: Callable[[], object], calls: int = 300) -> float:
    """Wall time per call of back-to-back calls (median of 5 rounds), synchronised per round."""
    fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(rounds)


def both(name: str, fn: Callable[[], object], routed: bool = True) -> dict[str, float]:
    """Kernel and host time of ``fn``, natively and through flaggems."""
    row = {}
    flaggems.disable()
    row["torch_us"], row["torch_wall_us"] = kernel_us(fn), host_us(fn)
    if routed:
        flaggems.enable()
        row["ours_us"], row["ours_wall_us"] = kernel_us(fn), host_us(fn)
        flaggems.disable()
        row["speedup"] = row["torch_us"] / row["ours_us"]
    print(f"{name:70s} " + " ".join(f"{k}={v:.2f}" for k, v in row.items()), flush=True)
    RESULTS[name] = row
    return row


def ours(name: str, fn: Callable[[], object]) -> float:
    """Kernel time of ``fn`` through flaggems."""
    flaggems.enable()
    try:
        value = kernel_us(fn)
    finally:
        flaggems.disable()
    print(f"{name:70s} ours_us={value:.2f}", flush=True)
    RESULTS[name] = value
    return value

def _profile_kernels(fn: Callable[[], object], routed: bool = True) -> dict[str, float]:
    """GPU µs per kernel name for one call of ``fn`` (mean of 20 calls), through flaggems or natively."""
    from torch.profiler import ProfilerActivity, profile

    if routed:
        flaggems.enable()
    try:
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
    finally:
        flaggems.disable()
    times: dict[str, float] = {}
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if total:
            times[event.key[:60]] = total / 20
    return times


def _policy_sweep(key: str, names: tuple[str, ...], grid: tuple[tuple, ...], measure: Callable[[str], None]) -> None:
    """Install a kernel context whose tuning ``key`` takes every point of ``grid``; ``measure(label)`` each."""
    import dataclasses

    from flaggems.toolkit import context

    saved = context.current()
    try:
        for values in itertools.product(*grid):
            tuned = dict(zip(names, values))
            context.install(dataclasses.replace(saved, tuning=lambda k, v=tuned: v if k == key else {}, _facts={}))
            measure(" ".join(f"{name}={value}" for name, value in tuned.items()))
    finally:
        context.install(saved)
