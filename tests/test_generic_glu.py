"""``flaggems::silu_mul``, ``gelu_tanh_mul`` and ``gelu_mul``: the generic kernels against float64 and the references.

Inputs as a gated MLP passes them (two linears' outputs, or the halves of one
merged projection) and the other layouts the front serves; forward and
backward through ``flaggems.enable()`` (a second call replays the first's
plan), gradients against the references' autograd, declines, the references'
output layouts, ``torch.compile``, the bench workloads and the GPU build.
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
from flaggems.fronts import glu as front
from flaggems.ops.glu import shapes as bench_glu
from flaggems.plugins.generic import glu as kernels
from flaggems.runtime import RUNTIME

DEV = torch.device(flaggems.backend().device_type)
F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
NAMES = ("silu_mul", "gelu_tanh_mul", "gelu_mul")
#: Against the reference, in ulps of the dtype (flaggems.ops.glu.cases: the reference rounds twice, the
#: kernel once; its fp32 gelu derivative cancels in ``1 - tanh**2``: 56 ulps measured, 1.8 for the kernel).
ULPS = {"silu_mul": {F32: 8, F16: 2, BF16: 2}, "gelu_tanh_mul": {F32: 64, F16: 2, BF16: 2},
        "gelu_mul": {F32: 16, F16: 2, BF16: 2}}
#: Against float64, in ulps of the dtype: one rounding plus fp32's approximate ``exp`` and division on the GPU
#: (measured on the CPU interpreter: 1.8 for fp32, below 1 for the half types).
EXACT_ULPS = {F32: 8, F16: 1, BF16: 1}


def op(name):
    """``torch.ops.flaggems.<name>``."""
    return getattr(torch.ops.flaggems, name)


def reference(name, *args):
    """The op's torch reference, every op native."""
    with native_scope():
        return getattr(ops, name)(*args)


def assert_close(actual, expected, ulps):
    """Within ``ulps`` (``atol = rtol``, the kit's units); bfloat16 gets one more (the interpreter truncates)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    extra = 1 if actual.dtype == BF16 and actual.device.type == "cpu" else 0
    tol = (ulps + extra) * testing.ULP[actual.dtype]
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, equal_nan=True)


def assert_exact(actual, exact):
    """Within :data:`EXACT_ULPS` of a float64 result."""
    assert_close(actual, exact.to(actual.dtype), EXACT_ULPS[actual.dtype])


def randn(shape, dtype=F32, scale=2.0, seed=0, grad=False):
    torch.manual_seed(seed)
    return (torch.randn(shape, dtype=F64, device=DEV) * scale).to(dtype).requires_grad_(grad)


def key_stats(key):
    return RUNTIME.plan_stats().get(key, {})


def replayed(name):
    """Replays of the op's entry so far (at the Autograd key: the ops are CompositeImplicitAutograd)."""
    return key_stats(f"flaggems::{name}@Autograd{RUNTIME.active_backend().dispatch_key}").get("replay", 0)


@pytest.fixture
def enabled():
    """flaggems enabled without log channels: the compiled entry plans and replays."""
    with flaggems.enabled():
        yield


def _merged(shape, dtype=F32, grad=False):
    proj = randn((*shape[:-1], 2 * shape[-1]), dtype, grad=grad)
    return proj, proj.chunk(2, -1)


# --------------------------------------------------------------------------- routing and forward
@pytest.mark.parametrize("name", NAMES)
def test_routed(name):
    (route,) = flaggems.routes(f"flaggems::{name}")
    assert route["chosen"] == "generic"
    assert route["chain"] == ["generic", "native"]


LAYOUTS = {"prefill": (2, 5, 96), "decode-one-token": (1, 1, 176), "decode-batch": (8, 1, 40)}


@pytest.mark.parametrize("merged", [False, True], ids=["two-linears", "merged-halves"])
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", NAMES)
def test_forward_matches_float64_and_the_reference(enabled, name, layout, dtype, merged):
    shape = LAYOUTS[layout]
    gate, up = _merged(shape, dtype)[1] if merged else (randn(shape, dtype), randn(shape, dtype, 1.0, seed=1))
    expected = reference(name, gate, up)
    exact = reference(name, gate.double(), up.double())
    before = replayed(name)
    for _ in range(2):  # the first call plans, the second replays
        actual = op(name)(gate, up)
        assert actual.stride() == expected.stride()
        assert_close(actual, expected, ULPS[name][dtype])
        assert_exact(actual, exact)
    assert replayed(name) == before + 1


@pytest.mark.parametrize("name", NAMES)
def test_tails_and_special_values(name):
    """``exp`` overflows (silu below -88, gelu below ~-10), ``x**3`` overflows, infinities and NaN: as the
    reference, or closer to float64 where it cancels."""
    values = [0.0, -0.0, 1e-30, 3.0, -3.0, 10.0, -10.0, 20.0, -20.0, 88.0, -88.0, 100.0, -100.0, 1e13, -1e13,
              3e38, -3e38, float("inf"), float("-inf"), float("nan")]
    gate = torch.tensor(values, device=DEV)
    up = torch.full_like(gate, 1.5)
    impl = getattr(kernels, name)
    actual = impl(gate, up)
    expected = reference(name, gate, up)
    if name == "gelu_mul" and DEV.type == "cpu":
        # torch's CPU fp32 GELU gives NaN for +inf in tensors of 2+ elements (float64 gives inf)
        exact = reference(name, gate.double(), up.double()).float()
        expected = torch.where(torch.isposinf(gate), exact, expected)
    assert torch.equal(actual.isnan(), expected.isnan()), (actual, expected)
    assert_close(actual, expected, ULPS[name][F32])
    leaf = gate.clone().requires_grad_()
    (grad,) = torch.autograd.grad(impl(leaf, up), leaf, torch.ones_like(up))
    ref_leaf = gate.clone().requires_grad_()
    (want,) = torch.autograd.grad(reference(name, ref_leaf, up), ref_leaf, torch.ones_like(up))
    finite = want.isfinite()
    assert_close(grad[finite], want[finite], ULPS[name][F32])


def test_64_bit_offsets(monkeypatch):
    """The ``INT64`` kernels, forced by a lower limit."""
    monkeypatch.setattr(kernels, "INT32_LIMIT", 64)
    impl = front.entry(kernels.prepare, kernels.launch, front.SILU)  # fresh plan caches
    _, (gate, up) = _merged((3, 4, 40), grad=False)
    prepared = kernels.prepare(tuple(gate.shape), (gate.stride(), up.stride(), (160, 40, 1)), F32, front.SILU, None,
                               DEV)
    assert prepared[0].constexprs["INT64"]
    assert_close(impl(gate, up), reference("silu_mul", gate, up), ULPS["silu_mul"][F32])
    leaves = gate.detach().requires_grad_(), up.detach().requires_grad_()
    dy = randn((3, 4, 40), seed=2)
    actual = torch.autograd.grad(impl(*leaves), leaves, dy)
    expected = torch.autograd.grad(reference("silu_mul", *leaves), leaves, dy)
    for a, e in zip(actual, expected, strict=True):
        assert_close(a, e, ULPS["silu_mul"][F32])


# --------------------------------------------------------------------------- layouts and tiles
def _random_pair(rng):
    """``gate`` and ``up`` of one shape, each permuted, maybe sliced or expanded."""
    rank = rng.choice([1, 2, 3, 3, 4])
    shape = [rng.choice([1, 1, 2, 3]) for _ in range(rank)]

    def one():
        perm = list(range(rank))
        rng.shuffle(perm)
        sliced = rng.random() < 0.3
        base = torch.empty([shape[p] * (rng.choice([1, 2]) if sliced else 1) for p in perm])
        if sliced:
            base = base[tuple(slice(0, shape[p]) for p in perm)]
        t = base.permute([perm.index(i) for i in range(rank)])
        if rng.random() < 0.15:
            d = rng.randrange(rank)
            t = t.narrow(d, 0, 1).expand(shape)
        return t

    return one(), one()


def test_output_strides_are_the_references_on_random_layouts():
    """The front reproduces the reference's output layout (TensorIterator's rules), metadata only."""
    rng = random.Random(0)
    for _ in range(800):
        gate, up = _random_pair(rng)
        with native_scope():
            expected = ops.silu_mul(gate, up)
        found = front.output_strides(tuple(gate.shape), tuple(gate.stride()), tuple(up.stride()))
        assert found == expected.stride(), (gate.shape, gate.stride(), up.stride())


def test_channels_last_inputs_keep_the_references_layout():
    gate = randn((2, 6, 3, 4)).contiguous(memory_format=torch.channels_last)
    up = randn((2, 6, 3, 4), seed=1).contiguous(memory_format=torch.channels_last)
    out = kernels.silu_mul(gate, up)
    assert out.stride() == reference("silu_mul", gate, up).stride() == gate.stride()


@pytest.mark.parametrize("shape,sms,tile", [
    ((2048, 14336), 132, (1, 2048)),   # prefill: a column tile dividing I, 14336 programs
    ((2048, 2816), 132, (8, 256)),     # 2816 = 11 * 256: no column mask
    ((8, 14336), 132, (1, 512)),       # decode batch: tiles shrink until every SM has a program
    ((1, 2816), 132, (1, 256)),
    ((3, 37), None, (4, 64)),          # no power-of-two divisor: masked columns
])
def test_tiles(shape, sms, tile):
    assert kernels.plan_tile(*shape, sms) == tile


# --------------------------------------------------------------------------- backward
def _grads(call, name, leaves, operands, dy, create_graph=False):
    out = call(name, *operands(*leaves))
    return out, torch.autograd.grad(out, leaves, dy, create_graph=create_graph)


@pytest.mark.parametrize("merged", [False, True], ids=["two-linears", "merged-halves"])
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("name", NAMES)
def test_gradients_match_float64_and_the_reference(enabled, name, dtype, merged):
    shape = (2, 3, 48)
    if merged:
        leaves = (randn((2, 3, 96), dtype, grad=True),)

        def operands(proj):
            return proj.chunk(2, -1)
    else:
        leaves = (randn(shape, dtype, grad=True), randn(shape, dtype, 1.0, seed=1, grad=True))

        def operands(gate, up):
            return gate, up
    dy = randn(shape, dtype, 1.0, seed=2)
    _, expected = _grads(reference, name, leaves, operands, dy)
    exact_leaves = tuple(t.detach().double().requires_grad_() for t in leaves)
    _, exact = _grads(reference, name, exact_leaves, operands, dy.double())
    backward_key = f"flaggems::{name}_backward@backward"
    before = key_stats(backward_key).get("replay", 0)
    # The first call plans the forward (its node is Python's); the second replays it under the C++ node, whose
    # backward entry plans; the third replays both.
    for _ in range(3):
        out, actual = _grads(lambda n, *a: op(n)(*a), name, leaves, operands, dy)
        assert autograd.is_node(out.grad_fn)
        for a, e, x in zip(actual, expected, exact, strict=True):
            assert_close(a, e, ULPS[name][dtype])
            assert_exact(a, x)
    if RUNTIME._binding.registry is not None:
        assert key_stats(backward_key)["replay"] == before + 1


# Calls with log channels on (``dispatch_log``) come after the tests that count replays: a Python-entry
# enable() leaves registrations behind that keep later interpreted calls on the Python path.
def _transposed():
    return randn((24, 5)).t(), randn((24, 5), seed=1).t()


def _transposed_gate_only():
    return randn((24, 5)).t(), randn((5, 24), seed=1)


def _column_stride():
    return randn((4, 64))[:, ::2], randn((4, 64), seed=1)[:, ::2]


def _expanded_up():
    return randn((6, 48)), randn((1, 48), seed=1).expand(6, 48)


def _sliced_rows():
    proj = randn((2, 6, 64))[:, ::2]
    return proj[..., :32], proj[..., 32:]


def _scalar():
    return randn(()), randn((), seed=1)


def _same_tensor():
    x = randn((3, 40))
    return x, x


@pytest.mark.parametrize("make", [_transposed, _transposed_gate_only, _column_stride, _expanded_up, _sliced_rows,
                                  _scalar, _same_tensor], ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("name", NAMES)
def test_other_layouts(dispatch_log, name, make):
    gate, up = make()
    expected = reference(name, gate, up)
    for _ in range(2):
        actual = op(name)(gate, up)
        assert actual.stride() == expected.stride()
        assert_close(actual, expected, ULPS[name][F32])
    assert f"flaggems::{name} -> generic" in ran(dispatch_log)


@pytest.mark.parametrize("wanted", ["gate", "up"])
@pytest.mark.parametrize("name", NAMES)
def test_only_the_gradients_needed(monkeypatch, name, wanted):
    """NEEDS reaches the kernel: one gradient written, the other never allocated."""
    gate = randn((3, 40), grad=wanted == "gate")
    up = randn((3, 40), seed=1, grad=wanted == "up")
    seen = []
    launch = kernels.launch

    def spy(prepared, *tensors):
        seen.append(tensors)
        launch(prepared, *tensors)

    monkeypatch.setattr(kernels, "launch", spy)
    activation = next(act for act, op in front.OPS.items() if op == name)
    impl = front.entry(kernels.prepare, kernels.launch, activation)
    leaf = gate if wanted == "gate" else up
    dy = randn((3, 40), seed=2)
    (actual,) = torch.autograd.grad(impl(gate, up), leaf, dy)
    (expected,) = torch.autograd.grad(reference(name, gate, up), leaf, dy)
    assert_close(actual, expected, ULPS[name][F32])
    dgate, dup = seen[-1][3:]
    assert (dgate is None) == (wanted == "up") and (dup is None) == (wanted == "gate")


@pytest.mark.parametrize("name", NAMES)
def test_sum_backward_reads_an_expanded_gradient(dispatch_log, name):
    """``out.sum()``'s gradient is expanded (every stride 0): the kernel reads it in place."""
    gate, up = randn((4, 40), grad=True), randn((4, 40), seed=1, grad=True)
    actual = torch.autograd.grad(op(name)(gate, up).sum(), (gate, up))
    expected = torch.autograd.grad(reference(name, gate, up).sum(), (gate, up))
    for a, e in zip(actual, expected, strict=True):
        assert_close(a, e, ULPS[name][F32])


def test_a_gradient_that_does_not_collapse_is_copied_first():
    """A permuted ``dy`` of rank 4 breaks the joint collapse: it is copied into the output's layout."""
    gate, up = randn((2, 3, 4, 8), grad=True), randn((2, 3, 4, 8), seed=1, grad=True)
    dy = randn((4, 2, 8, 3), seed=2).permute(1, 3, 0, 2)
    prepared = kernels.prepare((2, 3, 4, 8), (dy.stride(), gate.stride(), up.stride(), (96, 32, 8, 1)), F32,
                               front.SILU, (True, True), DEV)
    assert prepared[3] == (96, 32, 8, 1)
    actual = torch.autograd.grad(kernels.silu_mul(gate, up), (gate, up), dy)
    expected = torch.autograd.grad(reference("silu_mul", gate, up), (gate, up), dy)
    for a, e in zip(actual, expected, strict=True):
        assert_close(a, e, ULPS["silu_mul"][F32])


@pytest.mark.parametrize("name", NAMES)
def test_double_backward_matches_the_reference(dispatch_log, name):
    """``create_graph``: the gradients are differentiable again (a gradient penalty)."""
    gate, up = randn((3, 40), grad=True), randn((3, 40), seed=1, grad=True)
    dy = randn((3, 40), seed=2, grad=True)

    def penalty(call):
        dgate, dup = torch.autograd.grad(call(name, gate, up), (gate, up), dy, create_graph=True)
        return torch.autograd.grad((dgate * dgate).sum() + dup.sin().sum(), (gate, up, dy))

    actual = penalty(lambda n, *a: op(n)(*a))
    assert f"flaggems::{name} -> generic" in ran(dispatch_log)
    expected = penalty(reference)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e)


# --------------------------------------------------------------------------- declines
@pytest.mark.parametrize("name", NAMES)
def test_declines_give_the_references_result(dispatch_log, name):
    gate, up = randn((3, 16)), randn((3, 16), seed=1)
    odd = randn((3, 5, 4, 7, 10))[:, ::2, :, ::2, :8]
    calls = {
        "dtype torch.float64": (gate.double(), up.double()),
        "mixed dtypes": (gate, up.to(BF16)),
        "different shapes": (gate, up[0]),
        "empty input": (gate[:0], up[:0]),
        "do not collapse": (odd, odd),
    }
    for why, args in calls.items():
        actual = op(name)(*args)
        expected = reference(name, *args)
        assert actual.dtype == expected.dtype and actual.stride() == expected.stride()
        torch.testing.assert_close(actual, expected)
        assert any(why in message for message in ran(dispatch_log)), why


@pytest.mark.parametrize("name", NAMES)
def test_errors_are_the_references(dispatch_log, name):
    with pytest.raises(RuntimeError, match="must match the size of tensor b"):
        op(name)(randn((3, 4)), randn((3, 5)))


def test_forward_ad_declines_to_the_reference(dispatch_log):
    import torch.autograd.forward_ad as fwad

    gate, up = randn((3, 16)), randn((3, 16), seed=1)
    tangent = randn((3, 16), seed=2)
    with fwad.dual_level():
        out = op("silu_mul")(fwad.make_dual(gate, tangent), up)
        jvp = fwad.unpack_dual(out).tangent
    with native_scope(), fwad.dual_level():
        want = fwad.unpack_dual(ops.silu_mul(fwad.make_dual(gate, tangent), up)).tangent
    torch.testing.assert_close(jvp, want)
    assert any("forward-AD" in m or "forward-mode AD" in m for m in ran(dispatch_log))


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_without_grad_mode_only_the_forward_runs(dispatch_log, mode):
    gate, up = randn((3, 16), grad=True), randn((3, 16), seed=1, grad=True)
    with getattr(torch, mode)():
        out = op("silu_mul")(gate, up)
    assert not out.requires_grad and out.grad_fn is None
    assert "flaggems::silu_mul -> generic" in ran(dispatch_log)


# --------------------------------------------------------------------------- torch.compile and bench
def _mlp(gate, up):
    return (torch.ops.flaggems.silu_mul(gate, up) * 2 + torch.ops.flaggems.gelu_tanh_mul(up, gate)
            - torch.ops.flaggems.gelu_mul(gate, up))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_has_no_graph_break(dispatch_log, backend):
    """``eager`` calls the ops (our kernels); ``aot_eager`` decomposes the CompositeImplicitAutograd ops into
    the references' aten ops: either way one graph (``fullgraph=True``), the same values."""
    gate, up = randn((4, 40)), randn((4, 40), seed=1)
    with native_scope():
        expected = _mlp(gate, up)
    torch._dynamo.reset()
    compiled = torch.compile(_mlp, backend=backend, fullgraph=True)
    for _ in range(2):
        assert_close(compiled(gate, up), expected, 8)
    if backend == "eager":
        assert "flaggems::silu_mul -> generic" in ran(dispatch_log)


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
@pytest.mark.parametrize("merged", [False, True], ids=["two-linears", "merged"])
def test_bench_smoke_workload_matches_torch(backward, merged):
    workload = next(w for w in bench_glu.WORKLOADS
                    if w.name.startswith(f"silu_mul {'fwd+bwd' if backward else 'fwd'}{' merged' if merged else ' '}"))
    result = runner.run_workload(workload, [runner.TORCH, runner.FLAGGEMS], runner.detect(),
                                 runner.Timing.for_run(smoke=True))
    flaggems_side = result.sides[runner.FLAGGEMS]
    assert flaggems_side.error is None and flaggems_side.match is True
    assert "generic" in flaggems_side.ran
    names = {w.name for w in bench_glu.WORKLOADS}
    assert len(names) == len(bench_glu.WORKLOADS) == 46
    assert "silu_mul fwd 4x512x14336" in names and "gelu_tanh_mul fwd+bwd 8x1x8192" in names
    assert "gelu_mul fwd+bwd merged 2x4096x1280" in names


# --------------------------------------------------------------------------- GPU
def test_kernels_compile_for_sm90():
    """The interpreter never compiles: build the variants for an H100/H200 target; loads and stores vectorise."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    script = SM90_PTX + textwrap.dedent("""
        from flaggems.plugins.generic import glu as k

        def build(fn, constexprs, dtype):
            return sm90_ptx(fn, constexprs, dtype, ("gate", "up", "out", "dy", "dgate", "dup"))

        for dtype in ("bf16", "fp16", "fp32"):
            for act in (0, 1, 2):
                variants = ((1, 2048, False, True, False), (8, 256, True, True, True), (8, 256, False, True, True),
                            (1, 2048, False, False, False))
                for block_r, block_c, two_rows, even, axes in variants:
                    flags = dict(ACT=act, BLOCK_R=block_r, BLOCK_C=block_c, TWO_ROWS=two_rows, EVEN_C=even,
                                 UNIT=True, ALIGNED=True, INT64=False, TWO_AXES=axes)
                    ptx = build(k._glu_kernel, flags, dtype)
                    assert "ld.global.v4" in ptx and "st.global.v4" in ptx, (dtype, flags)
                    if act < 2:  # the exact GELU is erf's polynomial, no division or exp
                        assert "div.full.f32" in ptx and "ex2.approx" in ptx  # fast division and exp
                    for needs in ((True, True), (True, False), (False, True)):
                        ptx = build(k._glu_backward_kernel, dict(NEED_GATE=needs[0], NEED_UP=needs[1], **flags),
                                    dtype)
                        assert "ld.global.v4" in ptx and "st.global.v4" in ptx, (dtype, flags, needs)
                slow = dict(ACT=act, BLOCK_R=4, BLOCK_C=512, TWO_ROWS=True, EVEN_C=False, UNIT=False, ALIGNED=False,
                            INT64=True, TWO_AXES=True)
                build(k._glu_kernel, slow, dtype)
                build(k._glu_backward_kernel, dict(NEED_GATE=True, NEED_UP=True, **slow), dtype)
        print("ok")
    """)
    run_compiled(script)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and ~13 GB of device memory")
def test_beyond_2_31_elements_on_the_gpu():
    """Halves of a merged projection of 2**31 + 2**22 elements each (bf16): 64-bit offsets."""
    tokens, inter = 150_000, 14_344
    proj = torch.randn(tokens, 2 * inter, device="cuda", dtype=BF16)
    gate, up = proj.chunk(2, -1)
    assert gate.numel() >= 2**31
    out = kernels.silu_mul(gate, up)
    for rows in (slice(0, 2), slice(tokens - 2, tokens)):
        want = torch.nn.functional.silu(gate[rows].float()) * up[rows].float()
        torch.testing.assert_close(out[rows].float(), want, rtol=2e-2, atol=2e-2)
