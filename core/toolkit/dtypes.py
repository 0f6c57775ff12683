"""Dtype sets of the shared kernels (no Triton import: fronts and ``supports`` predicates read them)."""

from __future__ import annotations

import torch

#: Dtypes the copy, cast and gather/scatter kernels move.
SUPPORTED_DTYPES = frozenset({
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
})
