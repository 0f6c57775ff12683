"""``flaggems::rms_norm`` on Ascend NPUs: torch_npu's fused ``npu_rms_norm`` kernel.

torch_npu ships an RMSNorm that runs as one CANN kernel on the AI cores; on an
NPU that is the fused path to prefer over a Triton kernel. It computes
``x * rsqrt(mean(x**2) + eps) * gamma`` in float32 and rounds once to the
input's dtype, where transformers' Llama rounds the normalised values before
the weight multiplies them: the two differ by at most an ulp of the output
(the conformance cases allow two).

It serves the calls that kernel takes as they are: a weight of the input's
dtype and shape ``[H]``, a contiguous input, no weight offset (Gemma's
``1 + weight`` goes to the next implementation), float16/bfloat16/float32, no gradient needed (a call that
records a graph goes on to the generic kernels' autograd node). Everything else
declines. Where torch_npu lacks ``npu_rms_norm`` (older releases) nothing is
offered. A torch_npu call is a torch operator, not a recorded launch: the
compiled entry serves these calls on its Python path (not replayable).
"""

from __future__ import annotations

import torch

from flaggems import Decline

DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})


def fused_kernel():
    """``torch_npu.npu_rms_norm``, or ``None`` where this torch_npu has none (or none is installed)."""
    try:
        import torch_npu
    except ImportError:
        return None
    return getattr(torch_npu, "npu_rms_norm", None)


def reason(input: torch.Tensor, weight: torch.Tensor | None, weight_offset: float) -> str | None:
    """Why torch_npu's kernel does not serve this call (``None`` when it does); metadata only."""
    if fused_kernel() is None:
        return "this torch_npu has no npu_rms_norm"
    if weight is None or weight_offset:
        return "no weight, or a weight offset (Gemma): the generic kernels serve it"
    if input.dtype not in DTYPES or weight.dtype != input.dtype:
        return f"dtypes {input.dtype}/{weight.dtype}: npu_rms_norm takes one float dtype"
    if weight.dim() != 1 or input.dim() == 0 or weight.shape[0] != input.shape[-1] or input.numel() == 0:
        return "not a [..., H] input with an [H] weight"
    if input.device != weight.device:
        return "tensors on different devices"
    if not input.is_contiguous():
        return "a strided input: the generic kernels keep its layout (the output's strides follow it)"
    if torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad):
        return "a gradient is needed: the generic kernels' autograd node records it"
    return None


def supports(input: torch.Tensor, weight: torch.Tensor | None, eps: float, weight_offset: float = 0.0,
             cast_first: bool = True) -> bool | str:
    """The OpImpl's ``supports``: :func:`reason` as the contract wants it."""
    why = reason(input, weight, weight_offset)
    return True if why is None else why


def rms_norm(input: torch.Tensor, weight: torch.Tensor | None, eps: float, weight_offset: float = 0.0,
             cast_first: bool = True) -> torch.Tensor:
    """``flaggems::rms_norm`` through ``torch_npu.npu_rms_norm`` (its first result; the second is rstd)."""
    why = reason(input, weight, weight_offset)
    if why is not None:
        raise Decline(why)
    return fused_kernel()(input, weight, epsilon=eps)[0]
