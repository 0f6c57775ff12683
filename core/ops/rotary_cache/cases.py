"""Contract cases of ``flaggems::rotary_cache_append(q, k, v, cos, sin, keys, values, unsqueeze_dim=1)``.

Inputs as a transformers Llama attention passes them on a ``DynamicCache``
step: ``q`` ``[B, Hq, S, D]`` and ``k``/``v`` ``[B, Hk, S, D]`` transposed
views of the ``[B, S, H*D]`` projections (GQA, ``Hq = 4 Hk``), ``cos``/``sin``
``[B, S, D]`` of the positions after the cache, ``keys``/``values``
``[B, Hk, L, D]`` contiguous (the cache so far). Decode (``S = 1``) in fp32,
fp16 and bf16, head dimensions 16, 64 and 128, batch 1 and 3, caches of 1, 7
and 33 positions; a 5-token prefill appended to 3; ``q``/``k``/``v`` sliced out
of one fused QKV projection; a cache of every other position (not dense);
one sequence, one head; angles shared by the batch. Calls the kernels decline
(fp64, mixed dtypes, DynamicLayer's first call with a 1-D empty cache, an
empty 4-D cache, an odd head dimension) and one the reference rejects (a cache
of another head count: its ``cat`` raises) are cases too.

Tolerance: rotary's (:mod:`flaggems.ops.rotary.cases`), 4 ulps of the output
dtype for every dtype: ``q_rot`` and the appended ``k`` are rotary's outputs
(the reference rounds three times, the kernel computes in fp32 and rounds
once); the kit adds one ulp for bf16 under the interpreter (its truncating
store). The rest of ``keys'``/``values'`` are copies, bit-exact on both sides,
but a case has one tolerance for all its outputs. Measured on the CPU
interpreter (the generic kernel, in the kit's ``atol + rtol * |expected|``
units): ``q_rot`` and ``keys'`` at most 0.8 for bfloat16 / float16, 0 for
float32; ``values'`` 0. No float64 reference is registered (as rotary): the
kit's float64 judge runs the op on float64 copies.
"""

from __future__ import annotations

import torch

from flaggems.ops.rotary.cases import ULPS, angles, projection
from flaggems.testing import Case

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
OP = "flaggems::rotary_cache_append"


def positions(batch: int, cache: int, seq: int, dim: int, dtype: torch.dtype,
              dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` ``[batch, seq, dim]`` of positions ``cache ..`` (rotary's angles, contiguous)."""
    cos, sin = angles(batch, cache + seq, dim, dtype, dev)
    return cos[:, cache:].contiguous(), sin[:, cache:].contiguous()


def past(batch: int, heads: int, cache: int, dim: int, dtype: torch.dtype, dev: torch.device,
         step: int = 1) -> torch.Tensor:
    """A cache ``[batch, heads, cache, dim]``: contiguous, or every ``step``-th position of a longer one."""
    return torch.randn(batch, heads, cache * step, dim, dtype=F64, device=dev).to(dtype)[:, :, ::step]


def fused_qkv(batch: int, seq: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype,
              dev: torch.device) -> tuple[torch.Tensor, ...]:
    """``q``, ``k``, ``v`` as transposed views of slices of one ``[B, S, (Hq + 2 Hk) * D]`` projection."""
    qkv = torch.randn(batch, seq, (heads + 2 * kv_heads) * dim, dtype=F64, device=dev).to(dtype)
    bounds = (0, heads, heads + kv_heads, heads + 2 * kv_heads)
    return tuple(qkv[..., a * dim:b * dim].view(batch, seq, b - a, dim).transpose(1, 2)
                 for a, b in zip(bounds, bounds[1:]))


def step(name: str, batch: int = 1, heads: int = 8, kv_heads: int = 2, seq: int = 1, dim: int = 16,
         cache: int = 7, dtype: torch.dtype = F32, *, fused: bool = False, cache_step: int = 1,
         angle_batch: int | None = None, angle_dtype: torch.dtype | None = None,
         cache_dtype: torch.dtype | None = None, cache_heads: int | None = None, unsqueeze_dim: int | None = None,
         keyword: bool = False, **kw) -> Case:
    """One attention step: ``seq`` new positions appended to a cache of ``cache`` (``cache_*``: the cache's own
    layout, dtype or head count; ``angle_*``: ``cos``/``sin``'s batch or dtype, when not the call's;
    ``unsqueeze_dim`` passed when given, by keyword with ``keyword``)."""

    def make(dev):
        if fused:
            q, k, v = fused_qkv(batch, seq, heads, kv_heads, dim, dtype, dev)
        else:
            q, k, v = (projection(batch, seq, h, dim, dtype, dev) for h in (heads, kv_heads, kv_heads))
        cos, sin = positions(angle_batch or batch, cache, seq, dim, angle_dtype or dtype, dev)
        keys, values = (past(batch, cache_heads or kv_heads, cache, dim, cache_dtype or dtype, dev, cache_step)
                        for _ in range(2))
        args = (q, k, v, cos, sin, keys, values)
        if unsqueeze_dim is None:
            return args, {}
        return (args, {"unsqueeze_dim": unsqueeze_dim}) if keyword else ((*args, unsqueeze_dim), {})

    kw.setdefault("ulps", ULPS[dtype])
    return Case(name, make, **kw)


def _first_call(dtype: torch.dtype | None):
    """DynamicLayer's first update: ``keys``/``values`` 1-D empty (``torch.tensor([], dtype=k.dtype)``;
    ``dtype=None``: ``torch.tensor([])``'s float32); the reference's ``cat`` returns the rotated ``k`` and ``v``."""

    def make(dev):
        q, k, v = (projection(2, 3, h, 16, dtype or F32, dev) for h in (4, 2, 2))
        empty = (torch.tensor([], device=dev) if dtype is None else torch.tensor([], dtype=dtype, device=dev))
        return (q, k, v, *positions(2, 0, 3, 16, dtype or F32, dev), empty, empty.clone()), {}

    return make


def _odd_head_dim(dev):
    """``D = 7``: the reference's rotate-half splits 3 + 4 (declined: an even head dimension is served)."""
    q, k, v = (projection(2, 1, h, 7, F32, dev) for h in (4, 1, 1))
    cos, sin = torch.randn(2, 1, 7, device=dev), torch.randn(2, 1, 7, device=dev)
    return (q, k, v, cos, sin, past(2, 1, 3, 7, F32, dev), past(2, 1, 3, 7, F32, dev), 1), {}


def _cases():
    dtypes, dims, caches = (F32, F16, BF16), (16, 64, 128), (1, 7, 33)
    for r, dtype in enumerate(dtypes):
        for c, dim in enumerate(dims):  # a Latin square: every dtype and every head dimension meets every length
            batch, cache = (1, 3)[(r + c) % 2], caches[(r + c) % 3]
            kv = 2 if dim < 64 else 1  # GQA 4:1 either way; fewer heads keep D = 128 quick in the interpreter
            yield step(f"decode-{str(dtype)[6:]}-d{dim}-b{batch}-cache{cache}", batch, 4 * kv, kv, 1, dim, cache,
                       dtype)
    yield step("prefill-s5-cache3", batch=2, seq=5, cache=3)
    yield step("prefill-s5-cache3-bfloat16", batch=2, seq=5, cache=3, dtype=BF16)
    yield step("fused-qkv-decode", batch=3, fused=True)
    yield step("fused-qkv-prefill-bfloat16", batch=2, seq=3, cache=4, fused=True, dtype=BF16)
    yield step("strided-cache-every-other-position", batch=2, cache_step=2)
    yield step("strided-cache-fused-qkv-float16", batch=2, seq=2, cache=5, cache_step=2, fused=True, dtype=F16)
    yield step("one-sequence-one-head", heads=1, kv_heads=1, cache=4)
    yield step("multi-head-attention", batch=2, heads=2, kv_heads=2, cache=3)
    yield step("angles-shared-by-batch", batch=3, angle_batch=1)
    yield step("unsqueeze-dim-by-keyword", batch=2, unsqueeze_dim=1, keyword=True)
    yield step("unsqueeze-dim-minus-3", batch=2, unsqueeze_dim=-3)
    yield step("dtype-f64-declined", batch=2, dtype=F64)
    # bf16 projections with fp32 cos/sin: the reference's rotation promotes to fp32, its cat too (declined)
    yield step("mixed-angle-dtype-declined", batch=2, dtype=BF16, angle_dtype=F32, ulps=ULPS[F32])
    # an fp32 cache with bf16 projections: the reference's cat promotes keys' and values' to fp32 (declined)
    yield step("mixed-cache-dtype-declined", batch=2, dtype=BF16, cache_dtype=F32, ulps=ULPS[F32])
    yield Case("first-call-empty-1d-cache-declined", _first_call(None), ulps=ULPS[F32])
    yield Case("first-call-empty-1d-cache-bfloat16-declined", _first_call(BF16), ulps=ULPS[BF16])
    yield step("empty-4d-cache-declined", batch=2, cache=0)
    yield Case("odd-head-dim-declined", _odd_head_dim, ulps=ULPS[F32])
    yield step("error-cache-head-count", cache_heads=3, raises=RuntimeError,
               match="Sizes of tensors must match except in dimension 2")


CASES = {OP: list(_cases())}
