"""``group_norm`` forward and forward+backward (aten ``native_group_norm`` and its backward).

Diffusers feeds channels_last input (seed 004); 320 channels in 32 groups is
10 channels per group, which FlagGems gets wrong when C/G is not a power of
two (peers.md); the 3D case is a video UNet's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 - the usual spelling

from flaggems.bench.workload import Inputs, Workload, dims, dtype_name, nbytes, randn

OP = "native_group_norm"
FWD_ROUTES = ("native_group_norm",)
BWD_ROUTES = ("native_group_norm", "native_group_norm_backward")
EPS = 1e-5

#: (shape, groups, dtype, channels_last) at full size, then (shape, groups) at smoke size.
CONFIGS = (
    ((8, 256, 64, 64), 32, torch.float32, True, (2, 8, 4, 4), 4),
    ((2, 320, 64, 64), 32, torch.float32, False, (1, 20, 4, 4), 2),
    ((2, 320, 64, 64), 32, torch.float32, True, (1, 20, 4, 4), 2),
    ((4, 512, 128, 128), 32, torch.bfloat16, False, (1, 8, 4, 4), 2),
    ((2, 64, 16, 32, 32), 32, torch.float32, False, (1, 8, 2, 4, 4), 4),
)


def build(device: torch.device, shape: tuple[int, ...], groups: int, dtype: torch.dtype, channels_last: bool,
          backward: bool) -> Inputs:
    """Input (channels_last when asked), affine weight and bias, and ``dy`` for the backward."""
    x = randn(shape, dtype, device)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    weight = 1 + 0.1 * randn((shape[1],), dtype, device, seed=3)
    bias = 0.1 * randn((shape[1],), dtype, device, seed=4)
    inputs = {"x": x, "groups": groups, "weight": weight, "bias": bias}
    if backward:
        for name in ("x", "weight", "bias"):
            inputs[name].requires_grad_(True)
        inputs["dy"] = randn(shape, dtype, device, seed=5)
    return inputs


def forward(inputs: Inputs) -> torch.Tensor:
    """``F.group_norm(x, groups, weight, bias)``."""
    return F.group_norm(inputs["x"], inputs["groups"], inputs["weight"], inputs["bias"], EPS)


def forward_backward(inputs: Inputs) -> tuple[torch.Tensor, ...]:
    """Forward, then the gradients of ``x``, ``weight`` and ``bias`` for ``dy``."""
    y = forward(inputs)
    return torch.autograd.grad(y, (inputs["x"], inputs["weight"], inputs["bias"]), inputs["dy"])


def bytes_forward(inputs: Inputs) -> int:
    """``x`` read, ``y`` written."""
    return 2 * nbytes(inputs["x"])


def bytes_forward_backward(inputs: Inputs) -> int:
    """Forward (2 passes) plus backward: ``x`` and ``dy`` read, ``dx`` written."""
    return 5 * nbytes(inputs["x"])


def case(config: tuple, backward: bool, op: str = OP, routes: tuple[str, ...] | None = None,
         source: str = "seed 004, peers.md") -> Workload:
    """One group_norm workload, forward only or forward+backward (``routes``: the ops sent to flaggems)."""
    shape, groups, dtype, channels_last, smoke_shape, smoke_groups = config
    layout = "channels_last" if channels_last else "contiguous"
    common = {"dtype": dtype, "channels_last": channels_last, "backward": backward}
    return Workload(
        op=op, name=f"{'fwd+bwd' if backward else 'fwd'} {layout} {dims(shape)} G{groups}",
        smoke_name=f"{'fwd+bwd' if backward else 'fwd'} {layout} {dims(smoke_shape)} G{smoke_groups}",
        dtype=dtype_name(dtype), build=build, run=forward_backward if backward else forward,
        bytes_moved=bytes_forward_backward if backward else bytes_forward,
        routes=routes or (BWD_ROUTES if backward else FWD_ROUTES), source=source,
        params={"shape": shape, "groups": groups, **common},
        smoke={"shape": smoke_shape, "groups": smoke_groups, **common},
    )


WORKLOADS: tuple[Workload, ...] = tuple(case(config, backward) for backward in (False, True) for config in CONFIGS)
