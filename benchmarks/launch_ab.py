r"""A/B of the launch path: the FastLauncher of commit 0403598 against today's, in one process.

Host µs per launch of empty kernels with 1 pointer, 1 pointer + 8 / 24 int64
and 6 pointers + 24 int64 (the shapes of ``probe.py --only launch_args``),
rounds interleaved so both sides see the same host. The old launcher is read
from ``_old_launch.py`` / ``_old_raw_launch.py`` beside this file, written
from git for the run and not kept (the GPU machine has no git):

    git show 0403598:core/toolkit/raw_launch.py > benchmarks/_old_raw_launch.py
    git show 0403598:core/toolkit/launch.py | sed -e 's/^from \.\.binding/from flaggems.binding/' \
        -e 's/^from \.raw_launch/from _old_raw_launch/' > benchmarks/_old_launch.py
    python benchmarks/launch_ab.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _old_launch  # noqa: E402
from probe_group_norm import _launch_probe_1, _launch_probe_6p24, _launch_probe_8, _launch_probe_24  # noqa: E402

from flaggems.toolkit.launch import FastLauncher  # noqa: E402


def per_launch_us(launch, args, calls: int = 4000) -> float:
    launch((1,), *args)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        launch((1,), *args)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--rounds", type=int, default=7)
    options = parser.parse_args()
    buf = torch.zeros(8, dtype=torch.int64, device="cuda")
    big = 2**40
    shapes = {
        "1 pointer": (_launch_probe_1, (buf,)),
        "1 pointer + 8 ints": (_launch_probe_8, (buf, *[big + i for i in range(8)])),
        "1 pointer + 24 ints": (_launch_probe_24, (buf, *[big + i for i in range(24)])),
        "6 pointers + 24 ints": (_launch_probe_6p24, (*[buf] * 6, *[big + i for i in range(24)])),
    }
    results = {}
    for name, (kernel, args) in shapes.items():
        sides = {"0403598": _old_launch.FastLauncher(kernel), "today": FastLauncher(kernel)}
        times = {side: [] for side in sides}
        for _ in range(options.rounds):
            for side, launcher in sides.items():
                times[side].append(per_launch_us(launcher, args))
        results[name] = {side: statistics.median(values) for side, values in times.items()}
        print(f"{name:24s} " + "  ".join(f"{side}={value:.2f} µs" for side, value in results[name].items()),
              flush=True)
    if options.json:
        Path(options.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
