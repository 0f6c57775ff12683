"""``flaggems::group_norm_silu`` on the SD-1.5 UNet's ResnetBlock2D shapes, forward and forward+backward (issue 41).

Every ResnetBlock2D runs ``GroupNorm(32, C)`` then SiLU twice; the UNet's
activations at batch 2 (64x64 latents): 320 channels at 64x64, 640 at 32x32,
1280 at 16x16 and 8x8 (down blocks and mid block), and the up blocks'
concatenations: 2560 at 8x8, 960 at 32x32, 640 at 64x64. fp16 (inference)
and fp32 (training), contiguous and channels_last (diffusers' recommended
layout; flaggems reads it in place), forward only and forward+backward
(the input's, weight's and bias's gradients).

The torch side is the op's reference with flaggems disabled: ``F.group_norm``
then ``F.silu``, two kernels forward and three backward (``silu``'s and the
group norm's two); a channels_last input is copied first on CUDA.
"""

from __future__ import annotations

import torch

from flaggems import ops
from flaggems.bench.workload import Inputs, Workload, dims, dtype_name

from . import native_group_norm as seed

OP = "group_norm_silu"
ROUTES = ("flaggems::group_norm_silu",)
GROUPS = 32
#: ``(channels, height = width)`` at batch 2: the SD-1.5 UNet's ResnetBlock2D norms.
SHAPES = ((320, 64), (640, 32), (1280, 16), (1280, 8), (960, 32), (640, 64), (2560, 8))
BATCH = 2
SMOKE = {"shape": (1, 20, 4, 4), "groups": 2}
_OP = ops.overload("group_norm_silu")


def forward(inputs: Inputs) -> torch.Tensor:
    """``flaggems::group_norm_silu(x, groups, weight, bias, eps)`` (``F.group_norm`` then ``F.silu`` when off)."""
    return _OP(inputs["x"], inputs["groups"], inputs["weight"], inputs["bias"], seed.EPS)


def forward_backward(inputs: Inputs) -> tuple[torch.Tensor, ...]:
    """Forward, then the gradients of ``x``, ``weight`` and ``bias`` for ``dy``."""
    return torch.autograd.grad(forward(inputs), (inputs["x"], inputs["weight"], inputs["bias"]), inputs["dy"])


def case(channels: int, size: int, dtype: torch.dtype, channels_last: bool, backward: bool) -> Workload:
    """One workload at ``BATCH x channels x size x size`` in ``GROUPS`` groups."""
    shape = (BATCH, channels, size, size)
    layout = "channels_last" if channels_last else "contiguous"
    common = {"dtype": dtype, "channels_last": channels_last, "backward": backward}
    name = f"{'fwd+bwd' if backward else 'fwd'} {layout} {dims(shape)} G{GROUPS}"
    return Workload(
        op=OP, name=name, dtype=dtype_name(dtype), build=seed.build, run=forward_backward if backward else forward,
        bytes_moved=seed.bytes_forward_backward if backward else seed.bytes_forward, routes=ROUTES,
        source="issue 41: SD-1.5 UNet ResnetBlock2D", params={"shape": shape, "groups": GROUPS, **common},
        smoke={**SMOKE, **common}, smoke_name=f"{name} (smoke: {dims(SMOKE['shape'])} G{SMOKE['groups']})",
        float64_judge=backward,  # torch rounds silu's gradient to half precision before summing dweight/dbias
    )


WORKLOADS: tuple[Workload, ...] = tuple(
    case(channels, size, dtype, channels_last, backward)
    for backward in (False, True) for dtype in (torch.float16, torch.float32) for channels_last in (False, True)
    for channels, size in SHAPES
)
