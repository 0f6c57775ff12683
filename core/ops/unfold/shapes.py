"""``unfold`` (a view) made contiguous, ``unfold_backward`` with and without overlapping windows,
and ``Tensor.repeat`` (which builds an ``unfold`` view internally: seed 004).
"""

from __future__ import annotations

import math

import torch

from flaggems.bench.workload import Inputs, Workload, dims, nbytes, randn

OP = "unfold"
N, SMOKE_N = 16 * (1 << 20), 256
SIZE = 64


def build_unfold(device: torch.device, n: int, size: int, step: int) -> Inputs:
    """A fp32 vector of ``n`` floats and the window parameters."""
    return {"x": randn((n,), torch.float32, device), "size": size, "step": step}


def unfold_contiguous(inputs: Inputs) -> torch.Tensor:
    """``x.unfold(0, size, step).contiguous()``."""
    return inputs["x"].unfold(0, inputs["size"], inputs["step"]).contiguous()


def bytes_unfold(inputs: Inputs) -> int:
    """Input read once, every window written."""
    x, size, step = inputs["x"], inputs["size"], inputs["step"]
    return nbytes(x) + ((x.numel() - size) // step + 1) * size * x.element_size()


def build_backward(device: torch.device, n: int, size: int, step: int) -> Inputs:
    """The gradient of ``unfold(0, size, step)`` of an ``n``-vector."""
    windows = (n - size) // step + 1
    return {"grad": randn((windows, size), torch.float32, device), "n": n, "size": size, "step": step}


def unfold_backward(inputs: Inputs) -> torch.Tensor:
    """``aten.unfold_backward(grad, [n], 0, size, step)``: overlapping windows sum."""
    return torch.ops.aten.unfold_backward(inputs["grad"], [inputs["n"]], 0, inputs["size"], inputs["step"])


def bytes_backward(inputs: Inputs) -> int:
    """Window gradients read once, input gradient written once."""
    return nbytes(inputs["grad"]) + inputs["n"] * inputs["grad"].element_size()


def build_repeat(device: torch.device, shape: tuple[int, ...], repeats: tuple[int, ...]) -> Inputs:
    """A fp16 tensor of ``shape`` and the ``repeat`` counts."""
    return {"x": randn(shape, torch.float16, device), "repeats": repeats}


def repeat(inputs: Inputs) -> torch.Tensor:
    """``x.repeat(*repeats)``."""
    return inputs["x"].repeat(*inputs["repeats"])


def bytes_repeat(inputs: Inputs) -> int:
    """Input read once, every copy written."""
    return nbytes(inputs["x"]) * (1 + math.prod(inputs["repeats"]))


def windows(step: int) -> tuple[dict, dict]:
    """Full and smoke parameters of a 16M (smoke: 256) vector cut in windows of 64."""
    return {"n": N, "size": SIZE, "step": step}, {"n": SMOKE_N, "size": SIZE, "step": step}


WORKLOADS: tuple[Workload, ...] = (
    Workload(op=OP, name=f"unfold(0,{SIZE},32).contiguous() [{N}]",
             smoke_name=f"unfold(0,{SIZE},32).contiguous() [{SMOKE_N}]", dtype="fp32", build=build_unfold,
             run=unfold_contiguous, bytes_moved=bytes_unfold, routes=("unfold", "clone", "copy_"),
             source="seed 004", params=windows(32)[0], smoke=windows(32)[1]),
    Workload(op=OP, name=f"unfold_backward overlapping size{SIZE} step32 [{N}]",
             smoke_name=f"unfold_backward overlapping size{SIZE} step32 [{SMOKE_N}]", dtype="fp32",
             build=build_backward, run=unfold_backward, bytes_moved=bytes_backward, routes=("unfold_backward",),
             source="peers.md (seed op defects)", params=windows(32)[0], smoke=windows(32)[1]),
    Workload(op=OP, name=f"unfold_backward disjoint size{SIZE} step64 [{N}]",
             smoke_name=f"unfold_backward disjoint size{SIZE} step64 [{SMOKE_N}]", dtype="fp32",
             build=build_backward, run=unfold_backward, bytes_moved=bytes_backward, routes=("unfold_backward",),
             source="peers.md (no atomics needed)", params=windows(64)[0], smoke=windows(64)[1]),
    Workload(op=OP, name=f"repeat(1,2,2) {dims((16, 64, 128))}", smoke_name=f"repeat(1,2,2) {dims((2, 4, 8))}",
             dtype="fp16", build=build_repeat, run=repeat,
             bytes_moved=bytes_repeat, routes=("repeat", "unfold", "copy_"), source="seed 004",
             params={"shape": (16, 64, 128), "repeats": (1, 2, 2)},
             smoke={"shape": (2, 4, 8), "repeats": (1, 2, 2)}),
)
