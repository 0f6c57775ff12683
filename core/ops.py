"""flaggems' own operators (namespace ``flaggems``): the fused pieces of decoder layers.

torch has no single operator for what a transformers decoder layer spells out
in several (an RMSNorm in ~8 ops, a residual add before it, rotary embedding
of q and k in ~14, SiLU(gate) x up in 2). Each is defined here once, as a
torch operator with a schema and a **torch reference** registered as its
``CompositeImplicitAutograd`` kernel: wherever flaggems is disabled, declines
or is not installed for the device, the call runs the reference (torch's own
ops), so a patched model runs everywhere; autograd, fake tensors and
``torch.compile`` see through it (they decompose it into those ops).

They are ops of the contract like any aten op: an implementation is an
``OpImpl("flaggems::rms_norm", ...)`` (chains, vendor implementations,
declines, the conformance kit, ``flaggems routes``); the core registers its
entries on the backend's key and, these being CompositeImplicitAutograd, on
the Autograd key too (:meth:`flaggems.binding.Binding.register`).

The references follow transformers' module code, rounding included, so that
a patched model keeps its results within the dtype's tolerance:

* ``rms_norm(input, weight, eps, weight_offset=0, cast_first=True)``: the
  mean of squares in float32; ``cast_first`` (Llama, Qwen2/3, Mistral) casts
  the normalised values to the input's dtype, then multiplies by the weight
  (the result in their promoted dtype); otherwise (Gemma) multiplies in
  float32 by ``weight + weight_offset`` and casts the product.
* ``add_rms_norm(input, residual, ...)``: ``(rms_norm(input + residual),
  input + residual)``: a layer's residual add and the norm after it.
* ``rotary_embedding(q, k, cos, sin, unsqueeze_dim=1, interleaved=False)``:
  ``x * cos + rotate(x) * sin`` for both, ``cos``/``sin`` unsqueezed at
  ``unsqueeze_dim``; ``rotate`` is Llama's rotate-half (``cat(-x2, x1)`` of
  the two halves) or, ``interleaved``, GPT-J's rotation of each pair.
* ``silu_mul(gate, up)``: ``silu(gate) * up``; ``gelu_tanh_mul(gate, up)``:
  ``gelu(gate, approximate="tanh") * up`` (Gemma); ``gelu_mul(gate, up)``:
  ``gelu(gate) * up``, the exact (erf) GELU of diffusers' ``GEGLU``.
* ``group_norm_silu(input, num_groups, weight=None, bias=None, eps=1e-5)``:
  ``silu(group_norm(input, num_groups, weight, bias, eps))``, the GroupNorm
  then SiLU of diffusers' ``ResnetBlock2D`` (twice a block in a UNet).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling

NAMESPACE = "flaggems"

SCHEMAS = {
    "rms_norm": "rms_norm(Tensor input, Tensor? weight, float eps, float weight_offset=0.0, "
                "bool cast_first=True) -> Tensor",
    "add_rms_norm": "add_rms_norm(Tensor input, Tensor residual, Tensor? weight, float eps, "
                    "float weight_offset=0.0, bool cast_first=True) -> (Tensor, Tensor)",
    "rotary_embedding": "rotary_embedding(Tensor q, Tensor k, Tensor cos, Tensor sin, int unsqueeze_dim=1, "
                        "bool interleaved=False) -> (Tensor, Tensor)",
    "silu_mul": "silu_mul(Tensor gate, Tensor up) -> Tensor",
    "gelu_tanh_mul": "gelu_tanh_mul(Tensor gate, Tensor up) -> Tensor",
    "gelu_mul": "gelu_mul(Tensor gate, Tensor up) -> Tensor",
    "group_norm_silu": "group_norm_silu(Tensor input, int num_groups, Tensor? weight=None, Tensor? bias=None, "
                       "float eps=1e-05) -> Tensor",
}


def rms_norm(input: torch.Tensor, weight: torch.Tensor | None, eps: float, weight_offset: float = 0.0,
             cast_first: bool = True) -> torch.Tensor:
    """The reference of ``flaggems::rms_norm`` (see the module docstring)."""
    x = input.float()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return normed.to(input.dtype)
    if cast_first:
        scale = weight + weight_offset if weight_offset else weight
        return scale * normed.to(input.dtype)
    return (normed * (weight.float() + weight_offset)).to(input.dtype)


def add_rms_norm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
                 weight_offset: float = 0.0, cast_first: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of ``flaggems::add_rms_norm``: ``(rms_norm(input + residual), input + residual)``."""
    total = input + residual
    return rms_norm(total, weight, eps, weight_offset, cast_first), total


def rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The rotation rotary embedding multiplies by ``sin``: rotate-half, or each pair (``interleaved``)."""
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1,
                     interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of ``flaggems::rotary_embedding``: ``q`` and ``k`` rotated by the angles of ``cos``/``sin``."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate(q, interleaved) * sin, k * cos + rotate(k, interleaved) * sin


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The reference of ``flaggems::silu_mul``: ``silu(gate) * up`` (SwiGLU's product)."""
    return F.silu(gate) * up


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The reference of ``flaggems::gelu_tanh_mul``: ``gelu(gate, approximate="tanh") * up`` (GeGLU's)."""
    return F.gelu(gate, approximate="tanh") * up


def gelu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The reference of ``flaggems::gelu_mul``: ``gelu(gate) * up`` (the exact GELU: diffusers' GEGLU)."""
    return F.gelu(gate) * up


def group_norm_silu(input: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """The reference of ``flaggems::group_norm_silu``: ``silu(group_norm(input))`` (a UNet block's norm, activation)."""
    return F.silu(F.group_norm(input, num_groups, weight, bias, eps))


REFERENCES = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "rotary_embedding": rotary_embedding,
              "silu_mul": silu_mul, "gelu_tanh_mul": gelu_tanh_mul, "gelu_mul": gelu_mul,
              "group_norm_silu": group_norm_silu}

_LOCK = threading.Lock()
_LIBRARY: list[torch.library.Library] = []


def define() -> None:
    """Define the operators with torch, once per process (``import flaggems`` does it; about 1 ms)."""
    with _LOCK:
        if _LIBRARY:
            return
        if hasattr(torch.ops, NAMESPACE) and hasattr(getattr(torch.ops, NAMESPACE), "rms_norm"):
            return  # defined by another copy of this module (a reload)
        library = torch.library.Library(NAMESPACE, "DEF")
        for name, schema in SCHEMAS.items():
            library.define(schema)
            library.impl(name, REFERENCES[name], "CompositeImplicitAutograd")
        _LIBRARY.append(library)


def overload(name: str) -> torch._ops.OpOverload:
    """``torch.ops.flaggems.<name>.default``."""
    define()
    return getattr(getattr(torch.ops, NAMESPACE), name).default
