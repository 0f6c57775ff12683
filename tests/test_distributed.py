"""flaggems under torch.distributed: ``benchmarks/distributed.py`` through ``torchrun`` with two processes.

On the CPU (gloo, the Triton interpreter) at smoke sizes: a tensor-parallel Llama's logits with flaggems
and ``flaggems.patch`` equal the same sharded model's without it, and two FSDP training steps give the
same losses and parameters, with the fused calls served by flaggems. The same script runs on two GPUs
with NCCL (``nvidia-h200-x2``).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "distributed.py"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")


def test_tensor_parallel_and_fsdp_equal_torch_on_two_processes(tmp_path):
    device = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(SCRIPT), "--device", device, "--smoke", "--rounds", "1", "--json", str(tmp_path / "r.json")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "tensor parallel: logits max relative difference" in output and "(ok," in output, output[-4000:]
    assert "fsdp: losses" in output, output[-4000:]
    replays = [int(n) for n in re.findall(r"fused calls replayed by flaggems (\d+)", output)]
    assert len(replays) == 2 and min(replays) > 0, output[-4000:]  # flaggems served, not torch's references
