"""Host cost of a fused forward+backward call against torch's ``F.rms_norm``: where the time goes.

    python benchmarks/backward_host_probe.py [--tokens 8] [--hidden 2048]

Times ``F.rms_norm`` forward+backward (torch) and ``flaggems::rms_norm``
forward+backward (compiled entry) in interleaved rounds, wall µs per step,
prints the compiled entry's plan counters (replayed or not, per op and key)
and the top CPU-side events of one profiled step per side.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F  # noqa: N812

import flaggems
from flaggems.runtime import RUNTIME


def _step(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, ours: bool) -> None:
    y = torch.ops.flaggems.rms_norm(x, w, 1e-6, 0.0, False) if ours else F.rms_norm(x, (x.shape[-1],), w, 1e-6)
    torch.autograd.grad(y, (x, w), dy)


def _time(fn, steps: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e6


def main() -> None:
    """Command line entry."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--include", action="store_true", help="enable(include=[the op]) as the bench does")
    args = parser.parse_args()
    on = (lambda: flaggems.enable(include=["flaggems::rms_norm"])) if args.include else flaggems.enable
    x = torch.randn(1, args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    sides = {"torch": lambda: _step(x, w, dy, False), "flaggems": lambda: _step(x, w, dy, True)}
    rows = {k: [] for k in sides}
    for _ in range(5):
        for name, fn in sides.items():
            if name == "flaggems":
                on()
            for _ in range(20):
                fn()
            rows[name].append(_time(fn, 300))
            flaggems.disable()
    for name, times in rows.items():
        print(f"{name:9s} µs/step min {min(times):7.1f} median {sorted(times)[2]:7.1f}")
    on()
    for _ in range(5):
        sides["flaggems"]()
    for op, stats in RUNTIME.plan_stats().items():
        if any(stats.values()):
            print("  ", op, {k: v for k, v in stats.items() if v})
    for name, fn in sides.items():
        if name == "torch":
            flaggems.disable()
        else:
            on()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                fn()
        print(f"== {name}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
    flaggems.disable()


if __name__ == "__main__":
    main()
