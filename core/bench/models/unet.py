"""The UNet-style stack (Conv2d -> GroupNorm -> SiLU blocks, pure torch): ``unet_fwd_fp16`` and
``unet_fwd_bwd_fp32``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from ._common import Case, Phases
from .checks import close

# -- the UNet-style stack ---------------------------------------------------------------
UNET_FULL = {"channels": 320, "groups": 32, "blocks": 4, "batch": 2, "size": 64}
UNET_SMOKE = {"channels": 8, "groups": 2, "blocks": 4, "batch": 1, "size": 8}
#: (rtol, atol) of fp32 results whose convolutions ran in TF32 (cuDNN's default on CUDA): its 10-bit
#: mantissa rounds a conv input that differs in its last fp32 bits either way, by up to 2^-11 of it.
TF32_TOLERANCE = (5e-3, 5e-3)


def unet_stack(channels: int, groups: int, blocks: int) -> nn.Sequential:
    """``blocks`` x (Conv2d(channels, channels, 3, padding=1) -> GroupNorm(groups, channels) -> SiLU)."""
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Conv2d(channels, channels, 3, padding=1), nn.GroupNorm(groups, channels), nn.SiLU()]
    return nn.Sequential(*layers)


def _unet(device: torch.device, smoke: bool, dtype: torch.dtype) -> tuple[nn.Module, torch.Tensor, dict[str, Any]]:
    """The stack and its input, both channels_last, with their parameters for the report."""
    p = UNET_SMOKE if smoke else UNET_FULL
    torch.manual_seed(0)
    model = unet_stack(p["channels"], p["groups"], p["blocks"])
    model = model.to(device=device, dtype=dtype, memory_format=torch.channels_last)
    x = torch.randn(p["batch"], p["channels"], p["size"], p["size"], device=device, dtype=dtype)
    x = x.to(memory_format=torch.channels_last)
    shape = "x".join(str(d) for d in x.shape)
    return model, x, {**p, "input": f"{shape} channels_last", "dtype": str(dtype).removeprefix("torch.")}


def build_unet_forward(device: torch.device, smoke: bool) -> Case:
    """UNet-style stack, fp16 forward without grad."""
    model, x, params = _unet(device, smoke, torch.float16)
    model.eval()

    def step(phases: Phases) -> torch.Tensor:
        with torch.no_grad():
            return model(x)

    return Case(step, close, params)


def build_unet_backward(device: torch.device, smoke: bool) -> Case:
    """UNet-style stack, fp32 forward + backward of ``out.float().square().mean()``, grads zeroed each step."""
    model, x, params = _unet(device, smoke, torch.float32)
    model.train()
    weights = list(model.parameters())
    tf32 = device.type == "cuda" and torch.backends.cudnn.allow_tf32

    def step(phases: Phases) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        out = model(x)
        loss = out.float().square().mean()
        loss.backward()
        return [out.detach(), loss.detach(), *(w.grad for w in weights)]

    params = {**params, "loss": "out.float().square().mean()", "checked": "output, loss, every grad", "tf32_conv": tf32}
    return Case(step, functools.partial(close, tolerance=TF32_TOLERANCE if tf32 else None), params)
