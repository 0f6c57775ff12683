"""``aten::abs``: a large bf16 activation and a fp32 one."""

from __future__ import annotations

import torch

from flaggems.bench.workload import Inputs, Workload, dims, nbytes, randn

OP = "abs"


def build(device: torch.device, shape: tuple[int, ...], dtype: torch.dtype) -> Inputs:
    """One input of ``shape``."""
    return {"x": randn(shape, dtype, device)}


WORKLOADS = [
    Workload(op=OP, name=f"abs {dims(shape)}", dtype=name, build=build, run=lambda inputs: torch.abs(inputs["x"]),
             params={"shape": shape, "dtype": dtype}, smoke={"shape": (3, 40), "dtype": dtype}, routes=("abs",),
             bytes_moved=lambda inputs: 2 * nbytes(inputs["x"]))
    for shape, dtype, name in (((8192, 8192), torch.bfloat16, "bf16"), ((4096, 4096), torch.float32, "fp32"))
]
