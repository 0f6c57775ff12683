"""Contract cases of ``flaggems::rotary_embedding(q, k, cos, sin, unsqueeze_dim=1, interleaved=False)``.

Inputs as transformers' Llama/Qwen2/Qwen3/Mistral attention passes them: ``q``
``[B, Hq, S, D]`` and ``k`` ``[B, Hkv, S, D]`` as transposed views of the
``[B, S, H*D]`` projections (GQA: ``Hq != Hkv``), ``cos``/``sin`` ``[B, S, D]``
or ``[1, S, D]`` in ``q``'s dtype, built from real angles (``|cos|, |sin| <= 1``).
Also: the ``[B, S, H, D]`` layout with ``unsqueeze_dim=2``, GPT-J's interleaved
rotation, decode (``S = 1``, whose size-1 dimension gets its own stride in the
reference's output), slices of a fused QKV projection (not dense), rank 3,
expanded angles, a column stride of 2, head dimensions 64 to 256. Calls the
kernels decline (fp64, empty inputs, mixed dtypes, an odd head dimension,
angles that would grow the result) and calls the reference rejects (its own
errors) are cases too.

Tolerances, in units of the output dtype's last place (``rtol = atol``): the
reference rounds ``x * cos``, ``rotate(x) * sin`` and their sum to the dtype
(three roundings), the kernels compute in fp32 (FMA where the GPU contracts)
and round once. Where the two terms cancel, the output is small and the
reference's error is that of the terms, up to half an ulp of each (terms as
large as ``|x|``, ~4 for these ``randn`` inputs, so up to ~4 units of the kit's
``atol``): 4 for every dtype. Measured on the CPU interpreter, in the kit's
``atol + rtol * |expected|`` units: at most 0.7 for bfloat16 / float16, 0 for
float32 (the interpreter computes the same fp32 products and sums as torch's
CPU kernel, without FMA); the interpreter's truncating bfloat16 store adds one
(the kit allows it).
"""

from __future__ import annotations

import torch

from flaggems.testing import Case

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
ULPS = {F32: 4, F16: 4, BF16: 4, F64: 4}
OP = "flaggems::rotary_embedding"


def angles(batch: int, seq: int, dim: int, dtype: torch.dtype, dev: torch.device,
           interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` ``[batch, seq, dim]`` as a rotary embedding module builds them (base 10000)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64, device=dev) / dim))
    pos = torch.arange(seq, dtype=torch.float64, device=dev) + 7 * torch.arange(batch, device=dev)[:, None]
    freqs = pos[..., None] * inv_freq
    emb = freqs.repeat_interleave(2, -1) if interleaved else torch.cat((freqs, freqs), -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def projection(batch: int, seq: int, heads: int, dim: int, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """``[B, H, S, D]``, a transposed view of a ``[B, S, H*D]`` projection (transformers' layout)."""
    x = torch.randn(batch, seq, heads * dim, dtype=torch.float64, device=dev).to(dtype)
    return x.view(batch, seq, heads, dim).transpose(1, 2)


def llama(name: str, batch: int = 2, heads: int = 4, kv_heads: int = 2, seq: int = 3, dim: int = 8,
          dtype: torch.dtype = F32, interleaved: bool = False, angle_batch: int | None = None,
          angle_dtype: torch.dtype | None = None, **kw) -> Case:
    """A case in transformers' layout (``angle_batch=1``: ``cos``/``sin`` shared by the batch; ``angle_dtype``:
    theirs, when not ``dtype``)."""

    def make(dev):
        q = projection(batch, seq, heads, dim, dtype, dev)
        k = projection(batch, seq, kv_heads, dim, dtype, dev)
        cos, sin = angles(batch if angle_batch is None else angle_batch, seq, dim, angle_dtype or dtype, dev,
                          interleaved)
        return (q, k, cos, sin), {"interleaved": interleaved} if interleaved else {}

    kw.setdefault("ulps", ULPS[dtype])
    return Case(name, make, **kw)


def custom(name: str, build, dtype: torch.dtype = F32, **kw) -> Case:
    """A case whose arguments ``build(dev)`` returns (``(args, kwargs)``)."""
    kw.setdefault("ulps", ULPS[dtype])
    return Case(name, build, **kw)


def _bshd(dev):
    """``[B, S, H, D]`` contiguous with ``unsqueeze_dim=2`` (the other layout transformers' helper documents)."""
    q = torch.randn(2, 3, 4, 16, device=dev)
    k = torch.randn(2, 3, 2, 16, device=dev)
    cos, sin = angles(2, 3, 16, F32, dev)
    return (q, k, cos, sin, 2), {}


def _fused_qkv(dev):
    """``q`` and ``k`` sliced out of one ``[B, S, (Hq + 2 Hkv) * D]`` projection: not dense."""
    B, S, H, Hk, D = 2, 3, 4, 2, 16
    qkv = torch.randn(B, S, (H + 2 * Hk) * D, device=dev)
    q = qkv[..., :H * D].view(B, S, H, D).transpose(1, 2)
    k = qkv[..., H * D:(H + Hk) * D].view(B, S, Hk, D).transpose(1, 2)
    cos, sin = angles(B, S, D, F32, dev)
    return (q, k, cos, sin), {}


def _contiguous(dev):
    q, k = torch.randn(2, 4, 3, 32, device=dev), torch.randn(2, 2, 3, 32, device=dev)
    return (q, k, *angles(2, 3, 32, F32, dev)), {}


def _rank3(dev):
    """``[S, H, D]`` with ``cos`` ``[S, D]`` unsqueezed at 1."""
    q, k = torch.randn(5, 4, 16, device=dev), torch.randn(5, 2, 16, device=dev)
    cos, sin = angles(1, 5, 16, F32, dev)
    return (q, k, cos[0], sin[0], 1), {}


def _expanded_angles(dev):
    """``cos``/``sin`` of one position expanded over the batch and the sequence (stride 0)."""
    q, k = projection(2, 3, 4, 16, F32, dev), projection(2, 3, 2, 16, F32, dev)
    cos, sin = angles(1, 1, 16, F32, dev)
    return (q, k, cos.expand(2, 3, 16), sin.expand(2, 3, 16)), {}


def _column_stride(dev):
    """Every other element of a wider tensor: a column stride of 2, read in place."""
    q = torch.randn(2, 4, 3, 32, device=dev)[..., ::2]
    k = torch.randn(2, 2, 3, 32, device=dev)[..., ::2]
    cos, sin = angles(2, 3, 16, F32, dev)
    return (q, k, cos, sin), {}


def _odd_head_dim(dev):
    """``D = 7``: the reference's rotate-half splits 3 + 4 (declined: an even head dimension is served)."""
    q, k = projection(2, 3, 4, 7, F32, dev), projection(2, 3, 2, 7, F32, dev)
    cos, sin = torch.randn(2, 3, 7, device=dev), torch.randn(2, 3, 7, device=dev)
    return (q, k, cos, sin), {}


def _error(name: str, match: str, raises: type = RuntimeError, q_dim: int = 8, angle_dim: int = 8,
           unsqueeze_dim: int = 1, interleaved: bool = False, angle_batch: int = 2) -> Case:
    def make(dev):
        q, k = projection(2, 3, 4, q_dim, F32, dev), projection(2, 3, 2, q_dim, F32, dev)
        cos, sin = torch.randn(angle_batch, 3, angle_dim, device=dev), torch.randn(angle_batch, 3, angle_dim,
                                                                                   device=dev)
        return (q, k, cos, sin, unsqueeze_dim, interleaved), {}

    return Case(name, make, raises=raises, match=match)


def _cases():
    for dtype in (F32, F16, BF16):
        yield llama(f"llama-gqa-{str(dtype)[6:]}", dtype=dtype)
        yield llama(f"decode-s1-{str(dtype)[6:]}", seq=1, dtype=dtype)
        yield llama(f"interleaved-{str(dtype)[6:]}", dtype=dtype, interleaved=True)
    for dim in (64, 80, 96, 128, 256):
        yield llama(f"head-dim-{dim}", batch=1, heads=2, kv_heads=1, seq=2, dim=dim, dtype=BF16)
    yield llama("head-dim-80-interleaved", batch=1, heads=2, kv_heads=1, seq=2, dim=80, interleaved=True)
    yield llama("angles-shared-by-batch", angle_batch=1)
    yield llama("decode-batch-8", batch=8, seq=1, heads=2, kv_heads=1, dim=16, angle_batch=8)
    yield llama("multi-head-attention", heads=3, kv_heads=3, dim=16)
    yield custom("bshd-unsqueeze-dim-2", _bshd)
    yield custom("fused-qkv-slices", _fused_qkv)
    yield custom("contiguous-q-k", _contiguous)
    yield custom("rank-3", _rank3)
    yield custom("expanded-angles", _expanded_angles)
    yield custom("column-stride-2", _column_stride)
    yield llama("one-head-one-batch", batch=1, heads=1, kv_heads=1, seq=4, dim=16)
    yield llama("dtype-f64-declined", dtype=F64)
    # bf16 q/k with fp32 cos/sin: the reference promotes to fp32 (declined)
    yield llama("mixed-dtypes-declined", dim=16, dtype=BF16, angle_dtype=F32, ulps=ULPS[F32])
    yield llama("empty-declined", seq=0, dim=16)
    # one sequence of q/k and cos/sin for two: the result grows to two (declined)
    yield llama("angles-grow-the-batch-declined", batch=1, dim=16, angle_batch=2)
    yield custom("odd-head-dim-declined", _odd_head_dim)
    yield _error("error-partial-rotary", "must match the size of tensor", angle_dim=4)
    yield _error("error-angles-batch-mismatch", "must match the size of tensor", angle_batch=3)
    yield _error("error-unsqueeze-dim-out-of-range", "Dimension out of range", IndexError, unsqueeze_dim=4)
    yield _error("error-odd-head-dim-interleaved", "stack expects each tensor to be equal size", q_dim=7,
                 angle_dim=7, interleaved=True)


CASES = {OP: list(_cases())}
