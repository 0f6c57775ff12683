"""Sum the long kit's tallies over the processes of one run (an op may run as several seeded shards).

    python benchmarks/kit_tally.py kit_*.log      # one line per op and implementation, summed

Each process prints lines like ``  copy_  generic  compiled  passed 5585  declined 147  failed 0  (...)``.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict

LINE = re.compile(r"^  (\S+)\s+(\S+)\s+(\S+)\s+passed\s+(\d+)\s+declined\s+(\d+)\s+failed\s+(\d+)\s+\(([\d.]+) s CPU")
#: The passed cases whose gradients were compared too (a fused op's inputs that require grad).
GRADIENTS = re.compile(r", (\d+) with gradients")


def totals(paths: list[str]) -> dict[tuple[str, str, str], list[float]]:
    """``(op, implementation, entry) -> [passed, declined, failed, cpu seconds, processes, with gradients]``."""
    sums: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0, 0, 0, 0.0, 0, 0])
    for path in paths:
        with open(path, errors="replace") as f:
            for line in f:
                m = LINE.match(line)
                if m:
                    row = sums[m.group(1), m.group(2), m.group(3)]
                    for i, value in enumerate((int(m.group(4)), int(m.group(5)), int(m.group(6)), float(m.group(7)))):
                        row[i] += value
                    row[4] += 1
                    grads = GRADIENTS.search(line)
                    row[5] += int(grads.group(1)) if grads else 0
    return dict(sums)


def main(paths: list[str]) -> int:
    """Print the table; exit 1 if any case failed."""
    rows = totals(paths)
    print(f"{'op':32} {'impl':10} {'entry':9} {'passed':>7} {'declined':>8} {'failed':>6} {'cases':>7} "
          f"{'CPU s':>7} procs {'grads':>6}")
    for (op, impl, entry), (passed, declined, failed, cpu, procs, grads) in sorted(rows.items()):
        cases = passed + declined + failed
        print(f"{op:32} {impl:10} {entry:9} {passed:7d} {declined:8d} {failed:6d} {cases:7d} {cpu:7.0f} {procs:5d} "
              f"{grads:6d}")
    return 1 if any(row[2] for row in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
