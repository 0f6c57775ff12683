"""``Tensor.to(dtype)`` (aten ``_to_copy``): casts read strides and convert in one pass (seed 004)."""

from __future__ import annotations

import torch

from flaggems.bench.workload import Inputs, Workload, cast_label, dims, nbytes, randn

OP = "_to_copy"
ROUTES = ("_to_copy",)


def build(device: torch.device, shape: tuple[int, ...], src_dtype: torch.dtype, dst_dtype: torch.dtype,
          transposed: bool) -> Inputs:
    """A source of ``shape`` (transposed view when asked) and the target dtype."""
    x = randn(shape, src_dtype, device)
    return {"x": x.t() if transposed else x, "dtype": dst_dtype}


def run(inputs: Inputs) -> torch.Tensor:
    """``x.to(dtype)`` (keeps the source's strides: preserve_format)."""
    return inputs["x"].to(inputs["dtype"])


def bytes_moved(inputs: Inputs) -> int:
    """Source read once, result written once."""
    x = inputs["x"]
    return nbytes(x) + x.numel() * inputs["dtype"].itemsize


def case(shape: tuple[int, ...], smoke: tuple[int, ...], src_dtype: torch.dtype, dst_dtype: torch.dtype,
         transposed: bool = False, source: str = "seed 004") -> Workload:
    """One cast workload."""
    layout = "transposed" if transposed else "contiguous"
    common = {"src_dtype": src_dtype, "dst_dtype": dst_dtype, "transposed": transposed}
    return Workload(
        op=OP, name=f"{layout} {dims(shape)}", smoke_name=f"{layout} {dims(smoke)}",
        dtype=cast_label(src_dtype, dst_dtype), build=build, run=run,
        bytes_moved=bytes_moved, routes=ROUTES, source=source,
        params={"shape": shape, **common}, smoke={"shape": smoke, **common},
    )


WORKLOADS: tuple[Workload, ...] = (
    case((8192, 8192), (32, 32), torch.float32, torch.float16, source="seed 004, peers.md"),
    case((8192, 8192), (32, 32), torch.float32, torch.float16, transposed=True),
    case((2048, 128), (16, 8), torch.bfloat16, torch.float32),
)
