"""``flaggems::layer_scale``: the LayerScale of DINOv2's blocks, bf16 (ViT-B and ViT-L hidden sizes)."""

from __future__ import annotations

import torch

from flaggems.bench.workload import Inputs, Workload, dims, nbytes, randn

OP = "layer_scale"


def build(device: torch.device, shape: tuple[int, ...]) -> Inputs:
    """Hidden states of ``shape`` and a gamma of their last dimension."""
    return {"x": randn(shape, torch.bfloat16, device), "gamma": randn(shape[-1:], torch.bfloat16, device, seed=1)}


def run(inputs: Inputs) -> torch.Tensor:
    """The routed call (the torch side runs its reference: ``x * gamma``)."""
    return torch.ops.flaggems.layer_scale(inputs["x"], inputs["gamma"])


WORKLOADS = [
    Workload(op=OP, name=f"layer_scale {dims(shape)}", dtype="bf16", build=build, run=run,
             params={"shape": shape}, smoke={"shape": (2, 3, 16)}, routes=("flaggems::layer_scale",),
             bytes_moved=lambda inputs: 2 * nbytes(inputs["x"]))
    for shape in ((64, 257, 768), (64, 257, 1024))
]
