"""``flaggems::rotary_cache_append``: a decode step's rotary embedding and DynamicCache append, forward only.

As a transformers Llama/Qwen2 attention does it between its projections and
its attention function: ``q``/``k``/``v`` are transposed ``[B, H, S, D]``
views of the ``[B, S, H*D]`` projections (GQA), ``cos``/``sin`` ``[B, S, D]``
of the positions after the cache, ``keys``/``values`` ``[B, Hk, L, D]``
contiguous, bf16. The torch side runs the op's reference (flaggems disabled):
rotary's unfused sequence (:mod:`flaggems.ops.rotary.shapes`) and the cache
layer's two ``torch.cat``. Model shapes: rotary's (hidden size: heads / kv
heads x head dimension); tokens: decode 1x1 and 8x1, against caches of 128 and
1024 positions. No backward: a cache step runs under inference.
"""

from __future__ import annotations

import torch

from flaggems.bench.workload import Inputs, Workload, dtype_name, nbytes, randn
from flaggems.ops.rotary.shapes import MODELS, angles

OP = "rotary_cache"
ROUTES = ("flaggems::rotary_cache_append",)

#: (batch, sequence): decode of one and eight sequences.
TOKENS = ((1, 1), (8, 1))
#: Positions in the cache before the step.
CACHES = (128, 1024)
SMOKE = {"batch": 1, "seq": 1, "heads": 4, "kv_heads": 2, "head_dim": 16, "cache": 5}


def build(device: torch.device, batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, cache: int,
          dtype: torch.dtype = torch.bfloat16) -> Inputs:
    """The q, k and v projections ``[B, S, H*D]``, ``cos``/``sin`` of positions ``cache ..`` and the cache."""
    cos, sin = angles(device, batch, cache + seq, head_dim, dtype)
    return {"q": randn((batch, seq, heads * head_dim), dtype, device, seed=1),
            "k": randn((batch, seq, kv_heads * head_dim), dtype, device, seed=2),
            "v": randn((batch, seq, kv_heads * head_dim), dtype, device, seed=3),
            "cos": cos[:, cache:].contiguous(), "sin": sin[:, cache:].contiguous(),
            "keys": randn((batch, kv_heads, cache, head_dim), dtype, device, seed=4),
            "values": randn((batch, kv_heads, cache, head_dim), dtype, device, seed=5),
            "shape": (batch, seq, heads, kv_heads, head_dim)}


def forward(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rotary_cache_append(q, k, v, cos, sin, keys, values)`` on the transposed views of the projections."""
    batch, seq, heads, kv_heads, head_dim = inputs["shape"]
    q, k, v = (inputs[name].view(batch, seq, h, head_dim).transpose(1, 2)
               for name, h in (("q", heads), ("k", kv_heads), ("v", kv_heads)))
    return torch.ops.flaggems.rotary_cache_append(q, k, v, inputs["cos"], inputs["sin"], inputs["keys"],
                                                  inputs["values"])


def bytes_forward(inputs: Inputs) -> int:
    """``q``, ``k``, ``v`` read and written, ``cos``/``sin`` read, the cache read and written once."""
    return (2 * nbytes(inputs["q"], inputs["k"], inputs["v"], inputs["keys"], inputs["values"])
            + nbytes(inputs["cos"], inputs["sin"]))


def case(model: tuple[int, int, int, int], tokens: tuple[int, int], cache: int) -> Workload:
    """One workload: a model's attention shapes at one token count against one cache length."""
    hidden, heads, kv_heads, head_dim = model
    batch, seq = tokens
    return Workload(
        op=OP, name=f"fwd hidden{hidden} {heads}/{kv_heads}x{head_dim} tokens {batch}x{seq} cache {cache}",
        smoke_name=f"fwd hidden{SMOKE['heads'] * SMOKE['head_dim']} {SMOKE['heads']}/{SMOKE['kv_heads']}x"
                   f"{SMOKE['head_dim']} tokens {SMOKE['batch']}x{SMOKE['seq']} cache {SMOKE['cache']}",
        dtype=dtype_name(torch.bfloat16), build=build, run=forward, bytes_moved=bytes_forward, routes=ROUTES,
        source="transformers Llama attention on a DynamicCache (decode)",
        params={"batch": batch, "seq": seq, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
                "cache": cache},
        smoke=SMOKE,
    )


WORKLOADS: tuple[Workload, ...] = tuple(case(model, tokens, cache) for model in MODELS for tokens in TOKENS
                                        for cache in CACHES)
