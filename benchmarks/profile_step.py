"""Where a model workload's step spends its time, per side: the kernels that differ and their CUDA time.

    python benchmarks/profile_step.py sd15_unet_train_fp32 [more workloads] [--json out.json]

For each workload of ``flaggems bench --models`` (same builders, same sides:
torch eager, ``enable()``, ``enable()`` + ``patch``) it runs the warm-up steps (``--warmup``),
then profiles one step with ``torch.profiler`` and prints the step's wall time,
the summed CUDA kernel time and the kernels with the most CUDA time per side,
so a side slower than torch shows which kernels (or how much host time) it adds, and the
host operations with the most CPU time of their own (``--host N``). ``--warmup N``: untimed steps before
the profiled one (default: the workload's own warm-up, at least 2; a varlen prefill's 64 new lengths).

``--exact`` also measures each side's accuracy against an fp32 reference run
without TF32 (``allow_tf32`` off for cuDNN and matmul): the relative norm error
of every output and gradient tensor, the worst one printed per side, torch's
own TF32 error beside it, which is the scale a side's error should be judged on.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch

from flaggems.bench import models


def _sides(case: models.Case) -> list[models.Side]:
    sides = [models.Side(), models.FlaggemsSide()]
    if case.slot is not None:
        sides.append(models.PatchedSide())
    return sides


def _kernel_table(prof, top: int) -> tuple[float, list[tuple[str, int, float]]]:
    """(total CUDA kernel ms, the ``top`` kernels by CUDA ms: name, count, ms)."""
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            row = totals[event.name]
            row[0] += 1
            row[1] += event.device_time / 1e3
    rows = sorted(((name, int(n), ms) for name, (n, ms) in totals.items()), key=lambda r: -r[2])
    return sum(r[2] for r in rows), rows[:top]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _host_table(prof, top: int) -> list[tuple[str, int, float]]:
    """The ``top`` host operations by their own CPU ms: name, count, ms."""
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [(e.key, e.count, e.self_cpu_time_total / 1e3) for e in events]


def _profile(case: models.Case, side: models.Side, top: int, warmup: int, host: int) -> dict:
    with side.active(case):
        for _ in range(warmup):
            case.step(models.OFF)
        _sync()
        start = time.perf_counter()
        case.step(models.OFF)
        _sync()
        wall = (time.perf_counter() - start) * 1e3
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            case.step(models.OFF)
            _sync()
    kernel_ms, rows = _kernel_table(prof, top)
    return {"side": side.name, "wall_ms": wall, "kernel_ms": kernel_ms, "top": rows,
            "host": _host_table(prof, host) if host else []}


def _accuracy(case: models.Case, sides: list[models.Side]) -> dict:
    """Worst relative norm error of each side (TF32 as configured) against torch without TF32."""
    with models.no_tf32(), sides[0].active(case):
        exact = models.detached_copy(case.checked_step())
    worst = {}
    for side in sides:
        with side.active(case):
            out = models.tensors_of(models.detached_copy(case.checked_step()))
        errors = [models._relative_norm(r, o) for r, o in zip(models.tensors_of(exact), out)]
        worst[side.name] = {"max": max(errors), "median": sorted(errors)[len(errors) // 2]}
    return worst


def main() -> None:
    """Profile each named workload's step on every side; print and optionally save the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="+")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--exact", action="store_true", help="accuracy against a no-TF32 fp32 reference")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (a check that it runs)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: the workload's)")
    parser.add_argument("--host", type=int, default=0, help="also the N host operations with most own CPU time")
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = {}
    for workload in models.select(args.workloads):
        case = workload.build(device, args.smoke)
        sides = _sides(case)
        for side in sides:
            side.prepare(case)
        warmup = args.warmup if args.warmup is not None else max(2, workload.warmup)
        rows = [_profile(case, side, args.top, warmup, args.host) for side in sides]
        result = {"sides": rows}
        print(f"== {workload.name}")
        for row in rows:
            print(f"  {row['side']:9s} wall {row['wall_ms']:8.2f} ms  kernels {row['kernel_ms']:8.2f} ms")
            for name, count, ms in row["top"]:
                print(f"      {ms:8.3f} ms  x{count:<5d} {name[:110]}")
            for name, count, ms in row["host"]:
                print(f"      host {ms:8.3f} ms  x{count:<5d} {name[:105]}")
        if args.exact:
            result["accuracy"] = _accuracy(case, sides)
            for name, err in result["accuracy"].items():
                print(f"  accuracy vs no-TF32 fp32: {name:9s} max {err['max']:.3g}  median {err['median']:.3g}")
        results[workload.name] = result
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
