"""Conformance cases and bench workloads of acme's neg."""

from __future__ import annotations

import torch

from flaggems.bench.workload import Workload
from flaggems.testing import Case


def _vector(n: int, dtype: torch.dtype):
    def make(dev):
        return (torch.randn(n, device=dev).to(dtype) if dtype.is_floating_point
                else torch.randint(-100, 100, (n,), device=dev, dtype=dtype),), {}
    return make


def _transposed(dev):
    return (torch.randn(33, 17, device=dev).t(),), {}  # declined by supports: native serves it


CASES = [
    Case("fp32-1000", _vector(1000, torch.float32)),
    Case("fp16-odd", _vector(4097, torch.float16)),
    Case("bf16", _vector(300, torch.bfloat16)),
    Case("int64", _vector(513, torch.int64)),
    Case("empty", _vector(0, torch.float32)),
    Case("0-dim", lambda dev: ((torch.tensor(2.5, device=dev),), {})),
    Case("transposed", _transposed),
]


def _build(device, n):
    return (torch.randn(n, device=device),)


WORKLOADS = [
    Workload("neg", "neg [16M]", "fp32", _build, lambda inputs: torch.neg(inputs[0]), {"n": 1 << 24},
             {"n": 1 << 10}, routes=("neg",), bytes_moved=lambda inputs: 2 * inputs[0].numel() * 4),
]
