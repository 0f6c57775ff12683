"""``flaggems::silu_mul``, ``gelu_tanh_mul`` and ``gelu_mul``: a gated MLP's ``act(gate) * up``.

Intermediate sizes of the decoder models the fused ops target: 2816 (hidden
1024), 4864 (Qwen2-0.5B), 8192 (Llama-1B-like, hidden 2048), 14336 (hidden
4096: Llama-3-8B, Mistral-7B); tokens 1 and 8 (decode: ``[B, 1, I]``) and
2048 (prefill, ``[4, 512, I]``); forward, and forward+backward. ``gate`` and
``up`` are two linears' outputs; the ``merged`` workloads take them as the two
halves of one ``[..., 2 * I]`` projection (strided views, read in place).

The torch side is the reference with flaggems disabled: exactly the unfused
sequence a patched model replaces (``F.silu(gate)`` then ``* up``: two
kernels, their backward three). torch has no fused op for it to add as a
third comparison. GeGLU (Gemma) runs at two sizes. All of these in bf16.

``gelu_mul`` (the exact GELU) runs at the shapes of diffusers' ``GEGLU`` in
the SD-1.5 UNet's transformer blocks, fp16 as that model runs: batch 2, the
tokens of a 64x64 latent at each level (4096, 1024, 256) and an inner size of
four times the level's channels (1280, 2560, 5120), the two halves of one
merged projection (``hidden, gate = proj(x).chunk(2, -1)``).
"""

from __future__ import annotations

import torch

from flaggems import ops
from flaggems.bench.workload import Inputs, Workload, dims, dtype_name, nbytes, randn

OP = "glu"
DTYPE = torch.bfloat16
INTERMEDIATE = (2816, 4864, 8192, 14336)
#: Leading shapes: one token, a decode batch of 8, a 4x512 prefill.
TOKENS = ((1, 1), (8, 1), (4, 512))
SMOKE_SHAPE = (2, 3, 48)
#: (op name, intermediate sizes) benchmarked.
OPS = (("silu_mul", INTERMEDIATE), ("gelu_tanh_mul", (8192, 14336)))
#: SD-1.5's GEGLU: ``[batch, tokens, inner]`` of each UNet level (merged halves, fp16).
GEGLU_SHAPES = ((2, 4096, 1280), (2, 1024, 2560), (2, 256, 5120))
GEGLU_DTYPE = torch.float16


def build(device: torch.device, shape: tuple[int, ...], merged: bool, backward: bool,
          dtype: torch.dtype = DTYPE) -> Inputs:
    """``gate`` and ``up`` of ``shape`` (or, ``merged``, ``proj`` of ``[..., 2 * I]``), ``dy`` for the backward."""
    if merged:
        leaves = (randn((*shape[:-1], 2 * shape[-1]), dtype, device),)
        inputs: Inputs = {"proj": leaves[0]}
    else:
        leaves = (randn(shape, dtype, device), randn(shape, dtype, device, seed=1))
        inputs = {"gate": leaves[0], "up": leaves[1]}
    inputs["leaves"] = leaves
    if backward:
        for leaf in leaves:
            leaf.requires_grad_(True)
        inputs["dy"] = randn(shape, dtype, device, seed=2)
    return inputs


def _operands(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate, up)``: the inputs, or the halves of the merged projection (views, taken per call)."""
    proj = inputs.get("proj")
    return (inputs["gate"], inputs["up"]) if proj is None else proj.chunk(2, -1)


def _forward(name: str):
    op = ops.overload(name)

    def forward(inputs: Inputs) -> torch.Tensor:
        """``torch.ops.flaggems.<op>(gate, up)``."""
        return op(*_operands(inputs))

    def forward_backward(inputs: Inputs) -> tuple[torch.Tensor, ...]:
        """Forward, then the gradients of the leaves (``gate``/``up``, or the merged projection) for ``dy``."""
        return torch.autograd.grad(forward(inputs), inputs["leaves"], inputs["dy"])

    return forward, forward_backward


def bytes_forward(inputs: Inputs) -> int:
    """``gate`` and ``up`` read, the product written."""
    return 3 * nbytes(_operands(inputs)[0])


def bytes_forward_backward(inputs: Inputs) -> int:
    """Forward (3 per element) plus backward: ``dy``, ``gate``, ``up`` read, ``dgate``, ``dup`` written."""
    return 8 * nbytes(_operands(inputs)[0])


def case(name: str, shape: tuple[int, ...], backward: bool, merged: bool = False, dtype: torch.dtype = DTYPE,
         source: str = "issue 39: decoder MLP shapes") -> Workload:
    """One workload of ``flaggems::<name>`` at ``shape``."""
    forward, forward_backward = _forward(name)
    label = f"{name} {'fwd+bwd' if backward else 'fwd'}{' merged' if merged else ''}"
    common = {"merged": merged, "backward": backward, "dtype": dtype}
    return Workload(
        op=OP, name=f"{label} {dims(shape)}", smoke_name=f"{label} {dims(SMOKE_SHAPE)}", dtype=dtype_name(dtype),
        build=build, run=forward_backward if backward else forward,
        bytes_moved=bytes_forward_backward if backward else bytes_forward, routes=(f"flaggems::{name}",),
        source=source, params={"shape": shape, **common},
        smoke={"shape": SMOKE_SHAPE, **common},
    )


def _workloads() -> tuple[Workload, ...]:
    found = []
    for name, sizes in OPS:
        for backward in (False, True):
            found += [case(name, (*tokens, size), backward) for size in sizes for tokens in TOKENS]
            found.append(case(name, (*TOKENS[-1], sizes[-1]), backward, merged=True))
    for backward in (False, True):
        found += [case("gelu_mul", shape, backward, merged=True, dtype=GEGLU_DTYPE,
                       source="issue 41: SD-1.5 GEGLU shapes") for shape in GEGLU_SHAPES]
    return tuple(found)


WORKLOADS: tuple[Workload, ...] = _workloads()
