"""Render a ``flaggems bench --json`` file as the Markdown table of benchmarks/RESULTS.md.

    python benchmarks/results_table.py bench.json > table.md
"""

from __future__ import annotations

import json
import sys


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(data: dict) -> str:
    """Header line (date, GPU, versions) and one row per workload."""
    meta = data["meta"]
    lines = [f"Run {meta['date']} on {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, "
             f"flaggems {meta['flaggems']}, Python {meta['python']}. {meta['timing']}.", "",
             "| op | workload | dtype | torch µs | flaggems µs | speedup | torch wall µs | flaggems wall µs "
             "| wall x | GB/s | ran | ok |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in data["results"]:
        torch_side, ours = row["sides"]["torch"], row["sides"]["flaggems"]
        lines.append(
            f"| {row['op']} | {row['workload']} | {row['dtype']} | {_fmt(torch_side['kernel_us'])} "
            f"| {_fmt(ours['kernel_us'])} | **{_fmt(row['speedup'].get('flaggems'), 2)}x** "
            f"| {_fmt(torch_side['wall_us'])} | {_fmt(ours['wall_us'])} "
            f"| {_fmt(row['wall_speedup'].get('flaggems'), 2)}x "
            f"| {_fmt(ours['gbps'], 0)} | {ours['ran']} | {'yes' if ours['match'] else 'NO'} |")
    summary = data["summary"]["flaggems"]
    lines += ["", f"Geomean over {summary['workloads']} workloads: kernel {summary['geomean_speedup']:.3f}x, "
                  f"wall {summary['geomean_wall_speedup']:.3f}x."]
    return "\n".join(lines)


if __name__ == "__main__":
    with open(sys.argv[1]) as handle:
        print(render(json.load(handle)))
