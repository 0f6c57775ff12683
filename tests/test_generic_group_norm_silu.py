"""``flaggems::group_norm_silu`` end to end (the generic kernels: the group norm's, with their SiLU flag).

The conformance kit compares the forward with the reference case by case;
these tests cover what it cannot: the op through ``flaggems.enable()``
(planned, then replayed, forward and backward), gradients against the
reference's autograd and a float64 computation, the layouts read in place
(channels_last, strided, offset) and the gradients' layouts, only the
gradients needed, both kernel paths (step 2 folded or not, chunks, 64-bit
offsets), declines giving the reference's results and errors, double
backward, determinism, ``torch.compile``, the bench workloads and a compile
of the SiLU variants for sm_90 (no GPU needed).
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from conftest import ran, run_compiled, set_kernel_context
from torch.autograd import forward_ad

import flaggems
from flaggems import autograd, ops, testing
from flaggems.bench import runner
from flaggems.binding import native_scope
from flaggems.fronts import group_norm as gn_front
from flaggems.fronts import group_norm_silu as gns_front
from flaggems.ops.group_norm.shapes import group_norm_silu as bench
from flaggems.plugins.generic import group_norm as gn
from flaggems.plugins.generic import group_norm_silu as impl
from flaggems.runtime import RUNTIME

DEV = torch.device(flaggems.backend().device_type)
CL, CL3D = torch.channels_last, torch.channels_last_3d
F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
ROUTE = "flaggems::group_norm_silu"
EPS = 1e-5
#: Against the reference, in ulps of the dtype (the kit's: flaggems.ops.group_norm.cases.silu).
ULPS = {F32: 64, F16: 4, BF16: 4}
#: Relative tolerance against float64 (one rounding; bfloat16: the interpreter's truncating store, one ulp more).
EXACT = {F32: 2e-6, F16: 2**-10, BF16: 2**-7}
#: Gradients, relative to the largest magnitude (halves: the reference rounds z, dz and each dweight term).
GRAD = {F32: 2e-5, F16: 2**-7, BF16: 2**-4}


def leaves(shape, dtype=F32, fmt=None, weight=True, bias=True, grad=False, param_dtype=None, seed=0):
    """``(x, weight, bias)``: ``randn`` input of ``shape`` (in ``fmt``), a weight around 1 and a bias around 0 (or
    ``None``), from one seeded generator; each requires grad when ``grad`` says so."""
    generator = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(shape, generator=generator, device=DEV, dtype=F64).to(dtype)
    affine = torch.randn(2, shape[1], generator=generator, device=DEV, dtype=F64) * 0.5
    affine[0] += 1
    kept = [x if fmt is None else x.contiguous(memory_format=fmt),
            affine[0].to(param_dtype or dtype).clone() if weight else None,
            affine[1].to(param_dtype or dtype).clone() if bias else None]
    return tuple(t if t is None else t.requires_grad_(grad) for t in kept)


def assert_layout(y, x, expected):
    """The op's documented layout: the input's suggested memory format, the reference's on CPU (torch's CUDA
    composite returns a contiguous output for a channels_last input, where the op keeps channels_last)."""
    assert y.stride() == gns_front.allocate(x).stride()
    assert y.is_contiguous(memory_format=gn_front.suggest_memory_format(x))
    assert x.device.type != "cpu" or y.stride() == expected.stride()


def wanted(*tensors):
    return [t for t in tensors if t is not None and t.requires_grad]


def call(x, groups, w, b, eps=EPS):
    """The op through the dispatcher."""
    return torch.ops.flaggems.group_norm_silu(x, groups, w, b, eps)


def reference(x, groups, w, b, dy=None, eps=EPS):
    """The reference's output (and its gradients for ``dy``), every op native."""
    with native_scope():
        y = ops.group_norm_silu(x, groups, w, b, eps)
        return y, (() if dy is None else torch.autograd.grad(y, wanted(x, w, b), dy))


def float64(x, groups, w, b, dy=None, eps=EPS):
    """The same in float64 from the same values (no intermediate rounding)."""
    x64, w64, b64 = (None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in (x, w, b))
    return reference(x64, groups, w64, b64, None if dy is None else dy.double(), eps)


def assert_ulps(actual, expected, ulps):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    extra = 1 if actual.dtype == BF16 and DEV.type == "cpu" else 0  # the interpreter truncates where torch rounds
    tol = (ulps + extra) * testing.ULP[actual.dtype]
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


def assert_scaled(actual, expected, tol):
    """Within ``tol`` relative to each element and to the tensor's largest magnitude."""
    scale = max(expected.double().abs().max().item(), 1e-30)
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol * scale)


def stats(key):
    return RUNTIME.plan_stats().get(key, {})


FORWARD_KEY = f"{ROUTE}@Autograd{RUNTIME.active_backend().dispatch_key}"
BACKWARD_KEY = f"{ROUTE}_backward@backward"


@pytest.fixture
def enabled():
    """flaggems enabled for this op alone, without log channels: the compiled entry plans and replays."""
    with flaggems.enabled(include=[ROUTE]):
        yield


def _recorded(function, calls):
    """``function``, appending each call's positional arguments to ``calls``."""
    def recording(*args, **kwargs):
        calls.append(args)
        return function(*args, **kwargs)

    return recording


@pytest.fixture
def spy(monkeypatch):
    """Record the arguments the kernels' forward and backward receive (``calls["fwd"]``, ``calls["bwd"]``)."""
    calls = {"fwd": [], "bwd": []}
    for kind, name in (("fwd", "group_norm_silu_forward"), ("bwd", "group_norm_silu_backward")):
        monkeypatch.setattr(gn, name, _recorded(getattr(gn, name), calls[kind]))
    return calls


def test_routed():
    (route,) = flaggems.routes(ROUTE)
    assert route["chosen"] == "generic"
    assert route["chain"] == ["generic", "native"]


FORWARD_CASES = [
    # label, shape, groups, dtype, fmt, weight, bias
    ("f32", (2, 6, 3, 4), 3, F32, None, True, True),
    ("f16-channels-last-unet-c320-g32", (1, 320, 2, 3), 32, F16, CL, True, True),  # 10 channels a group
    ("bf16-channels-last-c48-g16", (2, 48, 3, 5), 16, BF16, CL, True, True),
    ("f32-channels-last-no-affine", (2, 12, 3, 3), 4, F32, CL, False, False),
    ("f16-weight-only", (2, 6, 2, 3), 6, F16, None, True, False),
    ("f32-bias-only-one-group", (2, 6, 2, 3), 1, F32, None, False, True),
    ("f32-n-c", (3, 12), 4, F32, None, True, True),
    ("bf16-n-c-l", (2, 6, 5), 2, BF16, None, True, True),
    ("f32-channels-last-3d", (2, 8, 2, 2, 3), 4, F32, CL3D, True, True),
    ("f16-size-1-dims", (1, 6, 1, 5), 3, F16, CL, True, True),
]


@pytest.mark.parametrize("label,shape,groups,dtype,fmt,weight,bias", FORWARD_CASES, ids=[c[0] for c in FORWARD_CASES])
def test_forward_matches_the_reference_and_float64(enabled, label, shape, groups, dtype, fmt, weight, bias):
    x, w, b = leaves(shape, dtype, fmt, weight, bias)
    expected, _ = reference(x, groups, w, b)
    exact, _ = float64(x, groups, w, b)
    before = stats(FORWARD_KEY).get("replay", 0)
    for seed in (0, 1):  # the first call plans, the second (other values, same layout) replays
        if seed:
            x.copy_(leaves(shape, dtype, fmt, weight, bias, seed=seed)[0])
            expected, _ = reference(x, groups, w, b)
            exact, _ = float64(x, groups, w, b)
        y = call(x, groups, w, b)
        assert_layout(y, x, expected)
        assert y.is_contiguous(memory_format=fmt or torch.contiguous_format)
        assert_ulps(y, expected, ULPS[dtype])
        assert_scaled(y, exact.to(dtype), EXACT[dtype])
    if RUNTIME._binding.registry is not None:
        assert stats(FORWARD_KEY)["replay"] == before + 1


GRAD_CASES = [
    # label, shape, groups, dtype, fmt, weight, bias
    ("f32", (2, 6, 3, 4), 3, F32, None, True, True),
    ("f32-channels-last", (2, 10, 3, 3), 5, F32, CL, True, True),
    ("f16-channels-last-unet", (1, 320, 2, 2), 32, F16, CL, True, True),
    ("bf16", (2, 8, 3, 3), 4, BF16, None, True, True),
    ("f32-no-affine", (2, 6, 2, 3), 2, F32, CL, False, False),
    ("f32-weight-only", (2, 6, 2, 3), 6, F32, None, True, False),
    ("f32-bias-only", (2, 6, 2, 3), 3, F32, None, False, True),  # a bias without a weight: its grad declines
    ("f32-3d-channels-last", (1, 8, 2, 2, 3), 2, F32, CL3D, True, True),
    ("f32-n-c-l", (2, 12, 5), 4, F32, None, True, True),
]


@pytest.mark.parametrize("label,shape,groups,dtype,fmt,weight,bias", GRAD_CASES, ids=[c[0] for c in GRAD_CASES])
def test_gradients_match_the_reference_and_float64(enabled, label, shape, groups, dtype, fmt, weight, bias):
    """Planned, then replayed (forward and backward); every gradient equals the reference's autograd and float64
    (relative to its largest magnitude); ``dx`` in the input's memory format."""
    x, w, b = leaves(shape, dtype, fmt, weight, bias, grad=True)
    if w is None and b is not None:
        b.requires_grad_(False)  # torch's backward raises for its gradient (test_bias_grad_without_weight_declines)
    torch.manual_seed(5)
    dy = torch.randn(shape, device=DEV, dtype=F64).to(dtype)
    expected_y, expected = reference(x, groups, w, b, dy)
    exact_y, exact = float64(x, groups, w, b, dy)
    before = stats(BACKWARD_KEY).get("replay", 0)
    # The first call runs the Python node; the second replays the forward under the C++ node, whose backward
    # entry plans; the third replays both.
    for _ in range(3):
        y = call(x, groups, w, b)
        assert autograd.is_node(y.grad_fn)
        grads = torch.autograd.grad(y, wanted(x, w, b), dy)
        assert_ulps(y, expected_y, ULPS[dtype])
        for actual, want, exact_grad in zip(grads, expected, exact, strict=True):
            assert actual.dtype == want.dtype and actual.shape == want.shape
            if actual.shape == x.shape:
                assert actual.is_contiguous(memory_format=fmt or torch.contiguous_format)
            assert_scaled(actual, want, GRAD[dtype])
            assert_scaled(actual, exact_grad, GRAD[dtype])
    if RUNTIME._binding.registry is not None:
        assert stats(BACKWARD_KEY)["replay"] == before + 1


def test_channels_last_is_read_in_place(spy):
    """The caller's tensor reaches the kernels (no copy); the output and the input's gradient keep its layout."""
    x, w, b = leaves((2, 10, 3, 4), fmt=CL, grad=True)
    y = impl.group_norm_silu(x, 5, w, b)
    ((x_seen, *_), ) = spy["fwd"]
    assert x_seen is x and y.is_contiguous(memory_format=CL)
    plan = next(p for k, p in gn._FORWARD_PLANS.items() if k[0] == "silu" and k[1] == x.shape)
    assert plan.x_contiguous is None
    dy = torch.randn(2, 10, 3, 4, device=DEV).contiguous(memory_format=CL)
    (dx,) = torch.autograd.grad(y, x, dy)
    ((dy_seen, x_seen, *_), ) = spy["bwd"]
    assert x_seen is x and dy_seen is dy and dx.is_contiguous(memory_format=CL)


@pytest.mark.parametrize("make", [
    pytest.param(lambda: leaves((2, 6, 4, 10))[0][..., ::2], id="sliced"),
    pytest.param(lambda: leaves((3, 16, 3, 5), fmt=CL)[0][1:], id="offset-channels-last"),
    pytest.param(lambda: leaves((2, 5, 4, 6))[0].transpose(2, 3), id="transposed-spatial"),
    pytest.param(lambda: leaves((4, 6, 3, 3))[0][::2], id="every-other-sample"),
])
def test_strided_inputs_are_read_in_place(spy, make):
    x = make().requires_grad_()
    C = x.shape[1]
    _, w, b = leaves((1, C, 1, 1), grad=True, seed=3)
    groups = 2 if C % 2 == 0 else 1
    dy = torch.randn(x.shape, device=DEV)
    expected_y, expected = reference(x, groups, w, b, dy)
    y = impl.group_norm_silu(x, groups, w, b)
    grads = torch.autograd.grad(y, (x, w, b), dy)
    assert spy["fwd"][0][0] is x and spy["bwd"][0][1] is x
    assert_layout(y, x, expected_y)
    assert_ulps(y, expected_y, ULPS[F32])
    for actual, want in zip(grads, expected, strict=True):
        assert_scaled(actual, want, GRAD[F32])


@pytest.mark.parametrize("needs", ["x", "w", "b", "wb", "xb"])
def test_only_the_gradients_needed_are_computed(spy, needs):
    x, w, b = leaves((2, 6, 2, 2))
    for name, t in zip("xwb", (x, w, b)):
        t.requires_grad_(name in needs)
    dy = torch.randn(2, 6, 2, 2, device=DEV)
    grads = torch.autograd.grad(impl.group_norm_silu(x, 3, w, b), wanted(x, w, b), dy)
    (*_, dx, dw, db), = spy["bwd"]
    assert [t is not None for t in (dx, dw, db)] == [name in needs for name in "xwb"]
    for actual, want in zip(grads, reference(x, 3, w, b, dy)[1], strict=True):
        assert_scaled(actual, want, GRAD[F32])


@pytest.fixture(params=["separate-finalize", "finalize-folded"])
def tiling(request, monkeypatch):
    """Both plans (step 2 as its own launch, or merged by every tile), several chunks a channel (K > 1), tiny
    tiles and a tiny int32 limit (the 64-bit offsets)."""
    fuse = request.param == "finalize-folded"
    set_kernel_context(monkeypatch, tuning=lambda key: {"fuse_limit": 1 << 30 if fuse else 0, "tile": 16,
                                                        "param_tile": 8, "min_chunk_rows": 1}
                       if key == "group_norm" else {})
    monkeypatch.setitem(gn.DEFAULT_TARGET, DEV.type, 16)
    monkeypatch.setattr(gn, "INT32_LIMIT", 64)
    monkeypatch.setattr(gn, "_FORWARD_PLANS", {})
    monkeypatch.setattr(gn, "_BACKWARD_PLANS", {})
    gn._target_programs.cache_clear()
    yield fuse
    gn._target_programs.cache_clear()


@pytest.mark.parametrize("fmt", [None, CL])
def test_every_kernel_path(tiling, fmt):
    x, w, b = leaves((2, 6, 5, 7), fmt=fmt, grad=True)
    plan = gn._forward_plan(x, w, b, 2, 6, 35, 3, silu=True, save_affine=True)
    assert (plan.finalize is None) == tiling and plan.stats[0].constexprs["INT64"] and plan.stats[2][8] > 1
    dy = torch.randn(2, 6, 5, 7, device=DEV)
    y = impl.group_norm_silu(x, 3, w, b)
    grads = torch.autograd.grad(y, (x, w, b), dy)
    exact_y, exact = float64(x, 3, w, b, dy)
    assert_scaled(y, exact_y.float(), EXACT[F32])
    for actual, want in zip(grads, exact, strict=True):
        assert_scaled(actual, want, GRAD[F32])


def test_the_saved_statistics_are_fp32_with_the_affine_parameters():
    """Half input: mean and rstd kept in fp32, then the weight and bias in fp32 (1 and 0 when absent)."""
    x, w, _ = leaves((2, 8, 3, 3), F16, fmt=CL)
    y = torch.empty_like(x)
    saved = impl.forward(x, w, None, 2, 8, 9, 4, EPS, y, True)
    assert saved.dtype == F32 and saved.shape == (2 * 8 + 2 * 8,)
    grouped = x.double().reshape(2, 4, -1)
    torch.testing.assert_close(saved[:8].double(), grouped.mean(-1).flatten(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(saved[8:16].double(), (grouped.var(-1, unbiased=False) + EPS).rsqrt().flatten(),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(saved[16:24], w.float()) and torch.equal(saved[24:], torch.zeros(8, device=DEV))


def test_tails_of_the_silu():
    """Biases pushing ``z`` to +-20 and -90 (``exp`` overflows in fp32 past 88): finite, as float64."""
    x, w, _ = leaves((2, 6, 3, 3), grad=True)
    b = torch.tensor([20.0, -20.0, -90.0, 90.0, 0.0, -1.28], device=DEV, requires_grad=True)
    dy = torch.randn(2, 6, 3, 3, device=DEV)
    y = impl.group_norm_silu(x, 3, w, b)
    grads = torch.autograd.grad(y, (x, w, b), dy)
    exact_y, exact = float64(x, 3, w, b, dy)
    assert y.isfinite().all() and all(g.isfinite().all() for g in grads)
    assert_scaled(y, exact_y.float(), EXACT[F32])
    for actual, want in zip(grads, exact, strict=True):
        assert_scaled(actual, want, GRAD[F32])


def test_deterministic():
    x, w, b = leaves((2, 320, 3, 3), fmt=CL, grad=True)
    dy = torch.randn(2, 320, 3, 3, device=DEV)
    runs = []
    for _ in range(2):
        y = impl.group_norm_silu(x, 32, w, b)
        runs.append((y, *torch.autograd.grad(y, (x, w, b), dy)))
    for first, second in zip(*runs, strict=True):
        assert torch.equal(first, second)


def test_no_grad_calls_replay_without_a_graph(enabled):
    x, w, b = leaves((2, 6, 3, 4), BF16, fmt=CL, grad=True)
    expected, _ = reference(x, 3, w, b)
    before = stats(FORWARD_KEY).get("replay", 0)
    with torch.no_grad():
        for _ in range(3):
            y = call(x, 3, w, b)
    assert y.grad_fn is None and not y.requires_grad
    assert_ulps(y, expected.detach(), ULPS[BF16])
    if RUNTIME._binding.registry is not None:
        assert stats(FORWARD_KEY)["replay"] == before + 2


def test_double_backward_is_the_references():
    """``create_graph=True``: the backward recomputes through the reference, differentiable again."""
    x, w, b = leaves((2, 6, 2, 2), fmt=CL, grad=True)

    def penalty(fn):
        y = fn(x, 3, w, b)
        dx, dw = torch.autograd.grad(y, (x, w), torch.ones_like(y) + x.detach(), create_graph=True)
        return torch.autograd.grad((dx * dx).sum() + (dw * dw).sum(), (x, w, b))

    actual = penalty(impl.group_norm_silu)
    with native_scope():
        expected = penalty(ops.group_norm_silu)
    for a, e in zip(actual, expected, strict=True):
        assert_scaled(a, e, 1e-4)


def test_torch_compile_aot_eager_without_graph_breaks(enabled):
    x, w, b = leaves((2, 6, 3, 4), fmt=CL, grad=True)

    def block(x, w, b):
        return torch.ops.flaggems.group_norm_silu(x * 2, 3, w, b) + 1

    with native_scope():
        expected = block(x, w, b)
        expected_grads = torch.autograd.grad(expected.sum(), (x, w, b))
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    for _ in range(2):
        got = compiled(x, w, b)
        got_grads = torch.autograd.grad(got.sum(), (x, w, b))
    torch._dynamo.reset()
    assert_scaled(got, expected, 1e-5)
    for a, e in zip(got_grads, expected_grads, strict=True):
        assert_scaled(a, e, 1e-4)


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
def test_bench_smoke_workloads_match_torch(backward):
    prefix = f"{'fwd+bwd' if backward else 'fwd'} channels_last 2x320x64x64"
    workload = next(w for w in bench.WORKLOADS if w.name.startswith(prefix) and w.dtype == "fp16")
    result = runner.run_workload(workload, [runner.TORCH, runner.FLAGGEMS], runner.detect(),
                                 runner.Timing.for_run(smoke=True))
    side = result.sides[runner.FLAGGEMS]
    assert side.error is None and side.match is True
    assert "generic" in side.ran
    names = {(w.name, w.dtype) for w in bench.WORKLOADS}
    assert len(names) == len(bench.WORKLOADS) == 56
    assert ("fwd contiguous 2x1280x8x8 G32", "fp32") in names and ("fwd+bwd channels_last 2x960x32x32 G32",
                                                                   "fp16") in names


# --------------------------------------------------------------------------- declines (log channels on: last)
def _error(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - whatever the reference raises is the expectation
        return type(exc), str(exc)
    raise AssertionError("no error raised")


@pytest.mark.parametrize("args,why,grad", [
    pytest.param(lambda: leaves((2, 6, 3), F64), "dtype torch.float64", True, id="fp64"),
    pytest.param(lambda: leaves((0, 6, 2, 2)), "empty input", True, id="empty"),
    pytest.param(lambda: leaves((2, 6, 3), F64, weight=False, bias=False), "dtype torch.float64", False,
                 id="fp64-no-grad"),
])
def test_declines_give_the_references_result_and_gradients(dispatch_log, args, why, grad):
    x, w, b = args()
    for t in (x, w, b):
        if t is not None:
            t.requires_grad_(grad)
    y = call(x, 3, w, b)
    assert not autograd.is_node(y.grad_fn)
    expected, _ = reference(x, 3, w, b)
    assert y.dtype == expected.dtype and y.stride() == expected.stride()
    torch.testing.assert_close(y, expected)  # the reference's group norm may itself run flaggems' aten kernels
    if y.numel() and grad:
        dy = torch.ones_like(y)
        grads = torch.autograd.grad(y, wanted(x, w, b), dy)
        for actual, want in zip(grads, reference(x, 3, w, b, dy)[1], strict=True):
            torch.testing.assert_close(actual, want)
    assert any(f"{ROUTE}: generic declined: {why}" in m for m in ran(dispatch_log)), ran(dispatch_log)


@pytest.mark.parametrize("args", [
    pytest.param(lambda: (torch.randn(6, device=DEV), 3, None, None), id="rank-1"),
    pytest.param(lambda: (torch.randn(2, 6, 3, device=DEV), 4, None, None), id="groups-not-dividing-c"),
    pytest.param(lambda: (torch.randn(2, 6, 3, device=DEV), 0, None, None), id="zero-groups"),
    pytest.param(lambda: (torch.randn(2, 6, 3, device=DEV), 3, torch.ones(5, device=DEV), None), id="weight-size"),
    pytest.param(lambda: (torch.randn(2, 6, 3, device=DEV), 3, None, torch.ones(4, device=DEV)), id="bias-size"),
    pytest.param(lambda: (torch.ones(2, 6, 3, device=DEV, dtype=torch.int32), 3, None, None), id="int-input"),
    pytest.param(lambda: (torch.randn(2, 6, 3, device=DEV), 3, torch.ones(6, device=DEV, dtype=F64), None),
                 id="weight-dtype"),
])
def test_errors_are_the_references(dispatch_log, args):
    x, groups, w, b = args()
    with native_scope():
        expected = _error(lambda: ops.group_norm_silu(x, groups, w, b))
    assert _error(lambda: call(x, groups, w, b)) == expected
    assert any(m.startswith(f"{ROUTE}: generic declined") for m in ran(dispatch_log))


def test_bias_grad_without_weight_declines(dispatch_log):
    """torch's backward raises there: the reference keeps the call, so the same error comes."""
    x, _, b = leaves((2, 6, 2, 2), weight=False, grad=True)
    dy = torch.randn(2, 6, 2, 2, device=DEV)
    expected = _error(lambda: reference(x, 3, None, b, dy))
    assert _error(lambda: call(x, 3, None, b).backward(dy)) == expected
    assert any("bias needs grad without a weight" in m for m in ran(dispatch_log))


@pytest.mark.skipif(DEV.type != "cpu", reason="torch's group norm takes mixed dtypes on CPU only")
def test_mixed_half_input_and_fp32_affine_is_served(dispatch_log):
    x, w, b = leaves((2, 6, 3, 3), BF16, grad=True, param_dtype=F32)
    dy = torch.randn(2, 6, 3, 3, device=DEV, dtype=BF16)
    y = call(x, 3, w, b)
    grads = torch.autograd.grad(y, (x, w, b), dy)
    expected_y, expected = reference(x, 3, w, b, dy)
    assert f"{ROUTE} -> generic" in ran(dispatch_log)
    assert_ulps(y, expected_y, ULPS[BF16])
    assert [g.dtype for g in grads] == [BF16, F32, F32]
    for actual, want in zip(grads, expected, strict=True):
        assert_scaled(actual, want, GRAD[BF16])


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # torch's jvp decompositions
def test_forward_ad_declines_to_the_reference(dispatch_log):
    x, w, b = leaves((2, 6, 2, 2))
    tangent = torch.randn_like(x)
    with forward_ad.dual_level():
        actual = forward_ad.unpack_dual(call(forward_ad.make_dual(x, tangent), 3, w, b)).tangent
        with native_scope():
            expected = forward_ad.unpack_dual(ops.group_norm_silu(forward_ad.make_dual(x, tangent), 3, w,
                                                                  b)).tangent
    assert actual is not None
    assert_scaled(actual, expected, 1e-5)
    assert any("forward-AD" in m or "forward-mode AD" in m for m in ran(dispatch_log))


def test_a_negative_view_gradient_is_resolved():
    x, w, b = leaves((2, 6, 2, 3), fmt=CL, grad=True)
    dy = torch.randn(2, 6, 2, 3, device=DEV)
    grads = torch.autograd.grad(impl.group_norm_silu(x, 3, w, b), (x, w, b), torch._neg_view(dy))
    for actual, want in zip(grads, reference(x, 3, w, b, -dy)[1], strict=True):
        assert_scaled(actual, want, GRAD[F32])


# --------------------------------------------------------------------------- GPU
def test_kernels_compile_for_sm90():
    """The interpreter never compiles: build the SiLU variants for an H100/H200 target; loads vectorise."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    script = textwrap.dedent("""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from flaggems.plugins.generic import group_norm as gn

        STATISTICS = {"ws", "mean", "rstd", "mean_out", "rstd_out"}  # fp32 buffers (group_norm_silu's statistics)

        def build(fn, dtype, **constexprs):
            # unannotated parameters are pointers: to fp32 statistics, or to elements of ``dtype``
            signature = {}
            for p in fn.params:
                if p.name in constexprs:
                    signature[p.name] = "constexpr"
                elif p.annotation_type:
                    signature[p.name] = p.annotation_type
                else:
                    signature[p.name] = "*fp32" if p.name in STATISTICS else "*" + dtype
            aligned = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params)
                       if signature[p.name].startswith("*")}
            source = ASTSource(fn, signature=signature, constexprs=constexprs, attrs=aligned)
            return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]

        for dtype in ("fp16", "bf16", "fp32"):
            for int64 in (False, True):
                rows = dict(BLOCK_C=4, BLOCK_S=1024, SPATIAL2=False, ALIGNED=True, INT64=int64, F64=False)
                channels_last = dict(BLOCK_C=256, BLOCK_S=16, SPATIAL2=True, ALIGNED=False, INT64=int64, F64=False)
                for tile, unit in ((rows, 1), (channels_last, 2)):
                    for fused in (False, True):
                        ptx = build(gn._normalize_kernel, dtype, X_UNIT=unit, Y_UNIT=unit, HAS_W=True, HAS_B=True,
                                    FUSED=fused, BLOCK_J=16 if fused else 1, SILU=True, SAVE_AFFINE=True, **tile)
                        assert unit != 1 or "ld.global.v4" in ptx, "contiguous loads did not vectorise"
                    build(gn._bwd_reduce_kernel, dtype, DY_UNIT=unit, X_UNIT=unit, SILU=True, **tile)
                    params = dict(BLOCK_N=4, BLOCK_CF=8, BLOCK_K=4, HAS_DW=True, HAS_DB=True) if unit == 2 else dict(
                        BLOCK_N=1, BLOCK_CF=1, BLOCK_K=1, HAS_DW=False, HAS_DB=False)
                    build(gn._bwd_dx_kernel, dtype, DY_UNIT=unit, X_UNIT=unit, DX_UNIT=unit, HAS_W=True,
                          FUSED=unit == 2, BLOCK_J=32 if unit == 2 else 1, SILU=True, **params, **tile)
        print("ok")
    """)
    run_compiled(script)


def test_a_size_1_dimension_does_not_make_an_input_channels_last(enabled):
    """torch's suggested memory format orders size-1 dimensions too: ``is_contiguous(channels_last)`` alone
    called this input channels_last (the kit's generator found it)."""
    x = torch.empty_strided((2, 2, 1, 5), (10, 1, 40, 2), device=DEV).copy_(torch.randn(2, 2, 1, 5))
    expected, _ = reference(x, 1, None, None)
    y = call(x, 1, None, None)
    assert not flaggems.binding.DECLINES, "the kernel must serve it, not the reference"
    assert gn_front.suggest_memory_format(x) == torch.contiguous_format and y.is_contiguous()
    assert_layout(y, x, expected)
    assert_ulps(y, expected, ULPS[F32])


def test_a_channels_last_1x1_input_gets_the_references_size_1_strides(enabled):
    """``[2, 6, 1, 1]`` channels_last: SiLU's TensorIterator gives ``(6, 1, 1, 1)``, not ``empty_like``'s
    ``(6, 1, 6, 6)`` (the kit's spatial-1x1 case)."""
    x = torch.empty_strided((2, 6, 1, 1), (6, 1, 6, 6), device=DEV).copy_(torch.randn(2, 6, 1, 1))
    expected, _ = reference(x, 2, None, None)
    y = call(x, 2, None, None)
    assert not flaggems.binding.DECLINES
    assert y.stride() == (6, 1, 1, 1) and (DEV.type != "cpu" or y.stride() == expected.stride())
    assert_ulps(y, expected, ULPS[F32])
