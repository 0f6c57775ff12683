"""native_group_norm / native_group_norm_backward end to end (seed 004 and the peer's defects).

The conformance kit compares every case with torch's native kernel; these
tests cover what the kit cannot: autograd through ``nn.GroupNorm`` with
flaggems enabled, gradcheck in float64, strided inputs torch's native kernel
rejects (compared with torch on a contiguous copy), layouts where torch's CPU
kernel is wrong (compared with a float64 reference), the split and 64-bit
paths forced on small shapes, determinism, and a compile of the kernels for
sm_90 (no GPU needed).
"""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the usual spelling
from conftest import ran, run_compiled, set_kernel_context

import flaggems
from flaggems import testing
from flaggems.binding import native_scope
from flaggems.ops.group_norm.policy import GroupNormPolicy
from flaggems.plugins.generic import group_norm as gn

DEV = torch.device(flaggems.backend().device_type)
A = torch.ops.aten


def reference(x, group, weight, bias, dy, eps=1e-5):
    """Output and gradients of ``F.group_norm`` in float64 on contiguous copies (native torch).

    In a native scope: with flaggems enabled on a machine without a GPU, CPU
    tensors would otherwise be routed to the kernels under test.
    """
    with native_scope():
        x64, w64, b64 = (t.detach().double().contiguous().requires_grad_() for t in (x, weight, bias))
        y = F.group_norm(x64, group, w64, b64, eps)
        return (y, *torch.autograd.grad(y, (x64, w64, b64), dy.double()))


@pytest.fixture
def composite_log(monkeypatch, request):
    """``dispatch_log`` with ``aten::group_norm`` left native: torch's composite calls ``native_group_norm``."""
    monkeypatch.setenv("FLAGGEMS_OP_group_norm", "native")
    return request.getfixturevalue("dispatch_log")


def assert_close(actual, expected, ulps=256):
    tol = ulps * testing.ULP[actual.dtype]
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("channels,groups", [(48, 16), (320, 32)])
def test_nn_group_norm_channels_last_forward_backward(composite_log, channels, groups):
    torch.manual_seed(0)
    module = torch.nn.GroupNorm(groups, channels).to(DEV)
    with torch.no_grad():
        module.weight.normal_(1.0, 0.5)
        module.bias.normal_(0.0, 0.5)
    x = torch.randn(2, channels, 3, 4, device=DEV).contiguous(memory_format=torch.channels_last).requires_grad_()
    dy = torch.randn(2, channels, 3, 4, device=DEV).contiguous(memory_format=torch.channels_last)
    y = module(x)
    y.backward(dy)
    messages = ran(composite_log)
    assert "native_group_norm -> generic" in messages
    assert "native_group_norm_backward -> generic" in messages
    if DEV.type == "cpu":  # torch keeps channels_last on CPU (on CUDA group_norm copies to contiguous first)
        assert y.is_contiguous(memory_format=torch.channels_last)
    expected = reference(x, groups, module.weight, module.bias, dy)
    for actual, wanted in zip((y, x.grad, module.weight.grad, module.bias.grad), expected):
        assert_close(actual, wanted)


def test_gradcheck_float64(composite_log):
    torch.manual_seed(0)
    x = torch.randn(1, 6, 2, 3, device=DEV, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    w = torch.randn(6, device=DEV, dtype=torch.float64)
    b = torch.randn(6, device=DEV, dtype=torch.float64)
    inputs = tuple(t.requires_grad_() for t in (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w, b: F.group_norm(x, 3, w, b), inputs, fast_mode=True)
    assert "native_group_norm_backward -> generic" in ran(composite_log)


def _forward_against_contiguous(x, group, weight=None, bias=None):
    N, C = x.shape[:2]
    HxW = x.numel() // (N * C)
    y, mean, rstd = gn.native_group_norm(x, weight, bias, N, C, HxW, group, 1e-5, dense_only=False)  # group_norm's way
    ey, emean, erstd = A.native_group_norm(x.contiguous(), weight, bias, N, C, HxW, group, 1e-5)
    for a, e in ((y, ey), (mean, emean), (rstd, erstd)):
        assert_close(a, e, ulps=64)
    return y


@pytest.mark.parametrize("make", [
    pytest.param(lambda: torch.randn(2, 6, 4, 10)[:, :, :, ::2], id="sliced-w"),
    pytest.param(lambda: torch.randn(2, 6, 5, 7)[:, :, 1:-1, ::3], id="two-spatial-dims-unmerged"),
    pytest.param(lambda: torch.randn(2, 8, 3, 4, 6)[:, :, ::2, 1:, ::2], id="three-spatial-dims-copied"),
    pytest.param(lambda: torch.randn(2, 6, 1, 1).expand(2, 6, 3, 3), id="expanded"),
    pytest.param(lambda: torch.randn(6, 2, 5).transpose(0, 1), id="transposed-n-c"),
    pytest.param(lambda: torch.randn(2, 12, 6, 6).contiguous(memory_format=torch.channels_last)[:, 2:8, ::2],
                 id="sliced-channels-last"),
])
def test_strided_inputs_torch_rejects(make):
    torch.manual_seed(0)
    x = make().to(DEV)
    C = x.shape[1]
    weight, bias = torch.randn(C, device=DEV), torch.randn(C, device=DEV)
    y = _forward_against_contiguous(x, C // 2 if C % 2 == 0 else 1, weight, bias)
    assert y.shape == x.shape


def test_the_aten_op_on_an_input_torch_rejects_raises_torchs_error():
    """A direct aten::native_group_norm call on a sliced input declines: torch's kernel raises its error."""
    x = torch.randn(2, 6, 4, 10, device=DEV)[..., ::2]
    with flaggems.enabled(), pytest.raises(RuntimeError, match=r"Expected X.is_contiguous\(memory_format\)"):
        torch.ops.aten.native_group_norm(x, None, None, 2, 6, 20, 3, 1e-5)


def test_strided_backward_and_mixed_layouts_against_float64():
    """Channels_last X with a contiguous dY: torch's CPU kernel returns wrong gradients here."""
    torch.manual_seed(0)
    N, C, G = 2, 12, 4
    for x, dy in (
        (torch.randn(N, C, 3, 5).contiguous(memory_format=torch.channels_last), torch.randn(N, C, 3, 5)),
        (torch.randn(N, C, 3, 5), torch.randn(N, C, 3, 5).contiguous(memory_format=torch.channels_last)),
        (torch.randn(N, C, 3, 10)[..., ::2], torch.randn(N, C, 5, 3).transpose(2, 3)),
    ):
        x, dy = x.to(DEV), dy.to(DEV)
        w, b = torch.randn(C, device=DEV), torch.randn(C, device=DEV)
        _, mean, rstd = A.native_group_norm(x.contiguous(), w, b, N, C, 15, G, 1e-5)
        dx, dw, db = gn.native_group_norm_backward(dy, x, mean, rstd, w, N, C, 15, G, [True, True, True])
        _, ex, ew, eb = reference(x, G, w, b, dy)
        for actual, wanted in ((dx, ex), (dw, ew), (db, eb)):
            assert_close(actual, wanted)


@pytest.fixture
def forced_split(monkeypatch):
    """Many programs wanted (K > 1 chunks), tiny tiles, a tiny int32 limit (the int64 variants run)."""
    monkeypatch.setitem(gn.DEFAULT_TARGET, DEV.type, 16)
    monkeypatch.setattr(gn, "INT32_LIMIT", 64)
    # tiny tiles; dweight/dbias loop over samples one at a time
    set_kernel_context(monkeypatch, tuning=lambda key: {"tile": 16, "param_tile": 8, "min_chunk_rows": 1}
                       if key == "group_norm" else {})
    for cache in (gn._FORWARD_PLANS, gn._BACKWARD_PLANS):
        cache.clear()
    gn._target_programs.cache_clear()
    yield
    for cache in (gn._FORWARD_PLANS, gn._BACKWARD_PLANS):
        cache.clear()
    gn._target_programs.cache_clear()


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
def test_split_reduction_and_int64_offsets(forced_split, fmt):
    torch.manual_seed(0)
    N, C, G, H, W = 2, 6, 3, 5, 7
    x = torch.randn(N, C, H, W, device=DEV).contiguous(memory_format=fmt)
    dy = torch.randn(N, C, H, W, device=DEV).contiguous(memory_format=fmt)
    w, b = torch.randn(C, device=DEV), torch.randn(C, device=DEV)
    plan = gn._forward_plan(x, w, b, N, C, H * W, G)
    stats, _, scalars = plan.stats
    assert stats.constexprs["INT64"] and scalars[8] > 1  # 64-bit offsets, several chunks (K) per channel
    y, mean, rstd = gn.native_group_norm(x, w, b, N, C, H * W, G, 1e-5)
    dx, dw, db = gn.native_group_norm_backward(dy, x, mean, rstd, w, N, C, H * W, G, [True, True, True])
    expected = reference(x, G, w, b, dy)
    for actual, wanted in zip((y, dx, dw, db), expected):
        assert_close(actual, wanted)


@pytest.mark.parametrize("fuse", [False, True], ids=["separate-finalize", "finalize-folded"])
@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("mask", [(True, True, True), (True, False, False), (False, True, True),
                                  (True, True, False)])
def test_finalize_folded_or_separate(monkeypatch, fuse, fmt, mask):
    """Both plans (step 2 as its own launch, or merged by every tile) on both layouts and every output mask."""
    set_kernel_context(monkeypatch, tuning=lambda key: {"fuse_limit": 1 << 30 if fuse else 0, "min_chunk_rows": 1}
                       if key == "group_norm" else {})
    monkeypatch.setitem(gn.DEFAULT_TARGET, DEV.type, 16)  # on CPU several chunks (K > 1); a GPU uses its SM count
    monkeypatch.setattr(gn, "_FORWARD_PLANS", {})  # plans made under the patched constants only
    monkeypatch.setattr(gn, "_BACKWARD_PLANS", {})
    gn._target_programs.cache_clear()
    torch.manual_seed(0)
    N, C, G, H, W = 3, 10, 5, 6, 7  # two channels a group, 42 spatial elements
    x = torch.randn(N, C, H, W, device=DEV).contiguous(memory_format=fmt)
    dy = torch.randn(N, C, H, W, device=DEV)
    w, b = torch.randn(C, device=DEV), torch.randn(C, device=DEV)
    for weight, bias in ((w, b), (None, None)):
        plan = gn._forward_plan(x, weight, bias, N, C, H * W, G)
        assert (plan.finalize is None) == fuse
        y, mean, rstd = gn.native_group_norm(x, weight, bias, N, C, H * W, G, 1e-5)
        if weight is None and (mask[1] or mask[2]):
            continue
        grads = gn.native_group_norm_backward(dy, x, mean, rstd, weight, N, C, H * W, G, list(mask))
        ones = torch.ones(C, device=DEV)
        ey, *egrads = reference(x, G, ones if weight is None else weight, ones * 0 if bias is None else bias, dy)
        ref_y, ref_mean, ref_rstd = A.native_group_norm(x.contiguous(), weight, bias, N, C, H * W, G, 1e-5)
        assert_close(y, ey)
        assert_close(mean, ref_mean, ulps=64)
        assert_close(rstd, ref_rstd, ulps=64)
        for wanted_mask, actual, wanted in zip(mask, grads, egrads):
            if wanted_mask:
                assert_close(actual, wanted)
            else:
                assert actual is None
    gn._target_programs.cache_clear()


def test_deterministic():
    torch.manual_seed(0)
    x = torch.randn(2, 320, 6, 6, device=DEV).contiguous(memory_format=torch.channels_last)
    dy = torch.randn_like(x)
    w, b = torch.randn(320, device=DEV), torch.randn(320, device=DEV)
    runs = []
    for _ in range(2):
        y, mean, rstd = gn.native_group_norm(x, w, b, 2, 320, 36, 32, 1e-5)
        runs.append((y, mean, rstd, *gn.native_group_norm_backward(dy, x, mean, rstd, w, 2, 320, 36, 32,
                                                                     [True, True, True])))
    for first, second in zip(*runs):
        assert torch.equal(first, second)


def test_invalid_calls_decline_to_torch(dispatch_log):
    x = torch.randn(2, 6, 4, 4, device=DEV)
    with pytest.raises(RuntimeError, match="numel"):  # torch's check, reached through the decline
        A.native_group_norm(x, None, None, 2, 6, 15, 3, 1e-5)
    with pytest.raises(RuntimeError, match="Expected scalar types of X and dY are same"):
        A.native_group_norm_backward(x.double(), x, x[:, :3, 0, 0], x[:, :3, 0, 0], None, 2, 6, 16, 3,
                                     [True, False, False])
    with pytest.raises(RuntimeError, match="divisible by num_groups"):
        F.group_norm(x, 4)
    messages = ran(dispatch_log)
    assert any("native_group_norm: generic declined: X.numel()" in m for m in messages)


def test_strided_weight_is_read_with_its_strides():
    """torch 2.13's CPU kernel reads a strided weight as if it were contiguous; flaggems copies it (C elements)."""
    torch.manual_seed(0)
    x = torch.randn(2, 6, 4, 4, device=DEV)
    weight, bias = torch.randn(12, device=DEV)[::2], torch.randn(6, 2, device=DEV)[:, 1]
    actual = gn.native_group_norm(x, weight, bias, 2, 6, 16, 3, 1e-5)
    expected = A.native_group_norm(x, weight.contiguous(), bias.contiguous(), 2, 6, 16, 3, 1e-5)
    for a, e in zip(actual, expected):
        assert_close(a, e, ulps=64)
    dy = torch.randn_like(x)
    _, mean, rstd = expected
    actual = gn.native_group_norm_backward(dy, x, mean, rstd, weight, 2, 6, 16, 3, [True, True, True])
    expected = A.native_group_norm_backward(dy, x, mean, rstd, weight.contiguous(), 2, 6, 16, 3, [True] * 3)
    for a, e in zip(actual, expected):
        assert_close(a, e)


def test_kernels_compile_for_sm90():
    """The interpreter never compiles: build representative variants for an H100/H200 target."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    script = textwrap.dedent("""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from flaggems.plugins.generic import group_norm as gn

        def build(fn, pointers, constexprs):
            sig = {p.name: "constexpr" if p.name in constexprs else pointers.get(p.name, p.annotation_type or "i64")
                   for p in fn.params}
            attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params) if sig[p.name][0] == "*"}
            src = ASTSource(fn, signature=sig, constexprs=constexprs, attrs=attrs)
            return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})

        for int64 in (False, True):  # both index widths: the interpreter never type-checks loop-carried values
            tile = dict(BLOCK_C=4, BLOCK_S=1024, SPATIAL2=False, ALIGNED=True, INT64=int64, F64=False)
            cl = dict(BLOCK_C=256, BLOCK_S=16, SPATIAL2=True, ALIGNED=False, INT64=int64, F64=False)
            normalize = {"x": "*bf16", "y": "*bf16", "w": "*fp32", "b": "*fp32", "ws": "*fp32", "mean_out": "*bf16",
                         "rstd_out": "*bf16"}
            for fused in (False, True):  # step 2 separate, and folded into step 3
                ptx = build(gn._normalize_kernel, normalize, dict(X_UNIT=1, Y_UNIT=1, HAS_W=True, HAS_B=True,
                                                                  FUSED=fused, BLOCK_J=16 if fused else 1, **tile))
                assert "ld.global.v4" in ptx.asm["ptx"], "contiguous loads did not vectorise"
            build(gn._stats_kernel, {"x": "*fp32", "ws": "*fp32"}, dict(X_UNIT=2, **cl))
            build(gn._finalize_kernel, {"x": "*fp64", "ws": "*fp64", "mean_out": "*fp64", "rstd_out": "*fp64"},
                  dict(BLOCK_G=64, BLOCK_J=16, INT64=int64, F64=True))
            build(gn._bwd_reduce_kernel, {"dy": "*fp16", "x": "*fp16", "mean": "*fp16", "ws": "*fp32"},
                  dict(DY_UNIT=2, X_UNIT=0, **cl))
            build(gn._bwd_finalize_kernel, {"ws": "*fp32", "w": "*fp32", "mean": "*fp32", "rstd": "*fp32",
                                            "dw": "*fp32", "db": "*fp32"},
                  dict(BLOCK_G=2, BLOCK_J=512, BLOCK_N=4, BLOCK_CF=8, BLOCK_K=128, HAS_W=True, HAS_DW=True,
                       HAS_DB=True, INT64=int64, F64=False))
            dx = {"dy": "*fp32", "x": "*fp32", "dx": "*fp32", "w": "*fp32", "mean": "*fp32", "rstd": "*fp32",
                  "ws": "*fp32", "dw": "*fp32", "db": "*fp32"}
            build(gn._bwd_dx_kernel, dx, dict(DY_UNIT=1, X_UNIT=1, DX_UNIT=1, HAS_W=True, FUSED=False, BLOCK_J=1,
                                              BLOCK_N=1, BLOCK_CF=1, BLOCK_K=1, HAS_DW=False, HAS_DB=False, **tile))
            build(gn._bwd_dx_kernel, dx, dict(DY_UNIT=1, X_UNIT=1, DX_UNIT=1, HAS_W=True, FUSED=True, BLOCK_J=32,
                                              BLOCK_N=4, BLOCK_CF=8, BLOCK_K=4, HAS_DW=True, HAS_DB=True, **tile))
        print("ok")
    """)
    run_compiled(script)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and ~24 GB of device memory")
def test_beyond_2_31_elements_on_the_gpu():
    """2**31 + 128 fp16 elements in two groups: the 64-bit offsets of every kernel, against torch's kernel."""
    N, C, S = 1, 2, 2**30 + 64
    x = torch.randn(N, C, S, device="cuda", dtype=torch.float16)
    native_y, native_mean, native_rstd = A.native_group_norm(x, None, None, N, C, S, 2, 1e-5)
    with flaggems.enabled():
        y, mean, rstd = A.native_group_norm(x, None, None, N, C, S, 2, 1e-5)
    torch.testing.assert_close(mean, native_mean, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(rstd, native_rstd, rtol=1e-3, atol=1e-3)
    for part in (slice(0, 4096), slice(S - 4096, S)):  # the tail lies beyond 2**31
        torch.testing.assert_close(y[:, :, part], native_y[:, :, part], rtol=2e-3, atol=2e-3)
    del y, native_y
    # dy independent of x: with dy = x, dx ~ x - x_hat cancels to ~0 and both sides' fp16 rounding
    # of that difference disagree by more than the tolerance (seen on the H200), proving nothing
    dy = torch.randn_like(x)
    native_dx = A.native_group_norm_backward(dy, x, native_mean, native_rstd, None, N, C, S, 2,
                                             [True, False, False])[0]
    with flaggems.enabled():
        dx = A.native_group_norm_backward(dy, x, mean, rstd, None, N, C, S, 2, [True, False, False])[0]
    for part in (slice(0, 4096), slice(S - 4096, S)):
        torch.testing.assert_close(dx[:, :, part], native_dx[:, :, part], rtol=2e-3, atol=2e-3)


def test_strided_weight_backward_matches_an_independent_float64_reference():
    """``w = randn(3C)[::3]``: ours equals a float64 composite (mean/var/affine by hand) to 1e-12. torch's CUDA
    ``native_group_norm_backward`` differs there by ~1e-4 (H200, torch 2.11): it reads the weight as dense."""
    torch.manual_seed(0)
    N, C, H, W, G = 2, 112, 3, 4, 4
    x = torch.randn(N, C, H, W, dtype=torch.float64, device=DEV, requires_grad=True)
    w = torch.randn(3 * C, dtype=torch.float64, device=DEV)[::3].detach().requires_grad_()
    b = torch.randn(C, dtype=torch.float64, device=DEV, requires_grad=True)
    dy = torch.randn(N, C, H, W, dtype=torch.float64, device=DEV)
    with native_scope():
        xg = x.reshape(N, G, -1)
        mu, var = xg.mean(-1, keepdim=True), xg.var(-1, unbiased=False, keepdim=True)
        y = ((xg - mu) / torch.sqrt(var + 1e-5)).reshape(N, C, H, W) * w[:, None, None] + b[:, None, None]
        expected = torch.autograd.grad(y, (x, w, b), dy)
    _, mean, rstd = gn.native_group_norm(x.detach(), w.detach(), b.detach(), N, C, H * W, G, 1e-5)
    actual = gn.native_group_norm_backward(dy, x.detach(), mean, rstd, w.detach(), N, C, H * W, G, [True] * 3)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- accuracy (issue 38)
def _max_error(actual, exact):
    return (actual.double() - exact).abs().max().item()


@pytest.fixture(params=["default-tiles", "long-lanes", "split-chunks"])
def tiling(request, monkeypatch):
    """Default tiles (one element per lane on these shapes); 32-element tiles in one chunk (lanes of 2-32
    elements); 16-element tiles split over chunks of 2 tiles (channels_last: 32 chunks, merged by step 2)."""
    if request.param != "default-tiles":
        tile = 32 if request.param == "long-lanes" else 16
        set_kernel_context(monkeypatch, tuning=lambda key: {"tile": tile, "min_chunk_rows": 1}
                           if key == "group_norm" else {})
        monkeypatch.setitem(gn.DEFAULT_TARGET, DEV.type, 1 if request.param == "long-lanes" else 64)
    monkeypatch.setattr(gn, "_FORWARD_PLANS", {})
    gn._target_programs.cache_clear()
    yield request.param
    gn._target_programs.cache_clear()


def _against_float64(x, group, weight, bias):
    """Max error against float64 of ``(y, mean, rstd)``: flaggems' kernels (``group_norm``'s way) and torch's."""
    N, C = x.shape[:2]
    HxW = x[0, 0].numel()
    ours = gn.native_group_norm(x, weight, bias, N, C, HxW, group, 1e-5, dense_only=False)
    with native_scope():
        exact = A.native_group_norm(x.double().contiguous(), weight.double(), bias.double(), N, C, HxW, group, 1e-5)
        theirs = A.native_group_norm(x.contiguous(), weight, bias, N, C, HxW, group, 1e-5)
    errors = []
    for y, mean, rstd in (ours, theirs):
        errors.append((_max_error(y, exact[0]), _max_error(mean, exact[1]), _max_error(rstd / exact[2], 1.0)))
    return errors


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=["contiguous", "channels-last"])
@pytest.mark.parametrize("shape,group", [((2, 12, 7, 9), 4), ((2, 16, 4, 8), 4)], ids=["D3-S63", "D4-S32"])
@pytest.mark.parametrize("noise", [1.0, 0.01], ids=["randn", "randn/100"])
def test_offset_input_against_float64(tiling, fmt, shape, group, noise):
    """fp32 ``1e4 + randn * noise``: no worse than torch against float64 (~4e-7 here; torch's CPU kernel ~1e-3,
    and ~0.1 at ``noise=0.01``, where its variance cancels to a few ulps of 1e8): a documented difference.

    ``x * a + (b - mean * a)`` rounds two 1e4-sized terms (1.6e-3); ``(x - mean_hi - mean_lo) * a + b`` does not.
    """
    torch.manual_seed(0)
    x = (1e4 + noise * torch.randn(shape, device=DEV)).contiguous(memory_format=fmt)
    w, b = torch.randn(shape[1], device=DEV), torch.randn(shape[1], device=DEV)
    (y, mean, rstd), (their_y, their_mean, their_rstd) = _against_float64(x, group, w, b)
    assert y <= max(1.25 * their_y, 1e-5)
    assert mean <= max(1.25 * their_mean, 2.0**-24 * 1e4)  # half an ulp of 1e4
    assert rstd <= max(1.25 * their_rstd, 1e-6)


def test_offset_input_through_f_group_norm(dispatch_log):
    """The issue's call: ``F.group_norm`` with flaggems enabled on a channels_last ``1e4 + randn``."""
    torch.manual_seed(0)
    x = (1e4 + torch.randn(2, 12, 7, 9, device=DEV)).contiguous(memory_format=torch.channels_last)
    y = F.group_norm(x, 4)
    assert "group_norm -> generic" in ran(dispatch_log)
    with native_scope():
        exact, theirs = F.group_norm(x.double(), 4), F.group_norm(x, 4)
    assert _max_error(y, exact) <= max(1.25 * _max_error(theirs, exact), 1e-5)


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=["contiguous", "channels-last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's unscaled variance
def test_huge_values_are_finite_and_accurate(tiling, fmt, dtype):
    """``randn * 1e20``: the squares (~1e40) pass fp32's range; scaled by the group's first element's exponent
    they do not (unscaled: NaN, as torch's CPU kernel returns)."""
    torch.manual_seed(0)
    N, C, G, H, W = 1, 6, 2, 4, 5
    x = (torch.randn(N, C, H, W, device=DEV) * 1e20).to(dtype).contiguous(memory_format=fmt)
    w, b = torch.randn(C, device=DEV), torch.randn(C, device=DEV)
    y, mean, rstd = gn.native_group_norm(x, w.to(dtype), b.to(dtype), N, C, H * W, G, 1e-5)
    with native_scope():
        exact, exact_mean, exact_rstd = A.native_group_norm(x.double().contiguous(), w.to(dtype).double(),
                                                            b.to(dtype).double(), N, C, H * W, G, 1e-5)
    assert torch.isfinite(exact).all() and torch.isfinite(y).all()
    assert_close(y, exact, ulps=4 if dtype == torch.bfloat16 else 64)  # bf16: the interpreter truncates
    assert_close(mean / 1e20, exact_mean / 1e20, ulps=4 if dtype == torch.bfloat16 else 64)
    assert_close(rstd * 1e20, exact_rstd * 1e20, ulps=4 if dtype == torch.bfloat16 else 64)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_huge_values_after_a_zero_are_not_nan():
    """A group whose first element is 0 (no scale) and whose others are ~1e20: its variance overflows fp32;
    ``rstd = 0`` then (``y = bias``), never NaN. The other groups stay accurate."""
    torch.manual_seed(0)
    x = torch.randn(2, 6, 4, 4, device=DEV) * 1e20
    x[:, ::3, 0, 0] = 0.0  # the first element of every group (D = 3)
    x[1, 3, 0, 0] = 1e20  # ... but one
    b = torch.randn(6, device=DEV)
    y, mean, rstd = gn.native_group_norm(x, None, b, 2, 6, 16, 2, 1e-5)
    assert torch.isfinite(y).all() and torch.isfinite(mean).all() and torch.isfinite(rstd).all()
    with native_scope():
        exact = A.native_group_norm(x.double(), None, b.double(), 2, 6, 16, 2, 1e-5)[0]
    assert_close(y[1, 3:], exact[1, 3:], ulps=64)


def test_channels_last_chunks_are_not_shorter_than_the_policy_rows():
    """Short chunks of a channels_last input write more partials than they read: at least min_chunk_rows."""
    from flaggems.plugins.generic import group_norm as kernels

    policy = GroupNormPolicy()
    for C, HxW in ((1280, 256), (2560, 64), (320, 4096), (48, 15)):
        t = kernels.plan_tiling(2, C, HxW, True, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        assert t.block_c <= policy.channel_block_max
        assert t.K == 1 or t.chunk_tiles * t.block_s >= policy.min_chunk_rows
    with pytest.raises(ValueError):
        GroupNormPolicy.from_values({"channel_block_max": 300})
