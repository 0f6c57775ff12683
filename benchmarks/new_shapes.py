"""Wall time per call when every call has a new shape: generic plans and the plan budget at work.

Each call of a sequence runs an op on tensors of a size not seen before
(``copy_`` fp32, ``_to_copy`` bf16->fp32, ``index_select``, ``index_copy_``,
``group_norm``), so the compiled entry misses its exact plans every time. A
miss of a layout class with a generic plan is served from it in C++; the first
calls of each class (two per power-of-two bucket of the sizes) run the planner;
past ``PLAN_FREE_MISSES`` misses with no plan reused, only one miss in
``PLAN_RETRY_EVERY`` is planned and the rest take the Python entry. Per side
(torch, compiled entry, Python entry): µs of the first call of the sequence
(a new layout class), µs per call over the first ``PLAN_FREE_MISSES`` calls and
over half the rest (means), the median of 25-call chunks over the other half (a one-off compile does
not move it), and the compiled entry's counters::

    python benchmarks/new_shapes.py [--calls 1200] [--json out.json]
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
from flaggems import binding, compiled
from flaggems.runtime import RUNTIME

MAKERS: dict[str, Callable[[int, str], Callable[[], torch.Tensor]]] = {}


def maker(name: str):
    """Registers a factory ``(numel, device) -> call``."""
    def register(fn):
        MAKERS[name] = fn
        return fn
    return register


@maker("copy_ fp32")
def _copy(n: int, device: str) -> Callable[[], torch.Tensor]:
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    return lambda: dst.copy_(src)


@maker("_to_copy bf16->fp32")
def _to_copy(n: int, device: str) -> Callable[[], torch.Tensor]:
    x = torch.randn(1, n, device=device, dtype=torch.bfloat16)
    return lambda: x.to(torch.float32)


@maker("index_select rows fp32")
def _index_select(n: int, device: str) -> Callable[[], torch.Tensor]:
    x = torch.randn(n // 8 + 32, 64, device=device)
    index = torch.randint(0, x.shape[0], (32,), device=device)
    return lambda: torch.index_select(x, 0, index)


@maker("index_copy_ rows fp32")
def _index_copy(n: int, device: str) -> Callable[[], torch.Tensor]:
    dst = torch.zeros(n // 8 + 32, 64, device=device)
    index = torch.randperm(dst.shape[0], device=device)[:32]
    src = torch.randn(32, 64, device=device)
    return lambda: dst.index_copy_(0, index, src)


@maker("group_norm fp16")
def _group_norm(n: int, device: str) -> Callable[[], torch.Tensor]:
    x = torch.randn(2, 64, n // 8 + 8, device=device, dtype=torch.float16)
    weight = torch.randn(64, device=device, dtype=torch.float16)
    bias = torch.randn(64, device=device, dtype=torch.float16)
    return lambda: torch.nn.functional.group_norm(x, 8, weight, bias)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _use(side: str) -> None:
    flaggems.disable()
    if side != "torch":
        os.environ["FLAGGEMS_ENTRY"] = side
        compiled.reset()
        flaggems.enable()


def _timed(calls: list[Callable[[], torch.Tensor]], device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    for call in calls:
        call()
    _sync(device)
    return (time.perf_counter() - start) / max(1, len(calls)) * 1e6


def _chunk_median(calls: list[Callable[[], torch.Tensor]], device: str, chunk: int = 25) -> float:
    """µs per call, the median over chunks of ``chunk`` calls: a one-off cost (a kernel configuration
    compiled for a size the warm-up missed: 50-100 ms) moves the mean of a stretch, not this."""
    chunks = [_timed(calls[i:i + chunk], device) for i in range(0, len(calls), chunk) if calls[i:i + chunk]]
    return statistics.median(chunks) if chunks else 0.0


def measure(name: str, calls: int, device: str) -> dict:
    """One row: per side, µs per call over the first ``PLAN_FREE_MISSES`` new shapes and over the rest."""
    free = binding.PLAN_FREE_MISSES
    row: dict = {"workload": name, "free_misses": free, "retry_every": binding.PLAN_RETRY_EVERY}
    for side in ("torch", "compiled", "python"):
        # fresh sizes per side (none seen before by this process's plans); the warm-up takes every 8th
        # size of the side's range, so each kernel configuration the range needs is compiled before timing
        base = 1000 + 8 * calls * ("torch", "compiled", "python").index(side)
        everything = [MAKERS[name](base + 7 * i, device) for i in range(calls + calls // 7 + 1)]
        warm, sequence = everything[::8], [c for i, c in enumerate(everything) if i % 8]
        _use(side)
        row[f"{side}_first_us"] = _timed(warm[:1], device)
        for call in warm[1:]:
            call()
        sequence = sequence[:calls]
        budget_left = max(0, free - len(warm))
        row[f"{side}_planned_us"] = _timed(sequence[:budget_left], device)
        row[f"{side}_after_us"] = _timed(sequence[budget_left:budget_left + len(sequence) // 2], device)
        row[f"{side}_after_median_us"] = _chunk_median(sequence[budget_left + len(sequence) // 2:], device)
        if side == "compiled":
            row["stats"] = {k: v for k, v in RUNTIME.plan_stats().items() if v.get("miss")}
    _use("torch")
    first = "  ".join(f"{side} {row[f'{side}_first_us']:6.1f}" for side in ("torch", "compiled", "python"))
    print(f"{name:<22} µs of the first call (a new layout class): {first}", flush=True)
    planned = "  ".join(f"{side} {row[f'{side}_planned_us']:6.1f}" for side in ("torch", "compiled", "python"))
    after = "  ".join(f"{side} {row[f'{side}_after_us']:6.1f}" for side in ("torch", "compiled", "python"))
    print(f"{name:<22} µs per call, planned stretch: {planned} | after the budget: {after}", flush=True)
    median = "  ".join(f"{side} {row[f'{side}_after_median_us']:6.1f}" for side in ("torch", "compiled", "python"))
    print(f"{name:<22} µs per call, after the budget, median of 25-call chunks: {median}", flush=True)
    for op, stats in row["stats"].items():
        print(f"    {op}: " + ", ".join(f"{k} {v}" for k, v in stats.items()))
    return row


def main(argv: list[str] | None = None) -> int:
    """Command line entry."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1200)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    flaggems.backend()
    rows = [measure(name, args.calls, device) for name in MAKERS]
    if args.json:
        meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                "date": time.strftime("%Y-%m-%d")}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
