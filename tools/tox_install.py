"""tox ``install_command``: ``pip install`` that keeps an existing torch.

Usage (tox.ini)::

    install_command = python {toxinidir}/tools/tox_install.py {opts} {packages}

Runs ``python -m pip install`` with the given arguments in the environment
being set up. When torch is not importable there, ``-c constraints/cpu.txt``
is added so that pip takes the CPU build of torch on disk instead of a
multi-GB CUDA build. When torch is already importable (a GPU or vendor
machine's torch seen through system site packages), no constraint is added,
and pip keeps that torch: flaggems-core accepts any torch >= 2.9.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

CONSTRAINTS = Path(__file__).resolve().parent.parent / "constraints" / "cpu.txt"


def pip_command(args: list[str]) -> list[str]:
    """The pip command line for ``args``, with the CPU constraint when torch is missing."""
    command = [sys.executable, "-m", "pip", "install", *args]
    spec = importlib.util.find_spec("torch")
    if spec is None:
        print(f"tox_install: torch is not importable here; constraining with {CONSTRAINTS}", flush=True)
        return [*command, "-c", str(CONSTRAINTS)]
    where = os.path.dirname(spec.origin or "") or "a namespace package"
    print(f"tox_install: torch already importable from {where}; keeping it (no constraint)", flush=True)
    return command


def main(argv: list[str]) -> int:
    """Install ``argv`` with pip; return pip's exit status."""
    return subprocess.call(pip_command(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
