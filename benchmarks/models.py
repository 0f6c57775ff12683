"""Real model code, torch eager vs flaggems: the same as ``flaggems bench --models``.

    python benchmarks/models.py [--only NAME] [--steps N] [--rounds N] [--json PATH] [--plot PNG] [--smoke]

The implementation is ``flaggems.bench.models`` (see its docstring and
benchmarks/README.md).
"""

from __future__ import annotations

import sys

from flaggems.bench.models import main

if __name__ == "__main__":
    sys.exit(main())
