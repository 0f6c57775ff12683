"""flaggems::rms_norm / flaggems::add_rms_norm end to end (the generic kernels).

The conformance kit compares the forward with the reference case by case;
these tests cover what it cannot: the ops through ``flaggems.enable()`` (planned,
then replayed), gradients against the reference's autograd and a float64
computation (the sum's own gradient included), both kernel paths (whole rows in
registers and chunked long rows), several row tiles per backward program,
strided and expanded operands, declines giving the reference's results,
double backward, determinism, ``torch.compile``, and a compile of the kernels
for sm_90 (no GPU needed).
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from conftest import run_compiled

import flaggems
from flaggems import autograd, ops, testing
from flaggems.binding import native_scope
from flaggems.runtime import RUNTIME

DEV = torch.device(flaggems.backend().device_type)
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
EPS = 1e-6
ROUTES = ["flaggems::rms_norm", "flaggems::add_rms_norm"]


def call(add, x, r, w, offset=0.0, cast_first=True):
    """Either op through the dispatcher: ``(normed,)`` or ``(normed, sum)``."""
    if add:
        return torch.ops.flaggems.add_rms_norm(x, r, w, EPS, offset, cast_first)
    return (torch.ops.flaggems.rms_norm(x, w, EPS, offset, cast_first),)


def reference(add, x, r, w, offset=0.0, cast_first=True):
    """The references of :mod:`flaggems.ops`, natively (flaggems' routes bypassed)."""
    with native_scope():
        if add:
            return ops.add_rms_norm(x, r, w, EPS, offset, cast_first)
        return (ops.rms_norm(x, w, EPS, offset, cast_first),)


def float64(add, x, r, w, offset=0.0, cast_first=True):
    """The float64 normalisation (no intermediate rounding) of ``x`` (plus ``r``), weighted."""
    with native_scope():
        total = x.double() + (r.double() if add else 0)
        n = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + EPS)
        y = n if w is None else n * (w.double() + offset)
        return (y, total) if add else (y,)


def leaves(shape, dtype, wdtype=None, weight=True, seed=0):
    torch.manual_seed(seed)
    x = (2 * torch.randn(shape, dtype=torch.float64, device=DEV)).to(dtype).requires_grad_()
    r = torch.randn(shape, dtype=torch.float64, device=DEV).to(dtype).requires_grad_()
    w = None
    if weight:
        w = (1 + 0.5 * torch.randn(shape[-1], dtype=torch.float64, device=DEV)).to(wdtype or dtype).requires_grad_()
    return x, r, w


def grads(outputs, inputs, seed=1):
    """Gradients of ``inputs`` for seeded output gradients (one per output)."""
    torch.manual_seed(seed)
    wanted = [t for t in inputs if t is not None]
    outs = [torch.randn_like(o) for o in outputs]
    return torch.autograd.grad(outputs, wanted, outs)


def assert_ulps(actual, expected, ulps):
    tol = ulps * testing.ULP[actual.dtype]
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol)


def stats(op, autograd_key=True):
    key = RUNTIME.active_backend().dispatch_key
    return RUNTIME.plan_stats().get(f"flaggems::{op}@{'Autograd' if autograd_key else ''}{key}", {})


#: (label, input dtype, weight: dtype or None, weight_offset, cast_first)
CONFIGS = [
    ("f32", F32, F32, 0.0, True),
    ("f16", F16, F16, 0.0, True),
    ("bf16", BF16, BF16, 0.0, True),
    ("bf16-no-weight", BF16, None, 0.0, True),
    ("bf16-gemma", BF16, BF16, 1.0, False),
    ("bf16-autocast-f32-weight", BF16, F32, 0.0, True),
    ("f16-offset-cast-first", F16, F16, 0.5, True),
]


@pytest.mark.parametrize("add", [False, True], ids=["rms_norm", "add_rms_norm"])
@pytest.mark.parametrize("label,dtype,wdtype,offset,cast_first", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_forward_and_backward_against_the_reference(add, label, dtype, wdtype, offset, cast_first):
    """Planned, then replayed (forward and backward); outputs and every gradient equal the reference's
    autograd (within ulps) and float64 (within the dtype's tolerance)."""
    x, r, w = leaves((2, 3, 96), dtype, wdtype, weight=wdtype is not None)
    inputs = (x, r, w) if add else (x, w)
    expected = reference(add, x, r, w, offset, cast_first)
    expected_grads = grads(expected, inputs)
    exact = float64(add, x, r, w, offset, cast_first)
    with flaggems.enabled(include=ROUTES):
        for _ in range(3):  # Python node; C++ node, its backward planned; both replayed
            out = call(add, x, r, w, offset, cast_first)
            assert autograd.is_node(out[0].grad_fn)
            got_grads = grads(out, inputs)
        op = "add_rms_norm" if add else "rms_norm"
        assert stats(op)["replay"] >= 1, stats(op)
        backward = RUNTIME.plan_stats().get(f"flaggems::{op}_backward@backward", {})
        assert backward.get("miss") == 1 and backward.get("replay") == 1, backward
    ulps = 4 if dtype == F32 else 3  # the interpreter's truncating bf16 casts: one more
    for a, e in zip(out, expected):
        assert a.dtype == e.dtype and a.shape == e.shape and a.stride() == e.stride()
        assert_ulps(a, e, ulps if a.dtype == dtype else 3 * 2**16)
    half = 2.0**-8 if dtype == BF16 else 2.0**-11 if dtype == F16 else 2.0**-22
    for a, e in zip(out, exact):
        torch.testing.assert_close(a.double(), e, rtol=4 * half, atol=4 * half * 4)
    for a, e in zip(got_grads, expected_grads):
        assert a.dtype == e.dtype and a.shape == e.shape
        # dweight: the reference rounds each product to the output dtype before summing; we sum in fp32
        scale = e.double().abs().max().item()
        torch.testing.assert_close(a.double(), e.double(), rtol=8 * half, atol=8 * half * scale)


def test_add_rms_norm_grads_of_input_and_residual_are_the_sums_gradient():
    """d(sum) = dnorm + grad(sum), the same for the input and the residual, in float64 terms."""
    x, r, w = leaves((4, 40), F32)
    gy, gt = torch.randn(4, 40, device=DEV), torch.randn(4, 40, device=DEV)
    with flaggems.enabled(include=ROUTES):
        y, total = call(True, x, r, w)
        gx, gr, gw = torch.autograd.grad((y, total), (x, r, w), (gy, gt))
    torch.testing.assert_close(gx, gr, rtol=0, atol=0)
    t64, w64 = (x.detach().double() + r.detach().double()).requires_grad_(), w.detach().double().requires_grad_()
    y64 = float64(False, t64, None, w64)[0]
    e_total, e_w = torch.autograd.grad((y64, t64), (t64, w64), (gy.double(), gt.double()))
    torch.testing.assert_close(gx.double(), e_total, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw.double(), e_w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("H", [9000, 20000], ids=["backward-chunked", "both-chunked"])
@pytest.mark.parametrize("add", [False, True], ids=["rms_norm", "add_rms_norm"])
def test_long_rows_take_the_chunked_path(add, H):
    """Past the whole-row limits (forward 16384, backward 8192): chunks read twice, same values."""
    x, r, w = leaves((2, H), F32)
    inputs = (x, r, w) if add else (x, w)
    expected = reference(add, x, r, w)
    expected_grads = grads(expected, inputs)
    with flaggems.enabled(include=ROUTES):
        out = call(add, x, r, w)
        got = grads(out, inputs)
    for a, e in zip(out, expected):
        assert_ulps(a, e, 4)
    for a, e in zip(got, expected_grads):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5 * e.abs().max().item())


def test_several_row_tiles_per_backward_program_and_determinism():
    """More row tiles than programs (each program sums its tiles' dweight partials): equal to the reference,
    and the same bits on every run."""
    x, r, w = leaves((7, 29, 64), BF16)
    expected = grads(reference(True, x, r, w), (x, r, w))
    with flaggems.enabled(include=ROUTES):
        runs = [grads(call(True, x, r, w), (x, r, w)) for _ in range(3)]
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, runs[0]))
    for a, e in zip(runs[0], expected):
        torch.testing.assert_close(a.double(), e.double(), rtol=2**-5, atol=2**-5 * e.double().abs().max().item())


@pytest.mark.parametrize("layout", ["heads-transposed", "sliced", "padded"])
def test_strided_inputs_and_gradients(layout):
    """Inputs read in place through their row strides; an expanded output gradient (``.sum()``'s) too."""
    torch.manual_seed(0)
    base = torch.randn(2, 5, 4, 32, device=DEV)
    if layout == "heads-transposed":  # [B, heads, S, D] view of [B, S, heads * D]
        x = base.transpose(1, 2)
    elif layout == "sliced":
        x = torch.randn(2, 10, 4, 32, device=DEV)[:, ::2]
    else:
        x = torch.randn(2, 5, 4, 40, device=DEV)[..., :32]
    x.requires_grad_()
    w = torch.randn(32, device=DEV, requires_grad=True)
    expected_y = reference(False, x, None, w)[0]
    expected = torch.autograd.grad(expected_y.sum(), (x, w))
    with flaggems.enabled(include=ROUTES):
        y = call(False, x, None, w)[0]
        got = torch.autograd.grad(y.sum(), (x, w))
    assert autograd.is_node(y.grad_fn) and y.stride() == expected_y.stride()
    assert_ulps(y, expected_y, 4)
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("make", [
    pytest.param(lambda: torch.randn(3, 16, dtype=torch.float64, device=DEV), id="fp64"),
    pytest.param(lambda: torch.randn(3, 16, 2, device=DEV)[..., 0], id="hidden-strided"),
    pytest.param(lambda: torch.randn(4, 4, 4, 4, 16, device=DEV)[::2, ::2, ::2, ::2], id="rows-do-not-collapse"),
])
def test_declines_give_the_references_result_and_gradients(make):
    torch.manual_seed(0)
    x = make().requires_grad_()  # made on the device: .to() would copy a strided CPU tensor contiguous
    w = torch.randn(16, dtype=x.dtype, device=DEV, requires_grad=True)
    expected_y = reference(False, x, None, w)[0]
    expected = torch.autograd.grad(expected_y.sum(), (x, w))
    with flaggems.enabled(include=ROUTES):
        y = call(False, x, None, w)[0]
        got = torch.autograd.grad(y.sum(), (x, w))
    assert not autograd.is_node(y.grad_fn)
    torch.testing.assert_close(y, expected_y, rtol=0, atol=0)
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


def test_no_grad_calls_replay_without_a_graph():
    x, r, w = (t.detach() for t in leaves((3, 64), BF16))
    expected = reference(True, x, r, w)
    with flaggems.enabled(include=ROUTES):
        for _ in range(3):
            out = call(True, x, r, w)
        assert stats("add_rms_norm")["replay"] == 2 and stats("add_rms_norm")["python"] == 0
    assert out[0].grad_fn is None
    for a, e in zip(out, expected):
        assert_ulps(a, e, 3)


@pytest.mark.parametrize("add", [False, True], ids=["rms_norm", "add_rms_norm"])
def test_double_backward_is_the_references(add):
    """``create_graph=True``: the backward recomputes through the reference, differentiable again."""
    x, r, w = leaves((3, 24), torch.float32)
    inputs = (x, r, w) if add else (x, w)

    def second_order(fn):
        out = fn()
        first = torch.autograd.grad(out, inputs, [torch.ones_like(o) * 0.5 for o in out], create_graph=True)
        return torch.autograd.grad(sum((g * g).sum() for g in first), inputs)

    expected = second_order(lambda: reference(add, x, r, w))
    with flaggems.enabled(include=ROUTES):
        got = second_order(lambda: call(add, x, r, w))
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)


def test_torch_compile_aot_eager_without_graph_breaks():
    x, r, w = (t.detach() for t in leaves((2, 3, 64), F32))
    x.requires_grad_()
    w.requires_grad_()

    def layer(x, r, w):
        y, total = torch.ops.flaggems.add_rms_norm(x, r, w, EPS)
        return torch.ops.flaggems.rms_norm(y * 2 + total, w, EPS)

    with native_scope():
        expected = layer(x, r, w)
        expected_grads = torch.autograd.grad(expected.sum(), (x, w))
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    with flaggems.enabled(include=ROUTES):
        for _ in range(2):
            got = compiled(x, r, w)
            got_grads = torch.autograd.grad(got.sum(), (x, w))
    torch._dynamo.reset()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for a, e in zip(got_grads, expected_grads):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


def test_kernels_compile_for_sm90():
    """The interpreter never compiles: build representative variants for an H100/H200 target."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    script = textwrap.dedent("""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from flaggems.plugins.generic import rms_norm as rn

        def build(fn, pointers, constexprs, warps=8):
            sig = {p.name: "constexpr" if p.name in constexprs else pointers.get(p.name, p.annotation_type or "fp32")
                   for p in fn.params}
            attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params) if sig[p.name][0] == "*"}
            src = ASTSource(fn, signature=sig, constexprs=constexprs, attrs=attrs)
            return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})

        fwd = {"x": "*bf16", "res": "*bf16", "w": "*bf16", "y": "*bf16", "total": "*bf16", "rstd": "*fp32"}
        bwd = {"dy": "*bf16", "dsum": "*bf16", "x": "*bf16", "rstd": "*fp32", "w": "*fp32", "dx": "*bf16",
               "part": "*fp32"}
        for int64 in (False, True):
            for chunks, block, rows in ((1, 1024, 1), (1, 64, 16), (5, 4096, 1)):
                flags = dict(H=block * chunks - 96 * (chunks > 1), BLOCK_H=block, ROWS=rows, CHUNKS=chunks,
                             ALIGNED=True, INT64=int64, W_UNIT=True, HAS_OFFSET=True)
                warps = min(16, max(1, rows * block // 256))  # as the host picks them
                for lead in (1, 3):
                    ptx = build(rn._forward_kernel, fwd, dict(LEAD=lead, HAS_RES=True, HAS_W=True, CAST_FIRST=True,
                                                              SAVE_RSTD=True, **flags), warps)
                    # 8 bf16 a thread: 16-byte accesses
                    assert "ld.global.v4" in ptx.asm["ptx"], "row loads did not vectorise"
                    build(rn._backward_kernel, bwd, dict(LEAD=lead, HAS_DSUM=True, HAS_W=True, CAST_FIRST=True,
                                                         HAS_DX=True, HAS_DW=True, **flags), warps)
                build(rn._backward_kernel, bwd, dict(LEAD=2, HAS_DSUM=False, HAS_W=False, CAST_FIRST=False,
                                                     HAS_DX=False, HAS_DW=True, **flags), warps)
        build(rn._dweight_kernel, {"part": "*fp32", "dw": "*bf16"}, dict(H=896, BLOCK_P=32, BLOCK_C=64), 4)
        print("ok")
    """)
    run_compiled(script)


@pytest.mark.parametrize("add", [False, True], ids=["rms_norm", "add_rms_norm"])
@pytest.mark.parametrize("make", [
    pytest.param(lambda: torch.randn(8, 1, device=DEV).t(), id="1x8-strides-1-1"),
    pytest.param(lambda: torch.randn(8, 1, 2048, device=DEV).as_strided((8, 1, 2048), (2048, 1, 1)),
                 id="decode-size-1-stride-1"),
    pytest.param(lambda: torch.randn(3, 2, 16, device=DEV)[:, :1], id="sliced-to-size-1"),
    pytest.param(lambda: torch.randn(1, 4, 16, device=DEV).transpose(0, 1), id="transposed-size-1"),
])
def test_size_1_dimensions_keep_the_references_strides(add, make):
    """The kit found meta kernels lay a size-1 dimension out unlike the device kernels (``[1, 8]`` with
    strides ``(1, 1)``): the outputs' strides follow TensorIterator's rules, as the reference's do."""
    x = make()
    r = torch.randn_like(x) if add else None
    w = torch.randn(x.shape[-1], device=DEV)
    expected = reference(add, x, r, w)
    with flaggems.enabled(include=ROUTES):
        got = call(add, x, r, w)
        assert not flaggems.binding.DECLINES, "the kernel must serve these layouts, not the reference"
    for a, e in zip(got, expected):
        assert a.stride() == e.stride()
        torch.testing.assert_close(a, e)
