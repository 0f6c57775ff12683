"""``flaggems::rotary_embedding``: the generic kernels against float64 and the op's torch reference.

Inputs as transformers' attention passes them (``q``/``k`` transposed views of
the projections, GQA) and the other layouts the front serves; forward and
backward through ``flaggems.enable()`` (a second call replays the first's
plan), gradients against the reference's autograd, declines, the reference's
output layouts, ``torch.compile`` and the bench workloads.
"""

from __future__ import annotations

import random
import textwrap

import pytest
import torch
from conftest import SM90_PTX, ran, run_compiled

import flaggems
from flaggems import autograd, ops, testing
from flaggems.bench import runner
from flaggems.binding import native_scope
from flaggems.fronts import rotary as front
from flaggems.ops.rotary import shapes as bench_rotary
from flaggems.plugins.generic import rotary as rk
from flaggems.runtime import RUNTIME

DEV = torch.device(flaggems.backend().device_type)
F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
OP = torch.ops.flaggems.rotary_embedding
KEY = "flaggems::rotary_embedding"
ROUTED = "flaggems::rotary_embedding -> generic"
#: Against the reference, in ulps of the dtype: it rounds ``x*cos``, ``rotate(x)*sin`` and their sum, the
#: kernel once (see flaggems.ops.rotary.cases); bfloat16 gets one more (the interpreter truncates).
ULPS = 4
#: Against float64: half an ulp of the result plus the rounding of the inputs' products, relative to |x|.
EXACT_TOL = {F32: 2e-6, F16: 4e-3, BF16: 3e-2}


def angles(batch, seq, dim, dtype, interleaved=False):
    """``cos``/``sin`` as a rotary module builds them (``|cos|, |sin| <= 1``)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=F64, device=DEV) / dim))
    pos = torch.arange(seq, dtype=F64, device=DEV) + 5 * torch.arange(batch, dtype=F64, device=DEV)[:, None]
    freqs = pos[..., None] * inv_freq
    emb = freqs.repeat_interleave(2, -1) if interleaved else torch.cat((freqs, freqs), -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def projections(batch, seq, heads, kv_heads, dim, dtype, grad=False, seed=0):
    """The ``[B, S, H*D]`` projections of q and k (leaves, requiring grad when asked)."""
    torch.manual_seed(seed)
    qp = torch.randn(batch, seq, heads * dim, dtype=F64, device=DEV).to(dtype).requires_grad_(grad)
    kp = torch.randn(batch, seq, kv_heads * dim, dtype=F64, device=DEV).to(dtype).requires_grad_(grad)
    return qp, kp


def heads_view(p, heads, dim):
    """transformers' ``view(B, S, H, D).transpose(1, 2)``."""
    batch, seq = p.shape[:2]
    return p.view(batch, seq, heads, dim).transpose(1, 2)


def reference(*args, **kwargs):
    """The op's torch reference, every op native."""
    with native_scope():
        return ops.rotary_embedding(*args, **kwargs)


def assert_close(actual, expected, ulps=ULPS):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    extra = 1 if actual.dtype == BF16 and actual.device.type == "cpu" else 0
    tol = (ulps + extra) * testing.ULP[actual.dtype]
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


def assert_exact(actual, exact):
    """Within :data:`EXACT_TOL` of a float64 result (absolute: the terms are as large as ``|x|``)."""
    err = (actual.double() - exact).abs().max().item()
    assert err <= EXACT_TOL[actual.dtype] * max(1.0, exact.abs().max().item()), err


FORWARD_KEY = f"{KEY}@Autograd{RUNTIME.active_backend().dispatch_key}"
BACKWARD_KEY = "flaggems::rotary_embedding_backward@backward"


def replayed(key=FORWARD_KEY):
    """Replays of ``key`` so far (the compiled entry's; it serves while no log channel is on)."""
    return RUNTIME.plan_stats().get(key, {}).get("replay", 0)


def replays_observable():
    """Whether interpreted calls can replay in this process.

    The interpreter copies every argument back after a launch (``copy_``). Once a test with a log channel
    on has made the Python entry register its ``copy_`` slot, those copies reach it, after ``disable()``, as
    a native call inside the recording, which keeps interpreted calls of every op on the Python path
    (``aten::group_norm`` too: a core limitation). No such copies on a GPU.
    """
    from flaggems import binding

    return not (testing._interpreted() and any(op == "copy_" for op, _ in binding._PY_SLOTS))


@pytest.fixture
def enabled():
    """flaggems enabled without log channels: the compiled entry plans and replays."""
    with flaggems.enabled():
        yield


# --------------------------------------------------------------------------- routing and forward
def test_routed():
    (route,) = flaggems.routes(KEY)
    assert route["chosen"] == "generic"
    assert route["chain"] == ["generic", "native"]


LAYOUTS = {
    # name: (batch, seq, heads, kv_heads, dim)
    "prefill-gqa": (2, 5, 4, 2, 16),
    "decode-s1": (3, 1, 4, 1, 16),
    "head-dim-80": (1, 3, 2, 1, 80),
}


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate-half", "interleaved"])
@pytest.mark.parametrize("layout,dtype", [("prefill-gqa", F32), ("prefill-gqa", F16), ("prefill-gqa", BF16),
                                          ("decode-s1", F32), ("decode-s1", BF16), ("head-dim-80", BF16)])
def test_forward_matches_float64_and_the_reference(enabled, layout, dtype, interleaved):
    batch, seq, heads, kv_heads, dim = LAYOUTS[layout]
    qp, kp = projections(batch, seq, heads, kv_heads, dim, dtype)
    q, k = heads_view(qp, heads, dim), heads_view(kp, kv_heads, dim)
    cos, sin = angles(batch, seq, dim, dtype, interleaved)
    expected = reference(q, k, cos, sin, 1, interleaved)
    exact = reference(q.double(), k.double(), cos.double(), sin.double(), 1, interleaved)
    before = replayed()
    for _ in range(2):  # the first call plans, the second replays
        actual = OP(q, k, cos, sin, 1, interleaved)
        for a, e, x in zip(actual, expected, exact, strict=True):
            assert a.stride() == e.stride()
            assert_close(a, e)
            assert_exact(a, x)
    if replays_observable():
        assert replayed() == before + 1


# --------------------------------------------------------------------------- layouts
def _random_layout(rng):
    """A random ``q`` (permuted, maybe sliced: not dense) and a ``cos`` that broadcasts to it."""
    rank = rng.choice([2, 3, 4, 4])
    shape = [rng.choice([1, 1, 2, 3]) for _ in range(rank - 1)] + [rng.choice([2, 4])]
    perm = list(range(rank))
    rng.shuffle(perm)
    sliced = rng.random() < 0.3
    base_shape = [shape[p] * (rng.choice([1, 2]) if sliced else 1) for p in perm]
    base = torch.empty(base_shape)
    if sliced:
        base = base[tuple(slice(0, shape[p]) for p in perm)]
    q = base.permute([perm.index(i) for i in range(rank)])
    unsqueeze_dim = rng.randrange(-rank, rank - 1)
    at = unsqueeze_dim + rank if unsqueeze_dim < 0 else unsqueeze_dim
    cshape = [n if rng.random() < 0.6 else 1 for n in shape]
    cshape[-1] = shape[-1]
    del cshape[at]
    cperm = list(range(len(cshape)))
    rng.shuffle(cperm)
    cos = torch.empty([cshape[p] for p in cperm]).permute([cperm.index(i) for i in range(len(cshape))])
    return q, cos, unsqueeze_dim, rng.random() < 0.5


def test_output_strides_are_the_references_on_random_layouts():
    """The front reproduces the reference's output layout (TensorIterator's rules), metadata only."""
    rng = random.Random(0)
    served = 0
    for _ in range(600):
        q, cos, unsqueeze_dim, interleaved = _random_layout(rng)
        try:
            sides = front.sides(q, q, cos, cos, unsqueeze_dim, interleaved)
        except flaggems.Decline:
            continue
        with native_scope():
            expected = ops.rotary_embedding(q, q, cos, cos, unsqueeze_dim, interleaved)[0]
        assert sides[0].out_strides == expected.stride(), (q.shape, q.stride(), cos.shape, cos.stride())
        served += 1
    assert served > 400


def test_output_layout_codes_give_back_the_strides_they_describe():
    """The backward's ``q_layout``/``k_layout``: over the random layouts above, each side's output strides
    round-trip through their code; a dense output's code holds no size (the same code at another length)."""
    from flaggems.toolkit import iterator_layout as il

    rng = random.Random(1)
    dense = 0
    for _ in range(600):
        q, cos, unsqueeze_dim, interleaved = _random_layout(rng)
        try:
            side = front.sides(q, q, cos, cos, unsqueeze_dim, interleaved)[0]
        except flaggems.Decline:
            continue
        code = il.layout_code(side.shape, side.out_strides)
        assert il.strides_of_code(side.shape, code) == tuple(side.out_strides)
        dense += code[0] == il.DENSE_ORDER
    assert dense > 300
    shape = (2, 4, 237, 16)  # a transposed [2, L, 4, 16] projection's output: the same code at every L
    assert il.layout_code(shape, (15168, 16, 64, 1)) == il.layout_code((2, 4, 178, 16), (11392, 16, 64, 1))
    assert il.layout_code((2, 1, 3), (3, 7, 1)) == [il.RAW_STRIDES, 3, 7, 1]  # a size-1 dimension's own stride


def test_transposed_decode_output_keeps_the_references_size_one_stride():
    """``[1, 1, 2, 64]`` k (one kv head): the reference returns (128, 128, 64, 1), not k's (128, 64, 64, 1)."""
    kp = torch.randn(1, 2, 64, device=DEV)
    k = heads_view(kp, 1, 64)
    cos, sin = angles(1, 2, 64, F32)
    assert k.stride() == (128, 64, 64, 1)
    out = rk.rotary_embedding(k, k, cos, sin)[1]
    assert out.stride() == reference(k, k, cos, sin)[1].stride() == (128, 128, 64, 1)


# --------------------------------------------------------------------------- backward
@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate-half", "interleaved"])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("layout", ["prefill-gqa", "decode-s1"])
def test_gradients_match_the_reference(enabled, layout, dtype, interleaved):
    batch, seq, heads, kv_heads, dim = LAYOUTS[layout]
    qp, kp = projections(batch, seq, heads, kv_heads, dim, dtype, grad=True)
    cos, sin = angles(batch, seq, dim, dtype, interleaved)
    torch.manual_seed(1)
    dq = torch.randn(batch, heads, seq, dim, device=DEV).to(dtype)
    dk = torch.randn(batch, kv_heads, seq, dim, device=DEV).to(dtype)

    def grads(call):
        q, k = heads_view(qp, heads, dim), heads_view(kp, kv_heads, dim)
        outs = call(q, k, cos, sin, 1, interleaved)
        return outs, torch.autograd.grad(outs, (qp, kp), (dq, dk))

    (eq, ek), expected = grads(reference)
    qd, kd = (p.detach().double().requires_grad_() for p in (qp, kp))
    with native_scope():
        exact = torch.autograd.grad(ops.rotary_embedding(heads_view(qd, heads, dim), heads_view(kd, kv_heads, dim),
                                                         cos.double(), sin.double(), 1, interleaved), (qd, kd),
                                    (dq.double(), dk.double()))
    before = replayed(BACKWARD_KEY)
    # The first call plans the forward (its node is Python's); the second replays it under the C++ node,
    # whose backward entry plans; the third replays both.
    for _ in range(3):
        (aq, ak), actual = grads(OP)
        assert autograd.is_node(aq.grad_fn)
        assert_close(aq, eq)
        assert_close(ak, ek)
        for a, e, x in zip(actual, expected, exact, strict=True):
            assert_close(a, e)
            assert_exact(a, x)
    if replays_observable():
        assert replayed(BACKWARD_KEY) == before + 1


def test_gradient_is_laid_out_like_q():
    """``dq`` of a transposed ``q`` is transposed too: the projection's gradient is a view, not a copy."""
    qp, kp = projections(2, 3, 4, 2, 16, F32, grad=True)
    q, k = heads_view(qp, 4, 16), heads_view(kp, 2, 16)
    cos, sin = angles(2, 3, 16, F32)
    oq, ok = rk.rotary_embedding(q, k, cos, sin)
    gq, gk = torch.autograd.grad((oq, ok), (q, k), (torch.randn_like(oq), torch.randn_like(ok)))
    assert gq.stride() == q.stride() and gk.stride() == k.stride()


def test_only_k_needs_a_gradient():
    qp, kp = projections(2, 3, 4, 2, 16, F32)
    kp.requires_grad_()
    q, k = heads_view(qp, 4, 16), heads_view(kp, 2, 16)
    cos, sin = angles(2, 3, 16, F32)
    dk = torch.randn(2, 2, 3, 16, device=DEV)
    with flaggems.enabled():
        (actual,) = torch.autograd.grad(OP(q, k, cos, sin)[1], kp, dk)
    (expected,) = torch.autograd.grad(reference(q, k, cos, sin)[1], kp, dk)
    assert_close(actual, expected)


def test_sum_backward_reads_an_expanded_gradient(dispatch_log):
    """``out.sum()``'s gradient is expanded (every stride 0): the kernel reads it in place."""
    qp, kp = projections(2, 3, 4, 2, 16, F32, grad=True)
    cos, sin = angles(2, 3, 16, F32)

    def run(call):
        oq, ok = call(heads_view(qp, 4, 16), heads_view(kp, 2, 16), cos, sin)
        return torch.autograd.grad(oq.sum() + 2 * ok.sum(), (qp, kp))

    expected = run(reference)
    for a, e in zip(run(OP), expected, strict=True):
        assert_close(a, e)


def test_double_backward_matches_the_reference(dispatch_log):
    """``create_graph``: the gradients are differentiable again (with respect to the incoming gradients)."""
    qp, kp = projections(2, 3, 4, 2, 16, F64, grad=True)
    cos, sin = angles(2, 3, 16, F64)
    gq = torch.randn(2, 4, 3, 16, dtype=F64, device=DEV, requires_grad=True)
    gk = torch.randn(2, 2, 3, 16, dtype=F64, device=DEV, requires_grad=True)

    def penalty(call, dtype):
        q, k = heads_view(qp.to(dtype), 4, 16), heads_view(kp.to(dtype), 2, 16)
        outs = call(q, k, cos.to(dtype), sin.to(dtype))
        dq, dk = torch.autograd.grad(outs, (q, k), (gq.to(dtype), gk.to(dtype)), create_graph=True)
        return torch.autograd.grad((dq * dq).sum() + (dk * dk.cos()).sum(), (gq, gk))

    actual = penalty(OP, F32)  # fp32: the kernels serve it (fp64 declines)
    expected = penalty(reference, F32)
    assert ROUTED in ran(dispatch_log)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e)


# --------------------------------------------------------------------------- other layouts (logged)
def _bshd():
    q, k = torch.randn(2, 3, 4, 16, device=DEV), torch.randn(2, 3, 2, 16, device=DEV)
    return (q, k, *angles(2, 3, 16, F32), 2)


def _fused_qkv():
    qkv = torch.randn(2, 3, 8 * 16, device=DEV)
    q, k = heads_view(qkv[..., :64], 4, 16), heads_view(qkv[..., 64:96], 2, 16)
    return (q, k, *angles(2, 3, 16, F32))


def _shared_angles():
    qp, kp = projections(2, 3, 4, 2, 16, F32)
    cos, sin = angles(1, 3, 16, F32)
    return (heads_view(qp, 4, 16), heads_view(kp, 2, 16), cos, sin)


def _column_stride():
    q, k = torch.randn(2, 4, 3, 32, device=DEV)[..., ::2], torch.randn(2, 2, 3, 32, device=DEV)[..., ::2]
    return (q, k, *angles(2, 3, 16, F32))


def _rank3():
    q, k = torch.randn(5, 4, 16, device=DEV), torch.randn(5, 2, 16, device=DEV)
    cos, sin = angles(1, 5, 16, F32)
    return (q, k, cos[0], sin[0], 1)


def _expanded_angles():
    qp, kp = projections(2, 3, 4, 2, 16, F32)
    cos, sin = angles(1, 1, 16, F32)
    return (heads_view(qp, 4, 16), heads_view(kp, 2, 16), cos.expand(2, 3, 16), sin.expand(2, 3, 16))


@pytest.mark.parametrize("make", [_bshd, _fused_qkv, _shared_angles, _column_stride, _rank3, _expanded_angles],
                         ids=lambda f: f.__name__.strip("_"))
def test_other_layouts(dispatch_log, make):
    torch.manual_seed(0)
    args = make()
    expected = reference(*args)
    for _ in range(2):
        actual = OP(*args)
        for a, e in zip(actual, expected, strict=True):
            assert a.stride() == e.stride()
            assert_close(a, e)
    assert ROUTED in ran(dispatch_log)


def test_64_bit_offsets(monkeypatch):
    """The ``INT64`` kernels, forced by a lower limit (the GPU test below crosses 2**31 for real)."""
    monkeypatch.setattr(rk, "INT32_LIMIT", 64)
    impl = front.entry(rk.prepare, rk.launch)  # fresh plan caches
    qp, kp = projections(2, 3, 4, 2, 16, F32)
    q, k = heads_view(qp, 4, 16), heads_view(kp, 2, 16)
    cos, sin = angles(2, 3, 16, F32)
    assert impl is not rk.rotary_embedding
    assert rk.prepare(front.sides(q, k, cos, sin, 1, False), F32, False, False)[0].constexprs["INT64"]
    for a, e in zip(impl(q, k, cos, sin), reference(q, k, cos, sin), strict=True):
        assert_close(a, e)


# --------------------------------------------------------------------------- declines
def test_declines_give_the_references_result(dispatch_log):
    qp, kp = projections(2, 3, 4, 2, 16, F32)
    q, k = heads_view(qp, 4, 16), heads_view(kp, 2, 16)
    cos, sin = angles(2, 3, 16, F32)
    calls = {
        "dtype torch.float64": (q.double(), k.double(), cos.double(), sin.double()),
        "mixed dtypes": (q.to(BF16), k.to(BF16), cos, sin),
        "head dimensions": (q[..., :15], k[..., :15], cos[..., :15], sin[..., :15]),
        "cos/sin do not broadcast": (q[:1], k[:1], cos, sin),
        "empty input": (q[:, :, :0], k[:, :, :0], cos[:, :0], sin[:, :0]),
    }
    for why, args in calls.items():
        actual = OP(*args)
        for a, e in zip(actual, reference(*args), strict=True):
            assert a.dtype == e.dtype and a.stride() == e.stride()
            torch.testing.assert_close(a, e)
        assert any(why in message for message in ran(dispatch_log)), why


@pytest.mark.parametrize("args,match", [
    ({"angle_dim": 8}, "must match the size of tensor"),  # partial rotary: the reference raises
    ({"unsqueeze_dim": 4}, "Dimension out of range"),
])
def test_errors_are_the_references(dispatch_log, args, match):
    qp, kp = projections(2, 3, 4, 2, 16, F32)
    cos, sin = angles(2, 3, args.get("angle_dim", 16), F32)
    with pytest.raises((RuntimeError, IndexError), match=match):
        OP(heads_view(qp, 4, 16), heads_view(kp, 2, 16), cos, sin, args.get("unsqueeze_dim", 1))


def test_angles_that_require_grad_go_to_the_reference(dispatch_log):
    qp, kp = projections(2, 3, 4, 2, 16, F32, grad=True)
    cos, sin = angles(2, 3, 16, F32)
    cos.requires_grad_()
    oq, ok = OP(heads_view(qp, 4, 16), heads_view(kp, 2, 16), cos, sin)
    (oq.sum() + ok.sum()).backward()
    assert cos.grad is not None and not autograd.is_node(oq.grad_fn)
    assert any("cos/sin require grad" in m for m in ran(dispatch_log))


def test_no_grad_runs_the_forward_only(dispatch_log):
    qp, kp = projections(2, 3, 4, 2, 16, F32, grad=True)
    cos, sin = angles(2, 3, 16, F32)
    with torch.no_grad():
        oq, ok = OP(heads_view(qp, 4, 16), heads_view(kp, 2, 16), cos, sin)
    assert not oq.requires_grad and not ok.requires_grad
    assert ROUTED in ran(dispatch_log)


# --------------------------------------------------------------------------- torch.compile and bench
def _rope_attention_inputs(q, k, cos, sin):
    q_rot, k_rot = torch.ops.flaggems.rotary_embedding(q, k, cos, sin)
    return q_rot * 2 + 1, k_rot - 1


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_has_no_graph_break(dispatch_log, backend):
    """``eager`` calls the op (our kernel); ``aot_eager`` decomposes the CompositeImplicitAutograd op into the
    reference's aten ops, which run as torch's (or flaggems') kernels: either way one graph, same values."""
    qp, kp = projections(2, 3, 4, 2, 16, F32)
    args = (heads_view(qp, 4, 16), heads_view(kp, 2, 16), *angles(2, 3, 16, F32))
    with native_scope():
        expected = _rope_attention_inputs(*args)
    torch._dynamo.reset()
    compiled = torch.compile(_rope_attention_inputs, backend=backend, fullgraph=True)
    for _ in range(2):
        for a, e in zip(compiled(*args), expected, strict=True):
            assert_close(a, e)
    if backend == "eager":
        assert ROUTED in ran(dispatch_log)


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
def test_bench_smoke_workload_matches_torch(backward):
    workload = next(w for w in bench_rotary.WORKLOADS if w.name.startswith("fwd+bwd" if backward else "fwd "))
    target = runner.detect()
    result = runner.run_workload(workload, [runner.TORCH, runner.FLAGGEMS], target,
                                 runner.Timing.for_run(smoke=True))
    flaggems_side = result.sides[runner.FLAGGEMS]
    assert flaggems_side.error is None and flaggems_side.match is True
    assert "generic" in flaggems_side.ran
    assert len(bench_rotary.WORKLOADS) == 24


# --------------------------------------------------------------------------- GPU
def test_kernels_compile_for_sm90():
    """The interpreter never compiles: build the variants for an H100/H200 target; loads and stores vectorise."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    script = SM90_PTX + textwrap.dedent("""
        from flaggems.plugins.generic import rotary as rk

        def build(constexprs, dtype):
            return sm90_ptx(rk._rotary_kernel, constexprs, dtype, ("x0", "o0", "x1", "o1", "cos", "sin"))

        for dtype in ("bf16", "fp16", "fp32"):
            for half, half_p2 in ((32, 32), (40, 64), (64, 64)):
                for interleaved in (False, True):
                    for inverse, int64 in ((False, False), (True, True)):
                        flags = dict(BLOCK_R=2048 // (2 * half_p2), HALF=half, HALF_P2=half_p2,
                                     INTERLEAVED=interleaved, INVERSE=inverse, UNIT=True, ALIGNED=True, INT64=int64)
                        ptx = build(flags, dtype)
                        assert "ld.global.v4" in ptx and "st.global.v4" in ptx, (dtype, flags)
            build(dict(BLOCK_R=16, HALF=32, HALF_P2=32, INTERLEAVED=False, INVERSE=False, UNIT=False,
                       ALIGNED=False, INT64=False), dtype)
        print("ok")
    """)
    run_compiled(script)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and ~20 GB of device memory")
def test_beyond_2_31_elements_on_the_gpu():
    """A q of 2**31 + 2**21 bf16 elements (prefill of 524 800 tokens x 32 heads x 128): 64-bit offsets."""
    batch, seq, heads, dim = 1, 524_800, 32, 128
    qp = torch.randn(batch, seq, heads * dim, device="cuda", dtype=BF16)
    kp = torch.randn(batch, seq, 1 * dim, device="cuda", dtype=BF16)
    q, k = heads_view(qp, heads, dim), heads_view(kp, 1, dim)
    cos, sin = (t.cuda() for t in angles(1, 1, dim, BF16))
    cos, sin = cos.expand(batch, seq, dim), sin.expand(batch, seq, dim)
    assert q.numel() > 2**31
    with flaggems.enabled():
        oq, ok = OP(q, k, cos, sin)
    for part in (slice(0, 4), slice(seq - 4, seq)):  # the tail lies beyond 2**31
        eq, ek = reference(q[:, :, part], k[:, :, part], cos[:, part], sin[:, part])
        torch.testing.assert_close(oq[:, :, part], eq, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(ok[:, :, part], ek, rtol=2e-2, atol=2e-2)
