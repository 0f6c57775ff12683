"""Where a kit process spent its time: cumulative seconds of the kit's phases, per cProfile file.

    python benchmarks/kit_profile.py kit_*.prof
"""

from __future__ import annotations

import pstats
import sys

#: (label, file fragment, function name) of the phases a case goes through.
PHASES = (
    ("triton compile", "triton/compiler/compiler.py", "compile"),
    ("planner (miss)", "/planner.py", "planner"),
    ("generalize", "/generalize.py", "add"),
    ("check_dispatched", "testing/random_cases.py", "check_dispatched"),
    ("check_direct", "testing/random_cases.py", "check_direct"),
    ("build inputs", "testing/random_cases.py", "build"),
    ("native call", "testing/random_cases.py", "call_native"),
    ("cpu error", "testing/random_cases.py", "_cpu_error"),
    ("routed call", "testing/random_cases.py", "call_dispatcher"),
    ("compare", "testing/random_cases.py", "compare"),
    ("synchronize", "torch/cuda/__init__.py", "synchronize"),
)


def summary(path: str) -> list[str]:
    """One line per phase: seconds (cumulative) and calls."""
    stats = pstats.Stats(path).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    total = max((ct for (_, _, _), (_, _, _, ct, _) in stats.items()), default=0.0)
    lines = [f"{path.rsplit('/', 1)[-1]}: {total:.1f} s"]
    for label, fragment, name in PHASES:
        rows = [(nc, ct) for (file, _, fn), (_, nc, _, ct, _) in stats.items() if fragment in file and fn == name]
        if rows:
            lines.append(f"  {label:<18} {max(ct for _, ct in rows):8.1f} s  {sum(nc for nc, _ in rows):7d} calls")
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:8]
    lines += [f"  self {tt:7.1f} s  {file.rsplit('/', 2)[-1]}:{fn}" for (file, _, fn), (_, _, tt, _, _) in top]
    return lines


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print("\n".join(summary(p)))
