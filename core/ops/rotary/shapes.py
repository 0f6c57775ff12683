"""``flaggems::rotary_embedding``: q and k of a decoder layer rotated, forward and forward+backward.

As transformers' Llama/Qwen2/Mistral attention calls it: ``q``/``k`` are
transposed ``[B, H, S, D]`` views of the ``[B, S, H*D]`` projections (GQA),
``cos``/``sin`` ``[B, S, D]`` in bf16. The torch side runs the op's reference
(flaggems disabled): the unfused sequence the patched model replaces, ~14 ops
for q and k (``q * cos``, two slices, a negation, a cat, a product and a sum
each) and their backward. Model shapes (hidden size: heads / kv heads x head
dimension): Qwen2-0.5B 896 (14/2 x 64), 1024 (16/4 x 64), Llama-1B-like 2048
(32/8 x 64) and 4096 (32/8 x 128); tokens: decode 1x1 and 8x1, prefill 4x512.
"""

from __future__ import annotations

import torch

from flaggems.bench.workload import Inputs, Workload, dtype_name, nbytes, randn

OP = "rotary"
ROUTES = ("flaggems::rotary_embedding",)

#: (hidden size, heads, kv heads, head dimension).
MODELS = ((896, 14, 2, 64), (1024, 16, 4, 64), (2048, 32, 8, 64), (4096, 32, 8, 128))
#: (batch, sequence): decode of one and eight sequences, a 4x512 prefill.
TOKENS = ((1, 1), (8, 1), (4, 512))
SMOKE = {"batch": 1, "seq": 3, "heads": 4, "kv_heads": 2, "head_dim": 16}


def angles(device: torch.device, batch: int, seq: int, head_dim: int,
           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` ``[batch, seq, head_dim]`` as Llama's rotary module builds them (base 10000)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    pos = torch.arange(seq, device=device, dtype=torch.float32).expand(batch, seq)
    freqs = pos[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def build(device: torch.device, batch: int, seq: int, heads: int, kv_heads: int, head_dim: int,
          dtype: torch.dtype = torch.bfloat16, backward: bool = False) -> Inputs:
    """The q and k projections ``[B, S, H*D]``, ``cos``/``sin``, and the outputs' gradients for the backward."""
    q = randn((batch, seq, heads * head_dim), dtype, device, seed=1)
    k = randn((batch, seq, kv_heads * head_dim), dtype, device, seed=2)
    cos, sin = angles(device, batch, seq, head_dim, dtype)
    inputs = {"q": q.requires_grad_(backward), "k": k.requires_grad_(backward), "cos": cos, "sin": sin,
              "shape": (batch, seq, heads, kv_heads, head_dim)}
    if backward:
        inputs["dq"] = randn((batch, heads, seq, head_dim), dtype, device, seed=3)
        inputs["dk"] = randn((batch, kv_heads, seq, head_dim), dtype, device, seed=4)
    return inputs


def _call(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seq, heads, kv_heads, head_dim = inputs["shape"]
    q = inputs["q"].view(batch, seq, heads, head_dim).transpose(1, 2)
    k = inputs["k"].view(batch, seq, kv_heads, head_dim).transpose(1, 2)
    return torch.ops.flaggems.rotary_embedding(q, k, inputs["cos"], inputs["sin"])


def forward(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary_embedding(q, k, cos, sin)`` on the transposed views of the projections."""
    return _call(inputs)


def forward_backward(inputs: Inputs) -> tuple[torch.Tensor, ...]:
    """Forward, then the gradients of both projections for ``dq``/``dk``."""
    q_rot, k_rot = _call(inputs)
    return torch.autograd.grad((q_rot, k_rot), (inputs["q"], inputs["k"]), (inputs["dq"], inputs["dk"]))


def bytes_forward(inputs: Inputs) -> int:
    """``q``, ``k`` read and written, ``cos``/``sin`` read once."""
    return 2 * nbytes(inputs["q"], inputs["k"]) + nbytes(inputs["cos"], inputs["sin"])


def bytes_forward_backward(inputs: Inputs) -> int:
    """The forward, then the gradients read and written and ``cos``/``sin`` read again."""
    return 2 * bytes_forward(inputs)


def case(model: tuple[int, int, int, int], tokens: tuple[int, int], backward: bool) -> Workload:
    """One workload: a model's attention shapes at one token count, forward or forward+backward."""
    hidden, heads, kv_heads, head_dim = model
    batch, seq = tokens
    kind = "fwd+bwd" if backward else "fwd"
    return Workload(
        op=OP, name=f"{kind} hidden{hidden} {heads}/{kv_heads}x{head_dim} tokens {batch}x{seq}",
        smoke_name=f"{kind} hidden{SMOKE['heads'] * SMOKE['head_dim']} {SMOKE['heads']}/{SMOKE['kv_heads']}x"
                   f"{SMOKE['head_dim']} tokens {SMOKE['batch']}x{SMOKE['seq']}",
        dtype=dtype_name(torch.bfloat16), build=build, run=forward_backward if backward else forward,
        bytes_moved=bytes_forward_backward if backward else bytes_forward, routes=ROUTES,
        source="issue 39 (transformers Llama/Qwen2 attention)",
        params={"batch": batch, "seq": seq, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
                "backward": backward},
        smoke={**SMOKE, "backward": backward},
    )


WORKLOADS: tuple[Workload, ...] = tuple(case(model, tokens, backward) for backward in (False, True)
                                        for model in MODELS for tokens in TOKENS)
