"""``flaggems::rms_norm`` and ``flaggems::add_rms_norm`` on decoder shapes, forward and forward+backward.

Hidden sizes of small decoders (bf16): 896 (Qwen2-0.5B), 1024, 2048
(Llama-1B-like), 4096 (Llama-8B-like); tokens 1 and 8 (decode) and 2048
(prefill, 4 x 512). The torch side is the reference with flaggems disabled,
i.e. the unfused ops transformers' ``LlamaRMSNorm`` runs (``add_rms_norm``:
``input + residual``, then those ops). The ``vs F.rms_norm`` workloads time
torch's own fused ``F.rms_norm`` on the torch side (their ``torch_run``) against our kernel with
``cast_first=False`` (one rounding of ``n * weight``: ``F.rms_norm``'s semantics).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 - the usual spelling

from flaggems.bench.workload import Inputs, Workload, dims, dtype_name, nbytes, randn

OP = "rms_norm"
ROUTES = ("flaggems::rms_norm",)
ADD_ROUTES = ("flaggems::add_rms_norm",)
EPS = 1e-6
HIDDEN = (896, 1024, 2048, 4096)
TOKENS = ((1, 1), (8, 1), (4, 512))  # (batch, sequence)
SMOKE = {"batch": 2, "seq": 3, "hidden": 64}


def build(device: torch.device, batch: int, seq: int, hidden: int, dtype: torch.dtype, add: bool,
          backward: bool) -> Inputs:
    """Hidden states ``[batch, seq, hidden]``, a weight around 1, the residual and output gradients as asked."""
    x = randn((batch, seq, hidden), dtype, device)
    inputs = {"x": x, "weight": 1 + 0.1 * randn((hidden,), dtype, device, seed=1)}
    if add:
        inputs["residual"] = randn(x.shape, dtype, device, seed=2)
    if backward:
        for name in ("x", "weight", "residual"):
            if name in inputs:
                inputs[name].requires_grad_(True)
        inputs["dy"] = randn(x.shape, dtype, device, seed=3)
        if add:
            inputs["dsum"] = randn(x.shape, dtype, device, seed=4)
    return inputs


def forward(inputs: Inputs) -> torch.Tensor:
    """``flaggems::rms_norm(x, weight, eps)`` (the reference when flaggems is off)."""
    return torch.ops.flaggems.rms_norm(inputs["x"], inputs["weight"], EPS)


def add_forward(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``flaggems::add_rms_norm(x, residual, weight, eps)``: ``(normed, x + residual)``."""
    return torch.ops.flaggems.add_rms_norm(inputs["x"], inputs["residual"], inputs["weight"], EPS)


def forward_backward(inputs: Inputs) -> tuple[torch.Tensor, ...]:
    """Forward, then the gradients of ``x`` and ``weight`` for ``dy``."""
    return torch.autograd.grad(forward(inputs), (inputs["x"], inputs["weight"]), inputs["dy"])


def add_forward_backward(inputs: Inputs) -> tuple[torch.Tensor, ...]:
    """Forward, then the gradients of ``x``, ``residual`` and ``weight`` for ``dy`` and ``dsum``."""
    outputs = add_forward(inputs)
    return torch.autograd.grad(outputs, (inputs["x"], inputs["residual"], inputs["weight"]),
                               (inputs["dy"], inputs["dsum"]))


def fused(inputs: Inputs) -> torch.Tensor:
    """``flaggems::rms_norm(x, weight, eps, 0.0, cast_first=False)``: one rounding, as ``F.rms_norm`` rounds."""
    return torch.ops.flaggems.rms_norm(inputs["x"], inputs["weight"], EPS, 0.0, False)


def fused_torch(inputs: Inputs) -> torch.Tensor:
    """torch's own ``F.rms_norm`` (the torch side of the ``vs F.rms_norm`` workloads)."""
    x = inputs["x"]
    return F.rms_norm(x, (x.shape[-1],), inputs["weight"], EPS)


def fused_backward(inputs: Inputs) -> tuple[torch.Tensor, ...]:
    """:func:`fused`, then the gradients of ``x`` and ``weight`` for ``dy``."""
    return torch.autograd.grad(fused(inputs), (inputs["x"], inputs["weight"]), inputs["dy"])


def fused_torch_backward(inputs: Inputs) -> tuple[torch.Tensor, ...]:
    """:func:`fused_torch`, then the gradients of ``x`` and ``weight`` for ``dy``."""
    return torch.autograd.grad(fused_torch(inputs), (inputs["x"], inputs["weight"]), inputs["dy"])


def _bytes(passes: int):
    def count(inputs: Inputs) -> int:
        return passes * nbytes(inputs["x"]) + nbytes(inputs["weight"])
    count.__doc__ = f"{passes} passes over the hidden states, the weight once."
    return count


#: (run, torch side's run where not ``run``, passes over the hidden states at least, name prefix, routes)
#: per kind of workload.
KINDS = {
    ("norm", False): (forward, None, 2, "fwd", ROUTES),
    ("norm", True): (forward_backward, None, 5, "fwd+bwd", ROUTES),  # forward x, y; backward x, dy, dx
    ("add", False): (add_forward, None, 4, "add fwd", ADD_ROUTES),  # x, residual, normed, sum
    ("add", True): (add_forward_backward, None, 8, "add fwd+bwd", ADD_ROUTES),  # + sum, dy, dsum, dx
    ("fused", False): (fused, fused_torch, 2, "fwd vs F.rms_norm", ROUTES),
    ("fused", True): (fused_backward, fused_torch_backward, 5, "fwd+bwd vs F.rms_norm", ROUTES),
}


def case(kind: str, backward: bool, batch: int, seq: int, hidden: int,
         dtype: torch.dtype = torch.bfloat16) -> Workload:
    """One workload: ``kind`` is ``norm``, ``add`` or ``fused`` (against ``F.rms_norm``)."""
    run, torch_run, passes, prefix, routes = KINDS[(kind, backward)]
    common = {"dtype": dtype, "add": kind == "add", "backward": backward}
    return Workload(
        op=OP, name=f"{prefix} {dims((batch, seq, hidden))}",
        smoke_name=f"{prefix} {dims((SMOKE['batch'], SMOKE['seq'], SMOKE['hidden']))}", dtype=dtype_name(dtype),
        build=build, run=run, torch_run=torch_run,
        bytes_moved=_bytes(passes), routes=routes, source="issue 39: decoder RMSNorm (Qwen2-0.5B to Llama-8B)",
        params={"batch": batch, "seq": seq, "hidden": hidden, **common}, smoke={**SMOKE, **common},
        float64_judge=backward,  # dweight sums every row: bf16 gradients differ from torch's by its own rounding
    )


WORKLOADS: tuple[Workload, ...] = tuple(
    case(kind, backward, batch, seq, hidden)
    for kind in ("norm", "add", "fused") for backward in (False, True)
    for hidden in HIDDEN for batch, seq in TOKENS
)
