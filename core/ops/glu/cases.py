"""Contract cases of ``flaggems::silu_mul(gate, up)``, ``gelu_tanh_mul(gate, up)`` and ``gelu_mul(gate, up)``.

Inputs as a gated MLP passes them: ``gate`` and ``up`` ``[tokens..., I]``,
the outputs of two linears (contiguous), or the two halves of one merged
``[..., 2 * I]`` projection (row stride ``2 * I``); decode shapes (one token,
size-1 dimensions), intermediate sizes that are no power of two, rank 0 to 4,
dense transposed and permuted layouts (the reference keeps them: the output's
strides are compared), a column stride, an expanded ``up``, and values in the
activations' tails (``|gate|`` up to ~90, infinities, NaN). Calls the kernels
decline (fp64, mixed dtypes, broadcasting, empty inputs, a layout of more than
three uncollapsible dimensions) and a call the reference rejects (its own
error) are cases too.

Tolerances, in units of the output dtype's last place (``rtol = atol``): the
reference rounds ``act(gate)`` to the dtype, then the product (two
roundings); the kernels compute in fp32 and round once. Measured on the CPU
interpreter over 131072 ``3 * randn`` gates, in the kit's ``atol + rtol *
|expected|`` units: bf16 1.3, fp16 0.9 (budget 2; the interpreter's truncating
bf16 store adds one); fp32 silu 1.6, fp32 gelu 3.0: there the reference itself
is 3.0 from float64 (``1 + tanh(z)`` cancels where ``tanh(z)`` is near -1), the
kernel 1.3 (it computes ``2 * sigmoid(2z)``). The exact GELU is torch's own
formula (``erf``), given gelu_tanh's budgets. The fp32 budgets (8 and 16) leave
room for the GPU, where the kernel's ``exp`` (``ex2.approx``) and division
(``div.full``) each err by up to ~2 fp32 ulps, where numpy's are exact.
"""

from __future__ import annotations

import torch

from flaggems.testing import Case
from flaggems.testing._inputs import short_name

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
OPS = ("flaggems::silu_mul", "flaggems::gelu_tanh_mul", "flaggems::gelu_mul")
ULPS = {"flaggems::silu_mul": {F32: 8, F16: 2, BF16: 2, F64: 4},
        "flaggems::gelu_tanh_mul": {F32: 16, F16: 2, BF16: 2, F64: 4},
        "flaggems::gelu_mul": {F32: 16, F16: 2, BF16: 2, F64: 4}}


def _randn(shape: tuple[int, ...], dtype: torch.dtype, dev: torch.device, scale: float = 2.0) -> torch.Tensor:
    return (torch.randn(shape, dtype=torch.float64, device=dev) * scale).to(dtype)


def pair(shape: tuple[int, ...], dtype: torch.dtype = F32):
    """``make``: contiguous ``gate`` and ``up`` of ``shape`` (two linears' outputs)."""

    def make(dev):
        return (_randn(shape, dtype, dev), _randn(shape, dtype, dev, 1.0)), {}

    return make


def merged(shape: tuple[int, ...], dtype: torch.dtype = F32):
    """``make``: ``gate, up = proj.chunk(2, -1)`` of one ``[..., 2 * I]`` projection (row stride ``2 * I``)."""

    def make(dev):
        proj = _randn((*shape[:-1], 2 * shape[-1]), dtype, dev)
        gate, up = proj.chunk(2, -1)
        return (gate, up), {}

    return make


def _transposed(dev):
    """Both dense and transposed alike: the reference keeps their strides."""
    return (_randn((24, 5), F32, dev).t(), _randn((24, 5), F32, dev).t()), {}


def _transposed_gate(dev):
    """``gate`` transposed, ``up`` contiguous: TensorIterator orders by ``gate``'s strides first."""
    return (_randn((24, 5), F32, dev).t(), _randn((5, 24), F32, dev)), {}


def _permuted(dev):
    """``[B, S, I]`` stored as ``[S, B, I]`` (both operands)."""
    return (_randn((3, 2, 40), F32, dev).transpose(0, 1), _randn((3, 2, 40), F32, dev).transpose(0, 1)), {}


def _column_stride(dev):
    """Every other column of wider tensors: a column stride of 2, read in place."""
    return (_randn((4, 64), F32, dev)[:, ::2], _randn((4, 64), F32, dev)[:, ::2]), {}


def _expanded_up(dev):
    """``up`` one row expanded over the tokens (stride 0)."""
    return (_randn((6, 48), F32, dev), _randn((1, 48), F32, dev).expand(6, 48)), {}


def _sliced_rows(dev):
    """Every other token of merged halves: rows ``4 * I`` apart, three row dimensions collapsing to two."""
    proj = _randn((2, 6, 64), F32, dev)[:, ::2]
    return (proj[..., :32], proj[..., 32:]), {}


def _scalar(dev):
    return (_randn((), F32, dev), _randn((), F32, dev)), {}


def _tails(dtype: torch.dtype):
    """Gates in the activations' tails and special values (``exp`` overflows, ``x**3`` grows large, ``+inf``:
    the exact GELU's is ``inf``, as ATen's CPU kernel, CUDA's and float64 answer; the kit's CPU side never
    takes oneDNN's NaN there, see :func:`flaggems.testing.run_native`)."""

    def make(dev):
        points = [0.0, -0.0, 1e-30, -1e-30, 3.0, -3.0, 8.0, -8.0, 12.0, -12.0, 20.0, -20.0, 88.0, -88.0, 90.0,
                  -90.0, float("inf"), float("-inf"), float("nan"), 1.5, -1.5, 0.25,
                  -0.25, 5.5, -5.5, 40.0, -40.0, 60.0, -60.0, 2.0, -2.0, 6.0]
        gate = torch.tensor(points, dtype=torch.float64, device=dev).to(dtype).reshape(2, 16)
        return (gate, _randn((2, 16), dtype, dev, 1.0)), {}

    return make


def _declined(dev, kind: str):
    if kind == "fp64":
        return (_randn((3, 16), F64, dev), _randn((3, 16), F64, dev)), {}
    if kind == "mixed":
        return (_randn((3, 16), F32, dev), _randn((3, 16), BF16, dev)), {}
    if kind == "broadcast":
        return (_randn((3, 16), F32, dev), _randn((16,), F32, dev)), {}
    if kind == "empty":
        return (_randn((0, 16), F32, dev), _randn((0, 16), F32, dev)), {}
    # five dimensions, none mergeable with its neighbour: more than the kernels address
    gate, up = (_randn((3, 5, 4, 7, 10), F32, dev)[:, ::2, :, ::2, :8] for _ in range(2))
    return (gate, up), {}


def _cases(op: str) -> list[Case]:
    ulps = ULPS[op]
    cases = []
    for dtype in (F32, F16, BF16):
        tag = short_name(dtype)
        cases += [
            Case(f"prefill-{tag}", pair((2, 3, 96), dtype), ulps=ulps[dtype]),
            Case(f"merged-halves-{tag}", merged((2, 3, 80), dtype), ulps=ulps[dtype]),
            Case(f"tails-{tag}", _tails(dtype), ulps=ulps[dtype]),
        ]
    cases += [
        Case("decode-one-token", pair((1, 1, 176)), ulps=ulps[F32]),
        Case("decode-batch-8", pair((8, 1, 48)), ulps=ulps[F32]),
        Case("merged-halves-one-token", merged((1, 1, 48)), ulps=ulps[F32]),
        Case("merged-halves-2d", merged((5, 40)), ulps=ulps[F32]),
        Case("odd-intermediate", pair((3, 37)), ulps=ulps[F32]),
        Case("rank-1", pair((100,)), ulps=ulps[F32]),
        Case("rank-4", pair((2, 2, 3, 24)), ulps=ulps[F32]),
        Case("size-1-middle", pair((3, 1, 16)), ulps=ulps[F32]),
        Case("scalar", _scalar, ulps=ulps[F32]),
        Case("transposed", _transposed, ulps=ulps[F32]),
        Case("transposed-gate-only", _transposed_gate, ulps=ulps[F32]),
        Case("permuted-dense", _permuted, ulps=ulps[F32]),
        Case("column-stride", _column_stride, ulps=ulps[F32]),
        Case("expanded-up", _expanded_up, ulps=ulps[F32]),
        Case("sliced-rows", _sliced_rows, ulps=ulps[F32]),
        Case("large", pair((4, 2816)), ulps=ulps[F32]),
    ]
    for kind in ("fp64", "mixed", "broadcast", "empty", "uncollapsible"):
        cases.append(Case(f"declined-{kind}", lambda dev, kind=kind: _declined(dev, kind), ulps=ulps[F64]))

    def mismatch(dev):
        return (_randn((3, 4), F32, dev), _randn((3, 5), F32, dev)), {}

    cases.append(Case("error-shapes", mismatch, raises=RuntimeError,
                      match="The size of tensor a (4) must match the size of tensor b (5) at non-singleton "
                            "dimension 1"))
    return cases


CASES = {op: _cases(op) for op in OPS}
