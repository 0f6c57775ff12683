"""diffusers' SD-1.5 ``UNet2DConditionModel`` (random weights): ``sd15_unet_fwd_fp16`` and
``sd15_unet_train_fp32``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from .. import runner
from ._common import Case, Check, ModelSlot, Phases, Skip
from .checks import _judged_against, _relative_norm, close, detached_copy, tensors_of

# -- the diffusers UNet (SD-1.5) -----------------------------------------------------------
#: ``UNet2DConditionModel`` arguments of the SD-1.5 UNet (its constructor's defaults otherwise: 4 latent
#: channels in and out, 32 groups, SiLU); the smoke UNet keeps its block kinds at a tiny size.
SD15_FULL = {"block_out_channels": (320, 640, 1280, 1280), "layers_per_block": 2, "cross_attention_dim": 768,
             "attention_head_dim": 8, "norm_num_groups": 32, "sample_size": 64,
             "down_block_types": ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                                  "DownBlock2D"),
             "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D")}
SD15_SMOKE = {"block_out_channels": (32, 64), "layers_per_block": 1, "cross_attention_dim": 32,
              "attention_head_dim": 8, "norm_num_groups": 8, "sample_size": 8,
              "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
              "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D")}
#: Per workload: (batch, latent height = width, text tokens), full size and smoke.
SD15_RUNS = {"fwd": (2, 64, 77), "train": (1, 32, 77)}
SD15_RUNS_SMOKE = {"fwd": (2, 8, 5), "train": (1, 8, 5)}
#: The fp16 forward's check: max |side - torch| over the largest |torch| (issue 41's target).
SD15_FP16_TOLERANCE = (0.0, 3e-2)
#: The training step's check: ||side - torch|| / ||torch|| per tensor (output, loss, every gradient), fp32
#: (TF32 convolutions on CUDA: both sides round their inputs to 10 bits, differently where they differ; torch's
#: own TF32 step is up to 4e-3 from a step without TF32 on an H200, so a tensor beyond the tolerance is judged
#: against that step, see :func:`_relative_norms`).
SD15_GRAD_TOLERANCE = {False: 1e-4, True: 1e-3}
SD15_FAMILY = "sd15_unet"


def _diffusers() -> Any:
    """The diffusers module, or :class:`Skip` when it is not installed."""
    try:
        import diffusers
    except ImportError as exc:
        raise Skip(f"diffusers is not importable ({exc}); pip install diffusers") from exc
    return diffusers


def build_sd15_unet(device: torch.device, smoke: bool, dtype: torch.dtype, run: str,
                    ) -> tuple[nn.Module, dict[str, torch.Tensor], dict[str, Any]]:
    """The UNet (random weights, seed 0, channels_last) and one step's inputs, with the report's parameters."""
    diffusers = _diffusers()
    config = SD15_SMOKE if smoke else SD15_FULL
    batch, size, tokens = (SD15_RUNS_SMOKE if smoke else SD15_RUNS)[run]
    torch.manual_seed(0)
    model = diffusers.UNet2DConditionModel(in_channels=4, out_channels=4, **config)
    model = model.to(device=device, dtype=dtype, memory_format=torch.channels_last)
    generator = torch.Generator().manual_seed(1)
    latents = torch.randn(batch, 4, size, size, generator=generator).to(device=device, dtype=dtype)
    inputs = {"sample": latents.contiguous(memory_format=torch.channels_last),
              "timestep": torch.full((batch,), 500, dtype=torch.long, device=device),
              "encoder_hidden_states": torch.randn(batch, tokens, config["cross_attention_dim"],
                                                   generator=generator).to(device=device, dtype=dtype)}
    params = {"config": "SD-1.5" if not smoke else "tiny (smoke)", "block_out_channels": config["block_out_channels"],
              "layers_per_block": config["layers_per_block"], "cross_attention_dim": config["cross_attention_dim"],
              "latents": f"{batch}x4x{size}x{size} channels_last", "text": f"{batch}x{tokens}", "timestep": 500,
              "dtype": str(dtype).removeprefix("torch."), "diffusers": diffusers.__version__}
    return model, inputs, params


def build_sd15_forward(device: torch.device, smoke: bool) -> Case:
    """The SD-1.5 UNet's fp16 forward without grad (``model(sample, t, encoder_hidden_states).sample``)."""
    model, inputs, params = build_sd15_unet(device, smoke, torch.float16, "fwd")
    slot = ModelSlot(model.eval())

    def step(phases: Phases) -> torch.Tensor:
        with torch.no_grad():
            return slot.model(**inputs).sample

    check = functools.partial(close, tolerance=SD15_FP16_TOLERANCE)
    params = {**params, "checked": f"output, max |diff| <= {SD15_FP16_TOLERANCE[1]:g} x max |torch|"}
    return Case(step, check, params, slot=slot, family=SD15_FAMILY)


def _relative_norms(reference: Any, output: Any, limit: float,
                    exact: Callable[[], Any] | None = None) -> Check:
    """Each tensor's ``||side - torch|| / ||torch||`` within ``limit``; a tensor outside it still passes
    when its error against ``exact()`` (fp32 without TF32) is at most :data:`ACCURACY_FACTOR` x torch's own."""
    refs, outs = tensors_of(reference), tensors_of(output)
    if len(refs) != len(outs) or any(r.shape != o.shape for r, o in zip(refs, outs)):
        return Check(False, f"{len(outs)} tensors, torch gave {len(refs)} (or shapes differ)")
    errors = [_relative_norm(r, o) for r, o in zip(refs, outs)]
    outside = [i for i, e in enumerate(errors) if not e <= limit]
    text = f"{len(refs)} tensors (output, loss, gradients): max relative norm error {max(errors):.3g}, " \
           f"tolerance {limit:g}"
    if not outside:
        return Check(True, text, max(errors))
    if exact is None:
        return Check(False, f"{text}; outside: {len(outside)} (first: {outside[0]})", max(errors))
    return _judged_against(text, max(errors), outside, refs, outs, tensors_of(exact()), "fp32 without TF32")


@contextlib.contextmanager
def no_tf32() -> Iterator[None]:
    """cuDNN convolutions and matmuls in full fp32 inside the block."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def sd15_train_step(net: nn.Module, inputs: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """One training step of ``net``: output, loss and every parameter's gradient."""
    net.zero_grad(set_to_none=True)
    out = net(**inputs).sample
    loss = out.float().square().mean()
    loss.backward()
    return [out.detach(), loss.detach(), *(w.grad for w in net.parameters())]


def build_sd15_train(device: torch.device, smoke: bool) -> Case:
    """The SD-1.5 UNet's fp32 training step: forward + backward of ``out.square().mean()``, grads zeroed."""
    model, inputs, params = build_sd15_unet(device, smoke, torch.float32, "train")
    slot = ModelSlot(model.train())
    tf32 = device.type == "cuda" and torch.backends.cudnn.allow_tf32
    cached: list[Any] = []

    def step(phases: Phases) -> list[torch.Tensor]:
        return sd15_train_step(slot.model, inputs)

    def exact() -> Any:
        """torch's step without TF32 on a copy of the unpatched model (cached)."""
        if not cached:
            with runner.flaggems_off(), no_tf32():
                twin = copy.deepcopy(slot.original)
                cached.append(detached_copy(sd15_train_step(twin, inputs)))
                del twin
        return cached[0]

    check = functools.partial(_relative_norms, limit=SD15_GRAD_TOLERANCE[tf32], exact=exact if tf32 else None)
    params = {**params, "mode": "train", "loss": "out.float().square().mean()", "tf32_conv": tf32,
              "checked": "output, loss, every gradient (relative norm; beyond it, against fp32 without TF32)"}
    return Case(step, check, params, slot=slot, family=SD15_FAMILY)
